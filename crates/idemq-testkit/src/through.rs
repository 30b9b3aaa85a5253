//! A store that passes every call on to another, with a test's own hooks
//! around some of them ([`Tap`]): a backend that fails, stalls or is
//! watched at a chosen moment, without a forwarding method per call in
//! every test that needs one.

use std::sync::Arc;

use idemq::JobState;
use idemq::store::{Recorded, Recording, Store};
use serde_json::Value;

/// A call a [`Tap`] sees before it is passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Call {
    /// `job_claim`.
    Claim,
    /// `job_complete_and_claim`; `claims` when it asks for jobs too.
    CompleteAndClaim {
        /// Whether the call claims (its claim's limit is above zero).
        claims: bool,
    },
    /// `lease_heartbeat` or `lease_heartbeat_many`.
    Heartbeat,
    /// `job_complete` (one job).
    Complete,
    /// `job_release`.
    Release,
    /// `schedule_due`.
    ScheduleDue,
    /// `job_get`.
    Get,
    /// `job_list`.
    List,
}

/// What a test does around the calls of a [`Through`] store. Every hook
/// does nothing unless the test says otherwise.
#[async_trait::async_trait]
pub trait Tap: std::fmt::Debug + Send + Sync + 'static {
    /// Runs before `call` is passed on (it may wait); an error answers the
    /// call instead, and the inner store never sees it.
    async fn before(&self, _call: Call) -> idemq::Result<()> {
        Ok(())
    }

    /// Runs once the inner store answered `call`, whatever the answer
    /// (only for [`Call::Heartbeat`]).
    fn after(&self, _call: Call) {}

    /// Sees each page of jobs the inner store listed.
    fn listed(&self, _page: &idemq::JobPage) {}
}

/// A store that passes every call to `inner`, through `tap`'s hooks.
/// It dereferences to its tap, so a test reaches its switches and
/// counters through the store it made.
#[derive(Debug)]
pub struct Through<T> {
    inner: Arc<dyn Store>,
    tap: T,
}

impl<T: Tap> Through<T> {
    /// `inner`'s calls, through `tap`.
    pub fn new(inner: Arc<dyn Store>, tap: T) -> Self {
        Self { inner, tap }
    }
}

impl<T> std::ops::Deref for Through<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.tap
    }
}

