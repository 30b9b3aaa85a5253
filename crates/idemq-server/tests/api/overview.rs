//! The dashboard over real HTTP: what the overview shows, and that the
//! jobs it reads to show it are a bounded sample, not the table; and that
//! the lists of jobs read pages bounded in bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idemq_testkit::{Call, Tap, Through};
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
        Arc::new(Through::new(inner, Counting(counting)))
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

/// Counts the jobs read through the backend's store.
#[derive(Debug)]
struct Counting(Arc<Reads>);

#[async_trait::async_trait]
impl Tap for Counting {
    async fn before(&self, call: Call) -> idemq::Result<()> {
        if call == Call::Get {
            self.0.gets.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn listed(&self, page: &idemq::JobPage) {
        self.0.lists.fetch_add(1, Ordering::SeqCst);
        self.0.listed.fetch_add(page.jobs.len(), Ordering::SeqCst);
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
