//! The dashboard over real HTTP: what the overview shows, and that the
//! jobs it reads to show it are a bounded sample, not the table; and that
//! the lists of jobs read pages bounded in bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idemq::store::Store;
use serde_json::{Value, json};

use crate::harness::{Backend, Server};

instantiate!(
    overview_reads_a_bounded_sample_of_jobs,
    dashboard_lists_are_bounded_in_bytes
);

/// How many of the newest ready jobs the overview's "ready by type" table
/// looks at.
const READY_SAMPLE: usize = 200;

/// What the overview read through the store.
#[derive(Debug, Default)]
struct Reads {
    /// Jobs the pages of `job_list` held.
    listed: AtomicUsize,
    /// Calls of `job_list`.
    lists: AtomicUsize,
    /// Calls of `job_get`.
    gets: AtomicUsize,
}

impl Reads {
    fn reset(&self) {
        self.listed.store(0, Ordering::SeqCst);
        self.lists.store(0, Ordering::SeqCst);
        self.gets.store(0, Ordering::SeqCst);
    }
}

async fn overview_reads_a_bounded_sample_of_jobs(b: Backend) {
    let reads = Arc::new(Reads::default());
    let counting = reads.clone();
    let s = Server::start_wrapped(b, move |inner| {
        Arc::new(Counting {
            inner,
            reads: counting,
        })
    })
    .await;

    // Older: 250 ready jobs of one type, more than the overview samples.
    let old: Vec<Value> = (0..250)
        .map(|i| json!({"type": "bulk.old", "queue": "bulk", "payload": {"n": i}}))
        .collect();
    let a = s.post("/v1/jobs/batch", json!({ "jobs": old })).await;
    let results = a.ok(200)["results"].as_array().expect("results").clone();
    assert!(
        results.iter().all(|r| r["outcome"] == "accepted"),
        "{}",
        a.text
    );
    // Newer: four jobs of another type, one of them claimed (active), and
    // one scheduled job.
    for i in 0..4 {
        s.enqueue(json!({"type": "mail.send", "queue": "mail", "payload": {"n": i}}))
            .await;
    }
    let claimed = s
        .post(
            "/v1/claim",
            json!({"worker": "w-1", "types": ["mail.send"], "limit": 1}),
        )
        .await;
    assert_eq!(
        claimed.ok(200)["jobs"].as_array().map(Vec::len),
        Some(1),
        "{}",
        claimed.text
    );
    s.enqueue(json!({"type": "mail.send", "queue": "mail", "delay_ms": 600_000}))
        .await;

    reads.reset();
    let page = s.get("/").await;
    assert_eq!(page.status.as_u16(), 200, "{}", page.text);
    let html = page.text.as_str();

    // The cards count every job, from the store's counts.
    for (state, n) in [("ready", 253), ("active", 1), ("scheduled", 1)] {
        let card = format!(r#"data-total="{state}">{n}<"#);
        assert!(html.contains(&card), "no {card} in {html}");
    }
    // The queues table counts every job too.
    let bulk = row(html, r#"<tr data-queue="bulk">"#);
    assert!(bulk.contains(">250<"), "{bulk}");

    // Ready by type: the newest 200 ready jobs, each type with its count,
    // queues and whether a job of it is active.
    let table = section(html, r#"id="ready-types""#, "</table>");
    let mail = row(table, ">mail.send</a>");
    assert!(mail.contains(r#"<td class="num">3</td>"#), "{mail}");
    assert!(mail.contains("<td>mail</td>"), "{mail}");
    assert!(mail.contains("active jobs"), "{mail}");
    let old = row(table, ">bulk.old</a>");
    let shown = READY_SAMPLE - 3;
    assert!(
        old.contains(&format!(r#"<td class="num">{shown}</td>"#)),
        "{old}"
    );
    assert!(old.contains("<td>bulk</td>"), "{old}");
    assert!(!old.contains("active jobs"), "{old}");
    assert!(
        html.contains(&format!(
            "Counted over the newest {READY_SAMPLE} ready jobs."
        )),
        "{html}"
    );

    // What it read: the sample, and at most one active job per type shown.
    let listed = reads.listed.load(Ordering::SeqCst);
    let lists = reads.lists.load(Ordering::SeqCst);
    assert!(
        listed <= READY_SAMPLE + 2,
        "the overview read {listed} jobs in {lists} lists for a sample of {READY_SAMPLE} and two types"
    );
    assert!(lists <= 3, "{lists} lists");
    assert_eq!(reads.gets.load(Ordering::SeqCst), 0);

    // A table of a few ready jobs is shown whole, without the note.
    let few = Server::start(b).await;
    few.enqueue(json!({"type": "solo", "queue": "q"})).await;
    let page = few.get("/").await;
    assert_eq!(page.status.as_u16(), 200, "{}", page.text);
    let table = section(&page.text, r#"id="ready-types""#, "</table>");
    let solo = row(table, ">solo</a>");
    assert!(solo.contains(r#"<td class="num">1</td>"#), "{solo}");
    assert!(!page.text.contains("Counted over"), "{}", page.text);
    few.stop().await;
    s.stop().await;
}

/// The part of `html` from `start` to the next `end`.
#[track_caller]
fn section<'a>(html: &'a str, start: &str, end: &str) -> &'a str {
    let from = html
        .find(start)
        .unwrap_or_else(|| panic!("no {start} in {html}"));
    let rest = &html[from..];
    &rest[..rest.find(end).unwrap_or(rest.len())]
}

/// The table row of `html` that holds `marker`.
#[track_caller]
fn row<'a>(html: &'a str, marker: &str) -> &'a str {
    let at = html
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker} in {html}"));
    let from = html[..at + marker.len()].rfind("<tr").unwrap_or(0);
    let rest = &html[from..];
    &rest[..rest.find("</tr>").unwrap_or(rest.len())]
}

/// The backend's store, counting the jobs read through it.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Store>,
    reads: Arc<Reads>,
}

#[async_trait::async_trait]
impl Store for Counting {
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
        self.reads.gets.fetch_add(1, Ordering::SeqCst);
        self.inner.job_get(p).await
    }
    async fn job_list(&self, p: idemq::store::JobListing) -> idemq::Result<idemq::JobPage> {
        let page = self.inner.job_list(p).await?;
        self.reads.lists.fetch_add(1, Ordering::SeqCst);
        self.reads
            .listed
            .fetch_add(page.jobs.len(), Ordering::SeqCst);
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
    async fn job_claim(&self, p: idemq::store::JobClaim) -> idemq::Result<Vec<idemq::ClaimedJob>> {
        self.inner.job_claim(p).await
    }
    async fn lease_heartbeat(&self, p: idemq::store::LeaseRef) -> idemq::Result<idemq::Heartbeat> {
        self.inner.lease_heartbeat(p).await
    }
    async fn lease_heartbeat_many(
        &self,
        p: idemq::store::LeaseHeartbeatMany,
    ) -> idemq::Result<Vec<idemq::Result<idemq::Heartbeat>>> {
        self.inner.lease_heartbeat_many(p).await
    }
    async fn job_complete(&self, p: idemq::store::JobComplete) -> idemq::Result<()> {
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
        idemq::Result<Vec<idemq::ClaimedJob>>,
    )> {
        self.inner.job_complete_and_claim(done, claim).await
    }
    async fn job_fail(&self, p: idemq::store::JobFail) -> idemq::Result<idemq::FailOutcome> {
        self.inner.job_fail(p).await
    }
    async fn job_release(&self, p: idemq::store::LeaseRef) -> idemq::Result<idemq::JobState> {
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
    async fn lease_reap(&self, p: idemq::store::Sweep) -> idemq::Result<u64> {
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

/// The dashboard's lists of jobs (`/jobs`, `/dead`, `/bindings`) read a
/// page within the API's byte bound (16 MiB), whatever their row limit
/// (50, 50 and 500): thirty dead jobs of about 700 KB each (21 MB), with
/// keys, take more than one page of each list, and following "next" shows
/// every job once.
async fn dashboard_lists_are_bounded_in_bytes(b: Backend) {
    let s = Server::start(b).await;
    let big = "x".repeat(700_000);
    let mut ids = Vec::new();
    for i in 0..30 {
        ids.push(
            s.enqueue(json!({
                "type": "big",
                "payload": {"n": i, "blob": big},
                "max_attempts": 1,
                "idempotency": {"key": format!("big-{i}")},
            }))
            .await,
        );
    }
    let a = s
        .post("/v1/claim", json!({"worker": "w-1", "limit": 30}))
        .await;
    let claimed = a.ok(200)["jobs"].as_array().expect("jobs").clone();
    assert_eq!(claimed.len(), 30, "{}", a.text);
    for job in &claimed {
        let (id, token) = (
            job["id"].as_str().expect("id"),
            job["lease_token"].as_str().expect("lease_token"),
        );
        let a = s
            .post(
                &format!("/v1/jobs/{id}/fail"),
                json!({"lease_token": token, "error": "boom", "retryable": false}),
            )
            .await;
        assert_eq!(a.ok(200)["state"], "dead", "{}", a.text);
    }

    for list in ["/jobs", "/dead", "/bindings?all=1"] {
        let mut path = list.to_owned();
        let mut seen: Vec<String> = Vec::new();
        let mut pages = 0;
        loop {
            let page = s.get(&path).await;
            assert_eq!(page.status.as_u16(), 200, "{path}: {}", page.text);
            let here: Vec<String> = ids
                .iter()
                .filter(|id| page.text.contains(id.as_str()))
                .cloned()
                .collect();
            assert!(!here.is_empty(), "{path}: an empty page");
            assert!(here.len() < ids.len(), "{path}: all 21 MB on one page");
            seen.extend(here);
            pages += 1;
            assert!(pages <= 10, "{list}: paging does not end");
            match next_page(&page.text) {
                Some(next) => path = next,
                None => break,
            }
        }
        let mut once = seen.clone();
        once.sort();
        once.dedup();
        assert_eq!(
            (seen.len(), once.len()),
            (ids.len(), ids.len()),
            "{list}: every job once over {pages} pages"
        );
    }
}

/// The path of a page's "next" link, if it has one.
fn next_page(html: &str) -> Option<String> {
    let at = html.find(r#"rel="next" href=""#)? + r#"rel="next" href=""#.len();
    let end = html[at..].find('"')?;
    Some(html[at..at + end].replace("&amp;", "&"))
}