#[async_trait::async_trait]
impl<T: Tap> Store for Through<T> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn claims_in_flight(&self) -> usize {
        self.inner.claims_in_flight()
    }
    fn supports(&self, capability: idemq::store::Capability) -> bool {
        self.inner.supports(capability)
    }
    fn durability(&self) -> idemq::Durability {
        self.inner.durability()
    }
    async fn durability_check(&self) -> idemq::Result<()> {
        self.inner.durability_check().await
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self.inner.as_any()
    }
    async fn wakeups(&self) -> idemq::Result<idemq::store::Wakeups> {
        self.inner.wakeups().await
    }
    async fn now(&self) -> idemq::Result<chrono::DateTime<chrono::Utc>> {
        self.inner.now().await
    }
    async fn job_enqueue(
        &self,
        p: idemq::store::JobEnqueue,
    ) -> idemq::Result<Vec<idemq::Result<idemq::EnqueueResult>>> {
        self.inner.job_enqueue(p).await
    }
    async fn job_explain(&self, p: idemq::store::JobExplain) -> idemq::Result<idemq::Explain> {
        self.inner.job_explain(p).await
    }
    async fn job_get(&self, p: idemq::store::JobRef) -> idemq::Result<Option<idemq::Job>> {
        self.tap.before(Call::Get).await?;
        self.inner.job_get(p).await
    }
    async fn job_list(&self, p: idemq::store::JobListing) -> idemq::Result<idemq::JobPage> {
        self.tap.before(Call::List).await?;
        let page = self.inner.job_list(p).await?;
        self.tap.listed(&page);
        Ok(page)
    }
    async fn job_events(&self, p: idemq::store::JobRef) -> idemq::Result<Vec<idemq::Event>> {
        self.inner.job_events(p).await
    }
    async fn job_runs(&self, p: idemq::store::JobRef) -> idemq::Result<Vec<idemq::Run>> {
        self.inner.job_runs(p).await
    }
    async fn checkpoint_list(
        &self,
        p: idemq::store::JobRef,
    ) -> idemq::Result<std::collections::BTreeMap<String, Value>> {
        self.inner.checkpoint_list(p).await
    }
    async fn job_cancel(&self, p: idemq::store::JobRef) -> idemq::Result<idemq::CancelOutcome> {
        self.inner.job_cancel(p).await
    }
    async fn job_cancel_by_key(&self, p: idemq::store::JobCancelByKey) -> idemq::Result<bool> {
        self.inner.job_cancel_by_key(p).await
    }
    async fn job_purge(&self, p: idemq::store::JobRef) -> idemq::Result<bool> {
        self.inner.job_purge(p).await
    }
    async fn job_promote(&self, p: idemq::store::JobRef) -> idemq::Result<bool> {
        self.inner.job_promote(p).await
    }
    async fn job_redrive(
        &self,
        p: idemq::store::JobRedrive,
    ) -> idemq::Result<idemq::EnqueueResult> {
        self.inner.job_redrive(p).await
    }
    async fn queue_pause(&self, p: idemq::store::QueuePause) -> idemq::Result<bool> {
        self.inner.queue_pause(p).await
    }
    async fn queue_list(&self) -> idemq::Result<Vec<idemq::QueueInfo>> {
        self.inner.queue_list().await
    }
    async fn job_claim(
        &self,
        p: idemq::store::JobClaim,
    ) -> idemq::Result<Recording<Vec<idemq::ClaimedJob>>> {
        self.tap.before(Call::Claim).await?;
        self.inner.job_claim(p).await
    }
    async fn lease_heartbeat(
        &self,
        p: idemq::store::LeaseRef,
    ) -> idemq::Result<Recording<idemq::Result<idemq::Heartbeat>>> {
        self.tap.before(Call::Heartbeat).await?;
        let answer = self.inner.lease_heartbeat(p).await;
        self.tap.after(Call::Heartbeat);
        answer
    }
    async fn lease_heartbeat_many(
        &self,
        p: idemq::store::LeaseHeartbeatMany,
    ) -> idemq::Result<Recording<Vec<idemq::Result<idemq::Heartbeat>>>> {
        self.tap.before(Call::Heartbeat).await?;
        let answer = self.inner.lease_heartbeat_many(p).await;
        self.tap.after(Call::Heartbeat);
        answer
    }
    async fn job_complete(&self, p: idemq::store::JobComplete) -> idemq::Result<()> {
        self.tap.before(Call::Complete).await?;
        self.inner.job_complete(p).await
    }
    async fn job_complete_many(
        &self,
        p: idemq::store::JobCompleteMany,
    ) -> idemq::Result<Vec<idemq::Result<()>>> {
        self.inner.job_complete_many(p).await
    }
    async fn job_complete_and_claim(
        &self,
        done: idemq::store::JobCompleteMany,
        claim: idemq::store::JobClaim,
    ) -> idemq::Result<(
        Vec<idemq::Result<()>>,
        idemq::Result<Recording<Vec<idemq::ClaimedJob>>>,
    )> {
        self.tap
            .before(Call::CompleteAndClaim {
                claims: claim.limit > 0,
            })
            .await?;
        self.inner.job_complete_and_claim(done, claim).await
    }
    async fn job_fail(&self, p: idemq::store::JobFail) -> idemq::Result<idemq::FailOutcome> {
        self.inner.job_fail(p).await
    }
    async fn job_release(&self, p: idemq::store::LeaseRef) -> idemq::Result<JobState> {
        self.tap.before(Call::Release).await?;
        self.inner.job_release(p).await
    }
    async fn checkpoint_put(&self, p: idemq::store::CheckpointPut) -> idemq::Result<bool> {
        self.inner.checkpoint_put(p).await
    }
    async fn checkpoint_get(&self, p: idemq::store::CheckpointGet) -> idemq::Result<Option<Value>> {
        self.inner.checkpoint_get(p).await
    }
    async fn binding_lookup(
        &self,
        p: idemq::store::BindingRef,
    ) -> idemq::Result<Option<idemq::BindingInfo>> {
        self.inner.binding_lookup(p).await
    }
    async fn binding_release(&self, p: idemq::store::BindingRef) -> idemq::Result<bool> {
        self.inner.binding_release(p).await
    }
    async fn dedupe_lookup(
        &self,
        p: idemq::store::DedupeRef,
    ) -> idemq::Result<Option<idemq::ExplainDedupe>> {
        self.inner.dedupe_lookup(p).await
    }
    async fn binding_sweep(&self, p: idemq::store::Sweep) -> idemq::Result<u64> {
        self.inner.binding_sweep(p).await
    }
    async fn lease_reap(&self, p: idemq::store::Sweep) -> idemq::Result<Recorded> {
        self.inner.lease_reap(p).await
    }
    async fn job_retention_sweep(&self, p: idemq::store::Sweep) -> idemq::Result<u64> {
        self.inner.job_retention_sweep(p).await
    }
    async fn schedule_put(&self, p: idemq::store::SchedulePut) -> idemq::Result<bool> {
        self.inner.schedule_put(p).await
    }
    async fn schedule_delete(&self, p: idemq::store::ScheduleRef) -> idemq::Result<bool> {
        self.inner.schedule_delete(p).await
    }
    async fn schedule_list(&self) -> idemq::Result<idemq::ScheduleList> {
        self.inner.schedule_list().await
    }
    async fn schedule_due(
        &self,
        p: idemq::store::ScheduleDue,
    ) -> idemq::Result<idemq::store::DueSchedules> {
        self.tap.before(Call::ScheduleDue).await?;
        self.inner.schedule_due(p).await
    }
    async fn schedule_mark_fired(&self, p: idemq::store::ScheduleMarkFired) -> idemq::Result<bool> {
        self.inner.schedule_mark_fired(p).await
    }
    async fn installation_key_check(&self, p: idemq::store::KeyCheck) -> idemq::Result<String> {
        self.inner.installation_key_check(p).await
    }
    async fn installation_key_check_replace(
        &self,
        p: idemq::store::KeyCheck,
    ) -> idemq::Result<idemq::KeyCheckChange> {
        self.inner.installation_key_check_replace(p).await
    }
}
