//! A caller's own PostgreSQL transaction.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::job::EnqueueResult;
use crate::queue::Queue;
use crate::store::postgres::PgStore;
use crate::worker::IntoEnqueueRequest;

impl Queue {
    /// Refuses a PostgreSQL connection for a queue on another backend: the
    /// job would land in a database this queue does not read.
    fn postgres(&self) -> Result<()> {
        match self.store().as_any().downcast_ref::<PgStore>() {
            Some(_) => Ok(()),
            None => Err(Error::validation(
                "connection",
                format!("this queue is on {}, not PostgreSQL", self.backend()),
            )),
        }
    }

    /// Enqueues on the caller's own PostgreSQL connection or transaction: the
    /// job, its bindings and its event commit or roll back with the caller's
    /// rows. A refused request (a conflict, a validation failure) raises
    /// nothing in the database, so the transaction stays usable.
    ///
    /// Under `REPEATABLE READ` or `SERIALIZABLE`, a key bound by a transaction
    /// that committed after this one's snapshot fails with `Unavailable`
    /// (a serialization failure): retry the whole transaction, and the retry
    /// answers `replayed`. See docs/operating.md.
    pub async fn enqueue_in(
        &self,
        conn: &mut sqlx::PgConnection,
        req: impl IntoEnqueueRequest,
    ) -> Result<EnqueueResult> {
        self.postgres()?;
        let item = self.prepare(&req.into_request()?)?;
        let mut results = PgStore::enqueue_in(conn, std::slice::from_ref(&item)).await?;
        results.pop().unwrap_or_else(|| {
            Err(Error::Backend {
                message: "no result".into(),
            })
        })
    }

    /// Completes an attempt inside the caller's own PostgreSQL transaction,
    /// fenced by its lease token: the completion (state, result, event, run
    /// ledger) commits or rolls back with the caller's rows. A lease that is
    /// no longer the job's current one fails with [`Error::LeaseLost`] and
    /// writes nothing; roll the transaction back then, its business writes
    /// belong to an attempt that is not the job's any more. Nothing in it
    /// raises in the database, so the transaction stays usable.
    ///
    /// The job's row stays locked until the transaction ends: call it last,
    /// just before the commit.
    pub async fn complete_in(
        &self,
        conn: &mut sqlx::PgConnection,
        job_id: &str,
        lease_token: &crate::LeaseToken,
        result: Option<Value>,
    ) -> Result<()> {
        self.postgres()?;
        let p = self.completion(job_id, lease_token, result)?;
        PgStore::complete_in(conn, &p).await
    }
}
