//! The handler registry: typed handlers behind one erased signature.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::context::{HandlerContext, JobError};

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Result<Value, JobError>> + Send>>;

/// A handler with its payload type erased.
pub(crate) type Erased = Arc<dyn Fn(HandlerContext) -> BoxFuture + Send + Sync>;

/// Wraps a typed handler: a payload that does not deserialize fails the job
/// permanently (`bad_payload`).
pub(crate) fn erase<P, R, F, Fut>(f: F) -> Erased
where
    P: DeserializeOwned + Send + 'static,
    R: Serialize + Send + 'static,
    F: Fn(HandlerContext, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, JobError>> + Send + 'static,
{
    let f = Arc::new(f);
    Arc::new(move |ctx: HandlerContext| {
        let f = f.clone();
        Box::pin(async move {
            let payload: P = serde_json::from_value(ctx.payload().clone())
                .map_err(|e| JobError::permanent(format!("bad_payload: {e}")))?;
            let out = f(ctx, payload).await?;
            serde_json::to_value(out).map_err(|e| JobError::permanent(format!("bad_result: {e}")))
        }) as BoxFuture
    })
}

/// Handlers by job type.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    pub(crate) handlers: HashMap<String, Erased>,
    /// The handler of every type without one of its own, if any.
    pub(crate) catch_all: Option<Erased>,
}

impl Registry {
    /// The handler of `job_type`: its own, or the catch-all.
    pub(crate) fn get(&self, job_type: &str) -> Option<Erased> {
        self.handlers
            .get(job_type)
            .or(self.catch_all.as_ref())
            .cloned()
    }

    pub(crate) fn types(&self) -> Vec<String> {
        let mut t: Vec<String> = self.handlers.keys().cloned().collect();
        t.sort();
        t
    }
}
