//! Reading rows back on SQLite: every column by name, every value strictly.
//! A value that cannot be decoded (an unknown name, unreadable JSON, an
//! instant out of range, a NULL or another type where a value must be) is
//! a `Backend` error naming the row, the table and the column; it is never
//! read as a default.

use chrono::{DateTime, Utc};
use rusqlite::types::{FromSql, Type};
use rusqlite::{CachedStatement, Params, Row};
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::job::{JobState, Undecodable};

/// µs since the epoch → instant, if chrono can represent it.
pub(super) fn instant(us: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us)
}

/// One row of `table`, named in errors as `row` (`job 0190…`).
pub(super) struct Cols<'a, 'r> {
    r: &'a Row<'r>,
    table: &'static str,
    row: String,
}

impl<'a, 'r> Cols<'a, 'r> {
    /// A row of `table`, named `row` in errors.
    pub(super) fn new(r: &'a Row<'r>, table: &'static str, row: impl Into<String>) -> Self {
        Self {
            r,
            table,
            row: row.into(),
        }
    }

    /// Names the row once its identity was read (a job's id, say).
    pub(super) fn named(&mut self, row: impl Into<String>) {
        self.row = row.into();
    }

    /// The error for the value of `col` this row holds.
    pub(super) fn bad(&self, col: &str, e: Undecodable) -> Error {
        e.at(&self.row, &format!("{}.{col}", self.table))
    }

    /// The value of `col`: a NULL, another type or an integer out of range
    /// where `T` must be is an error. `T = Option<_>` reads a nullable column.
    pub(super) fn get<T: FromSql>(&self, col: &str) -> Result<T> {
        self.checked(self.r.get::<_, T>(col), col)
    }

    /// The value of the query's column `idx`, named `col`, read as
    /// [`get`](Self::get) reads it but by position (no lookup of the name
    /// on every row).
    pub(super) fn at<T: FromSql>(&self, idx: usize, col: &str) -> Result<T> {
        self.checked(self.r.get::<_, T>(idx), col)
    }

    fn checked<T>(&self, got: rusqlite::Result<T>, col: &str) -> Result<T> {
        got.map_err(|e| match e {
            rusqlite::Error::InvalidColumnType(_, _, Type::Null) => {
                self.bad(col, Undecodable::null("value"))
            }
            rusqlite::Error::InvalidColumnType(_, _, ty) => {
                self.bad(col, Undecodable::described(format!("a value of type {ty}")))
            }
            rusqlite::Error::IntegralValueOutOfRange(_, v) => {
                self.bad(col, Undecodable::invalid("an integer out of range", v))
            }
            // Anything else (an unknown column) is a bug of the query.
            e => e.into(),
        })
    }

    /// An instant stored as µs since the epoch.
    pub(super) fn time(&self, col: &str) -> Result<DateTime<Utc>> {
        let us: i64 = self.get(col)?;
        self.instant(col, us)
    }

    /// A nullable instant stored as µs since the epoch.
    pub(super) fn opt_time(&self, col: &str) -> Result<Option<DateTime<Utc>>> {
        self.get::<Option<i64>>(col)?
            .map(|us| self.instant(col, us))
            .transpose()
    }

    /// `us`, read from `col`, as an instant.
    pub(super) fn instant(&self, col: &str, us: i64) -> Result<DateTime<Utc>> {
        instant(us)
            .ok_or_else(|| self.bad(col, Undecodable::invalid("an instant out of range", us)))
    }

    /// A nullable instant of the query's column `idx`, named `col`.
    pub(super) fn opt_time_at(&self, idx: usize, col: &str) -> Result<Option<DateTime<Utc>>> {
        self.at::<Option<i64>>(idx, col)?
            .map(|us| self.instant(col, us))
            .transpose()
    }

    /// JSON text of the query's column `idx`, named `col`, holding `what`,
    /// parsed where SQLite holds it (a value that is not UTF-8 text is read
    /// as [`json`](Self::json) reads it, for the same error).
    pub(super) fn json_at<T: DeserializeOwned>(
        &self,
        idx: usize,
        col: &str,
        what: &str,
    ) -> Result<T> {
        if let Ok(rusqlite::types::ValueRef::Text(bytes)) = self.r.get_ref(idx)
            && let Ok(text) = std::str::from_utf8(bytes)
        {
            return self.parse(col, what, text);
        }
        let text: String = self.at(idx, col)?;
        self.parse(col, what, &text)
    }

    /// JSON text holding `what` (`payload`, `retry policy`, …).
    pub(super) fn json<T: DeserializeOwned>(&self, col: &str, what: &str) -> Result<T> {
        let text: String = self.get(col)?;
        self.parse(col, what, &text)
    }

    /// Nullable JSON text holding `what`.
    pub(super) fn opt_json<T: DeserializeOwned>(&self, col: &str, what: &str) -> Result<Option<T>> {
        self.get::<Option<String>>(col)?
            .map(|text| self.parse(col, what, &text))
            .transpose()
    }

    fn parse<T: DeserializeOwned>(&self, col: &str, what: &str, text: &str) -> Result<T> {
        serde_json::from_str(text)
            .map_err(|e| self.bad(col, Undecodable::unreadable(what, text, e)))
    }

    /// A job's state from `col`, scheduled or ready by its `run_at` (µs) and `now`.
    pub(super) fn state(&self, col: &str, run_at: i64, now: i64) -> Result<JobState> {
        let stored: String = self.get(col)?;
        JobState::from_stored(&stored, run_at <= now).map_err(|e| self.bad(col, e))
    }

    /// A value of `col` decoded by `f` (an enum's `from_stored`).
    pub(super) fn decode<T>(
        &self,
        col: &str,
        f: impl FnOnce(&str) -> std::result::Result<T, Undecodable>,
    ) -> Result<T> {
        let stored: String = self.get(col)?;
        f(&stored).map_err(|e| self.bad(col, e))
    }
}

/// The first row `stmt` answers `params` with, decoded by `f`.
pub(super) fn one<T, P: Params>(
    mut stmt: CachedStatement,
    params: P,
    f: impl FnOnce(&Row) -> Result<T>,
) -> Result<Option<T>> {
    let mut rows = stmt.query(params)?;
    rows.next()?.map(f).transpose()
}

/// Every row `stmt` answers `params` with, decoded by `f`.
pub(super) fn all<T, P: Params>(
    mut stmt: CachedStatement,
    params: P,
    f: impl FnMut(&Row) -> Result<T>,
) -> Result<Vec<T>> {
    stmt.query_and_then(params, f)?.collect()
}
