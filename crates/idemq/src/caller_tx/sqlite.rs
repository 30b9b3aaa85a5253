//! A caller's own connection to the queue's SQLite file.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::job::EnqueueResult;
use crate::queue::Queue;
use crate::store::sqlite::SqliteStore;
use crate::worker::IntoEnqueueRequest;

impl Queue {
    fn sqlite(&self) -> Result<&SqliteStore> {
        self.store().as_any().downcast_ref().ok_or_else(|| {
            Error::validation(
                "connection",
                format!("this queue is on {}, not SQLite", self.backend()),
            )
        })
    }

    /// [`complete_in`](Self::complete_in) on the caller's own connection to
    /// this queue's SQLite database file (inside its open transaction, if
    /// any). Refused (`Validation` on `connection`) for a connection to
    /// another file, an in-memory queue or another backend. The clock of
    /// record is the queue's.
    pub fn complete_in_sqlite(
        &self,
        conn: &rusqlite::Connection,
        job_id: &str,
        lease_token: &crate::LeaseToken,
        result: Option<Value>,
    ) -> Result<()> {
        let p = self.completion(job_id, lease_token, result)?;
        self.sqlite()?.complete_on(conn, &p)
    }

    /// Enqueues on the caller's own connection to this queue's SQLite
    /// database file, inside its open transaction: the job, its bindings
    /// and its event commit or roll back with the caller's rows. A refused
    /// request (a conflict, a validation failure) writes nothing and leaves
    /// the transaction and the caller's other writes as they were. Workers
    /// of this process are not woken (the commit is the caller's): they
    /// find the job at their next poll. On a connection with no transaction
    /// open, the call is a `BEGIN IMMEDIATE` transaction of its own: it
    /// waits for the write lock, commits before it returns and wakes this
    /// process's workers.
    ///
    /// ```
    /// use idemq::rusqlite::TransactionBehavior;
    /// use idemq::{EnqueueRequest, Queue};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// # let url = format!("sqlite://{}", dir.path().join("app.db").display());
    /// let queue = Queue::connect(&url).await?;
    /// let mut conn = queue.sqlite_connection()?;
    /// conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY)")?;
    ///
    /// let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    /// tx.execute("INSERT INTO orders (id) VALUES ('o-1')", [])?;
    /// let confirm = EnqueueRequest::new("order.confirm").idempotency_key("confirm:o-1");
    /// let r = queue.enqueue_in_sqlite(&tx, confirm)?;
    /// tx.commit()?; // the order, the job, its key and its event — or none of them
    /// assert!(queue.get(&r.job_id).await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub fn enqueue_in_sqlite(
        &self,
        conn: &rusqlite::Connection,
        req: impl IntoEnqueueRequest,
    ) -> Result<EnqueueResult> {
        let item = self.prepare(&req.into_request()?)?;
        let store = self.sqlite()?;
        let mut results = store.enqueue_on(conn, std::slice::from_ref(&item))?;
        results.pop().unwrap_or_else(|| {
            Err(Error::Backend {
                message: "no result".into(),
            })
        })
    }

    /// A new connection to this queue's SQLite database file, set up as the
    /// store's own (WAL, `synchronous=FULL`, foreign keys, a 5 s busy
    /// timeout), for [`enqueue_in_sqlite`](Self::enqueue_in_sqlite) and
    /// [`complete_in_sqlite`](Self::complete_in_sqlite). Begin write
    /// transactions on it with
    /// `transaction_with_behavior(TransactionBehavior::Immediate)`.
    pub fn sqlite_connection(&self) -> Result<rusqlite::Connection> {
        self.sqlite()?.open_connection()
    }
}
