//! The queue's operations inside a caller's own transaction: enqueue and
//! complete commit or roll back with the caller's business rows
//! (docs/storage.md). Each backend that has
//! [`Capability::CallerTransactions`](crate::store::Capability) adds its own
//! methods, behind its cargo feature: on PostgreSQL the caller passes its
//! `sqlx` connection or transaction; on SQLite its own `rusqlite`
//! connection to the queue's database file ([`Queue::sqlite_connection`]
//! opens one set up as the store's).

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use serde_json::Value;

use crate::error::Result;
use crate::queue::Queue;
use crate::request::encode_json;
use crate::store::JobComplete;

impl Queue {
    /// The completion of an attempt by its lease, with its result checked.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    fn completion(
        &self,
        job_id: &str,
        lease_token: &crate::LeaseToken,
        result: Option<Value>,
    ) -> Result<JobComplete> {
        Self::lease_text(job_id, lease_token)?;
        Ok(JobComplete {
            lease: Self::lease(job_id, lease_token),
            result: result
                .filter(|v| !v.is_null())
                .map(|v| encode_json("result", &v, self.payload_limit()))
                .transpose()?,
        })
    }
}
