//! `idemq migrate` on Redis: loading this binary's library and recording
//! what an installation was migrated for (`<prefix>layout`, `version`,
//! `revision`, `idemq`), and what a store checks of it at connect.

use ::redis::Value;
use ::redis::aio::ConnectionManager;

use super::codec::{self, array, at, int, string};
use super::library::{FUNCTIONS_REVISION, LAYOUT, LIBRARY};
use super::url::RedisUrl;
use super::{durability, open, redis_err, status};
use crate::error::{Error, Result};
use crate::store::{IDEMQ_VERSION, MigrationStatus, newer_schema};

/// What an installation was migrated for.
pub(super) struct Installed {
    /// The data layout (0: never migrated).
    pub(super) layout: i64,
    /// The library version.
    pub(super) version: Option<String>,
    /// The library's revision (none before revisions were recorded).
    pub(super) revision: Option<i64>,
}

pub(super) async fn installed(conn: &mut ConnectionManager, prefix: &str) -> Result<Installed> {
    let (layout, version, revision): (Option<i64>, Option<String>, Option<i64>) = ::redis::pipe()
        .get(format!("{prefix}layout"))
        .get(format!("{prefix}version"))
        .get(format!("{prefix}revision"))
        .query_async(conn)
        .await
        .map_err(redis_err)?;
    Ok(Installed {
        layout: layout.unwrap_or(0),
        version,
        revision,
    })
}

/// The refusal of an installation migrated for a library revision higher
/// than this binary's, if it was.
pub(super) async fn newer_functions(
    conn: &mut ConnectionManager,
    prefix: &str,
    revision: Option<i64>,
) -> Option<Error> {
    let revision = revision.filter(|r| *r > FUNCTIONS_REVISION)?;
    Some(newer_functions_error(
        prefix,
        revision,
        written_by(conn, prefix).await,
    ))
}

fn newer_functions_error(prefix: &str, revision: i64, written_by: Option<String>) -> Error {
    newer_schema(
        &format!("the revision of the idemq functions under the key prefix {prefix:?}"),
        revision,
        FUNCTIONS_REVISION,
        written_by.as_deref(),
    )
}

/// The idemq that last migrated the installation, when it recorded itself.
async fn written_by(conn: &mut ConnectionManager, prefix: &str) -> Option<String> {
    ::redis::cmd("GET")
        .arg(format!("{prefix}idemq"))
        .query_async(conn)
        .await
        .ok()
        .flatten()
}

/// Whether this binary's library is loaded on the server.
pub(super) async fn loaded(conn: &mut ConnectionManager) -> Result<bool> {
    let found: Value = ::redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("LIBRARYNAME")
        .arg(LIBRARY.name())
        .query_async(conn)
        .await
        .map_err(redis_err)?;
    // LIBRARYNAME matches a pattern; look for the exact name.
    let wanted = LIBRARY.name();
    Ok(array(&found)?.iter().any(|lib| match lib {
        Value::Array(fields) => fields.chunks(2).any(|kv| {
            matches!(kv, [k, v] if string(k).is_ok_and(|k| k == "library_name")
                && string(v).is_ok_and(|v| v == wanted))
        }),
        Value::Map(fields) => fields.iter().any(|(k, v)| {
            string(k).is_ok_and(|k| k == "library_name") && string(v).is_ok_and(|v| v == wanted)
        }),
        _ => false,
    }))
}

/// Loads this binary's library on the server the URL names and records
/// it as the installation's; returns the layout versions applied (none
/// when the installation was already current). Safe to run from several
/// processes at once.
pub async fn migrate(url: &str) -> Result<Vec<i64>> {
    let url = RedisUrl::parse(url)?;
    let (_, mut conn) = open(&url).await?;
    // A server the store would refuse gets nothing written either.
    if !url.relaxed {
        durability::check(&mut conn).await?;
    }
    let Installed {
        layout, revision, ..
    } = installed(&mut conn, &url.prefix).await?;
    if layout > LAYOUT {
        return Err(newer(&mut conn, &url.prefix, layout).await);
    }
    if let Some(newer) = newer_functions(&mut conn, &url.prefix, revision).await {
        return Err(newer);
    }
    let _: Value = ::redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&LIBRARY.source)
        .query_async(&mut conn)
        .await
        .map_err(redis_err)?;
    if layout > 0 && layout < LAYOUT {
        // The data of an older layout is brought to this one, in one call,
        // before the layout is recorded: a store never reads it unconverted.
        let _: Value = ::redis::cmd("FCALL")
            .arg(LIBRARY.function("upgrade"))
            .arg(0)
            .arg(&url.prefix)
            .arg("0")
            .arg(layout)
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?;
    }
    // Recorded in one call that checks the revision again: a newer binary
    // migrating meanwhile is not recorded over.
    let recorded: Value = ::redis::cmd("FCALL")
        .arg(LIBRARY.function("record_migration"))
        .arg(0)
        .arg(&url.prefix)
        .arg("0")
        .arg(LAYOUT)
        .arg(&LIBRARY.version)
        .arg(FUNCTIONS_REVISION)
        .arg(IDEMQ_VERSION)
        .query_async(&mut conn)
        .await
        .map_err(redis_err)?;
    match status(&recorded)? {
        (s, _) if s == "ok" => {}
        (s, r) if s == "newer" => {
            let revision = int(at(r, 1)?)?;
            let by = string(at(r, 2)?)?;
            return Err(newer_functions_error(
                &url.prefix,
                revision,
                (!by.is_empty()).then_some(by),
            ));
        }
        (s, _) => return Err(codec::corrupt(s)),
    }
    Ok(if layout < LAYOUT {
        vec![LAYOUT]
    } else {
        Vec::new()
    })
}

/// How the installation the URL names stands against this binary, changing nothing.
pub async fn migration_status(url: &str) -> Result<MigrationStatus> {
    let url = RedisUrl::parse(url)?;
    let (_, mut conn) = open(&url).await?;
    let Installed {
        layout, version, ..
    } = installed(&mut conn, &url.prefix).await?;
    let functions_current =
        version.as_deref() == Some(LIBRARY.version.as_str()) && loaded(&mut conn).await?;
    // Which idemq wrote a newer layout, when it recorded itself.
    let written_by: Option<String> = if layout > LAYOUT {
        ::redis::cmd("GET")
            .arg(format!("{}idemq", url.prefix))
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?
    } else {
        None
    };
    Ok(MigrationStatus {
        current: layout,
        latest: LAYOUT,
        pending: if layout < LAYOUT {
            vec![LAYOUT]
        } else {
            Vec::new()
        },
        functions_current,
        written_by,
    })
}

/// The refusal of a layout newer than this binary's, naming the idemq
/// that recorded it when it did.
pub(super) async fn newer(conn: &mut ConnectionManager, prefix: &str, layout: i64) -> Error {
    let written_by = written_by(conn, prefix).await;
    newer_schema(
        &format!("the idemq data layout under the key prefix {prefix:?}"),
        layout,
        LAYOUT,
        written_by.as_deref(),
    )
}
