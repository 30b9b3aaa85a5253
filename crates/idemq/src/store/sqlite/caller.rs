//! Operations on the caller's own connection to the store's database file:
//! they run inside whatever transaction the caller has open there, so they
//! commit or roll back with the caller's own writes. Each runs in a
//! savepoint of its own, so a failure part-way leaves the caller's
//! transaction as it was, and reads the store's clock once. With no
//! transaction open, each is a `BEGIN IMMEDIATE` transaction of its own.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, Transaction, TransactionBehavior};

use super::{Cx, SqliteStore, check_schema, enqueue, exec};
use crate::error::{Error, Result};
use crate::job::EnqueueResult;
use crate::request::PreparedEnqueue;
use crate::store::JobComplete;

const SAVEPOINT: &str = "idemq_caller";

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

impl SqliteStore {
    /// A new connection to this store's database file, set up as the
    /// store's own connections are (WAL, `synchronous=FULL`, foreign keys,
    /// a 5 s busy timeout), for transactions that write business rows and
    /// idemq's together. Refused for an in-memory store.
    pub fn open_connection(&self) -> Result<Connection> {
        let Some(path) = &self.path else {
            return Err(Error::validation(
                "connection",
                "an in-memory SQLite store has no file another connection could open",
            ));
        };
        super::open_conn(Some(path))
    }

    /// Refuses a connection to another database than this store's file:
    /// its writes would never reach the queue.
    fn check_connection(&self, conn: &Connection) -> Result<()> {
        let theirs = conn.path().filter(|p| !p.is_empty()).map(Path::new);
        match (&self.path, theirs) {
            (Some(mine), Some(theirs)) if canonical(mine) == canonical(theirs) => Ok(()),
            _ => Err(Error::validation(
                "connection",
                "the connection is not to this queue's SQLite database file",
            )),
        }
    }

    /// Runs `f` on the caller's connection in a savepoint: released when it
    /// returns `Ok`, rolled back when it returns `Err`. On a connection with
    /// no transaction open it runs in a `BEGIN IMMEDIATE` transaction of its
    /// own instead (committed or rolled back alike), so the write lock is
    /// taken before the clock and the rows are read.
    fn on_caller<T>(&self, conn: &Connection, f: impl FnOnce(&Cx<'_>) -> Result<T>) -> Result<T> {
        self.check_connection(conn)?;
        if conn.is_autocommit() {
            let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
            check_schema(&self.inner, &tx).map_err(|f| f.error())?;
            let now = self.inner.clock.now().timestamp_micros();
            let out = Cx::run(&tx, now, f)?;
            tx.commit()?;
            // The commit is this call's: wake this process's claims, as the
            // store's own writes do.
            self.wake();
            return Ok(out);
        }
        conn.execute_batch(&format!("SAVEPOINT {SAVEPOINT}"))?;
        if let Err(refused) = check_schema(&self.inner, conn) {
            conn.execute_batch(&format!("ROLLBACK TO {SAVEPOINT}; RELEASE {SAVEPOINT}"))?;
            return Err(refused.error());
        }
        let now = self.inner.clock.now().timestamp_micros();
        let out = Cx::run(conn, now, f);
        let end = match out {
            Ok(_) => format!("RELEASE {SAVEPOINT}"),
            Err(_) => format!("ROLLBACK TO {SAVEPOINT}; RELEASE {SAVEPOINT}"),
        };
        conn.execute_batch(&end)?;
        out
    }

    /// Completes an attempt on the caller's connection (inside the caller's
    /// transaction, if one is open): `LeaseLost` when the lease is not the
    /// job's current one, and nothing written then.
    pub fn complete_on(&self, conn: &Connection, p: &JobComplete) -> Result<()> {
        self.on_caller(conn, |cx| exec::complete(cx, p))?
    }

    /// Enqueues on the caller's connection (inside the caller's
    /// transaction, if one is open), deciding the items in order as
    /// `job_enqueue` does. A refused item writes nothing and leaves the
    /// transaction usable. No in-process wake-up is sent: the commit is the
    /// caller's, so workers find the jobs at their next poll.
    pub fn enqueue_on(
        &self,
        conn: &Connection,
        items: &[PreparedEnqueue],
    ) -> Result<Vec<Result<EnqueueResult>>> {
        self.on_caller(conn, |cx| enqueue::enqueue_all(cx, items))
    }
}
