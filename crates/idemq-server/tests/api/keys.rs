//! Bindings, queues and schedules.

use serde_json::json;

use crate::harness::{Backend, Server};

instantiate!(
    dedupe_bindings,
    idempotency_bindings,
    queues_pause_resume,
    schedules,
    an_unreadable_schedule_is_listed_apart
);

async fn dedupe_bindings(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(json!({"type": "sync", "dedupe": {"key": "acct 1/x", "ttl_ms": 60000}}))
        .await;
    let a = s.get("/v1/dedupe/sync/acct%201%2Fx").await;
    let d = a.ok(200).clone();
    assert_eq!(d["job_id"], id.as_str());
    assert_eq!(d["mode"], "throttle");
    assert!(d["window_until"].is_string());
    s.get("/v1/dedupe/other/acct%201%2Fx")
        .await
        .problem(404, "not-found");
    let a = s
        .post(
            "/v1/dedupe/cancel",
            json!({"type": "sync", "key": "acct 1/x"}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"cancelled": true}));
    let a = s
        .post(
            "/v1/dedupe/cancel",
            json!({"type": "sync", "key": "acct 1/x"}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"cancelled": false}));
    s.get("/v1/dedupe/sync/acct%201%2Fx")
        .await
        .problem(404, "not-found");
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}")).await.ok(200)["state"],
        "cancelled"
    );
    s.post("/v1/dedupe/cancel", json!({"type": "sync"}))
        .await
        .problem(400, "bad-request");
    s.stop().await;
}

async fn idempotency_bindings(b: Backend) {
    let s = Server::start(b).await;
    let key = "lookup-secret-key-123";
    let id = s
        .enqueue(json!({"type": "t", "idempotency": {"key": key, "scope": "shop"}}))
        .await;
    let a = s
        .post(
            "/v1/idempotency/lookup",
            json!({"scope": "shop", "key": key}),
        )
        .await;
    let info = a.ok(200).clone();
    assert_eq!(info["job_id"], id.as_str());
    assert_eq!(info["key_digest"].as_str().unwrap().len(), 16);
    assert!(info["key_preview"].is_string() && info["expires_at"].is_string());
    assert!(!a.text.contains(key));
    // The default scope holds no such key.
    s.post("/v1/idempotency/lookup", json!({"key": key}))
        .await
        .problem(404, "not-found");
    let a = s
        .post(
            "/v1/idempotency/release",
            json!({"scope": "shop", "key": key}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"released": true}));
    let a = s
        .post(
            "/v1/idempotency/release",
            json!({"scope": "shop", "key": key}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"released": false}));
    s.post(
        "/v1/idempotency/lookup",
        json!({"scope": "shop", "key": key}),
    )
    .await
    .problem(404, "not-found");
    let events = s
        .get(&format!("/v1/jobs/{id}/events"))
        .await
        .ok(200)
        .clone();
    assert!(
        events["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "binding_released")
    );
    assert!(!events.to_string().contains(key));
    // The key is released: the same key now owns a new job.
    let again = s
        .post(
            "/v1/jobs",
            json!({"type": "t", "idempotency": {"key": key, "scope": "shop"}}),
        )
        .await;
    assert_eq!(again.ok(201)["outcome"], "accepted");
    s.post(
        "/v1/idempotency/lookup",
        json!({"scope": "bad scope!", "key": "k"}),
    )
    .await
    .problem(422, "validation");
    s.stop().await;
}

async fn queues_pause_resume(b: Backend) {
    let s = Server::start(b).await;
    s.enqueue(json!({"type": "t", "queue": "mail"})).await;
    s.enqueue(json!({"type": "t", "queue": "mail", "delay_ms": 600000}))
        .await;
    let a = s.get("/v1/queues").await.ok(200).clone();
    let mail = a["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "mail")
        .expect("queue mail")
        .clone();
    assert_eq!(mail["paused"], false);
    assert_eq!(
        mail["counts"],
        json!({"scheduled": 1, "ready": 1, "active": 0, "completed": 0, "dead": 0, "cancelled": 0})
    );
    let a = s.post("/v1/queues/mail/pause", json!({})).await;
    assert_eq!(a.ok(200).clone(), json!({"paused": true}));
    let claim = s
        .post("/v1/claim", json!({"worker": "w", "queues": ["mail"]}))
        .await;
    assert_eq!(claim.ok(200)["jobs"], json!([]));
    let a = s.post("/v1/queues/mail/resume", json!({})).await;
    assert_eq!(a.ok(200).clone(), json!({"paused": false}));
    let claim = s
        .post("/v1/claim", json!({"worker": "w", "queues": ["mail"]}))
        .await;
    assert_eq!(claim.ok(200)["jobs"].as_array().unwrap().len(), 1);
    s.post("/v1/queues/bad%20name!/pause", json!({}))
        .await
        .problem(422, "validation");
    s.stop().await;
}

async fn schedules(b: Backend) {
    let s = Server::start(b).await;
    let def = json!({"cron": "0 */5 * * * *", "timezone": "UTC", "job": {"type": "report", "queue": "ops"}});
    let a = s.put("/v1/schedules/nightly", def.clone()).await;
    let sch = a.ok(201).clone();
    assert_eq!(sch["name"], "nightly");
    assert_eq!(sch["cron"], "0 */5 * * * *");
    assert!(sch["next_fire_at"].is_string());
    s.put("/v1/schedules/nightly", def).await.ok(200);
    s.put(
        "/v1/schedules/tick",
        json!({"every_ms": 60000, "job": {"type": "tick"}}),
    )
    .await
    .ok(201);
    let list = s.get("/v1/schedules").await.ok(200).clone();
    let all = list["schedules"].as_array().unwrap();
    assert_eq!(all.len(), 2);
    let tick = all.iter().find(|x| x["name"] == "tick").unwrap();
    assert_eq!(tick["every_ms"], 60000);
    assert_eq!(tick["timezone"], "UTC");
    assert_eq!(tick["job"]["type"], "tick");
    assert_eq!(tick["paused"], false);
    let a = s
        .put(
            "/v1/schedules/bad",
            json!({"cron": "nope", "job": {"type": "x"}}),
        )
        .await;
    assert_eq!(a.problem(422, "validation")["field"], "cron");
    s.put(
        "/v1/schedules/bad",
        json!({"cron": 5, "job": {"type": "x"}}),
    )
    .await
    .problem(400, "bad-request");
    let a = s.delete("/v1/schedules/tick").await;
    assert_eq!(a.ok(200).clone(), json!({"deleted": true}));
    let a = s.delete("/v1/schedules/tick").await;
    assert_eq!(a.ok(200).clone(), json!({"deleted": false}));
    s.stop().await;
}

/// The names of a schedule list's `key` member.
fn names(list: &serde_json::Value, key: &str) -> Vec<String> {
    list[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {list}"))
        .iter()
        .map(|s| s["name"].as_str().expect("a name").to_owned())
        .collect()
}

async fn an_unreadable_schedule_is_listed_apart(b: Backend) {
    let s = Server::start(b).await;
    for name in ["a-first", "b-broken", "c-last"] {
        s.put(
            &format!("/v1/schedules/{name}"),
            json!({"every_ms": 60000, "job": {"type": "report", "queue": "ops"}}),
        )
        .await
        .ok(201);
    }
    // A template this version cannot decode, as a newer idemq might write
    // it (a member this one does not know), behind the store's back.
    let future = r#"{"type": "report", "from_a_newer_idemq": true}"#;
    match b {
        Backend::Sqlite => {
            s.raw_sql(
                "UPDATE idemq_schedules SET job = ?2 WHERE name = ?1",
                "",
                &["b-broken", future],
            )
            .await
        }
        Backend::Postgres => {
            s.raw_sql(
                "",
                "UPDATE idemq.schedules SET job = $2::jsonb WHERE name = $1",
                &["b-broken", future],
            )
            .await
        }
        Backend::Redis => s.raw_redis(&["HSET", "sch:b-broken", "job", future]).await,
    }

    // The others are listed; the broken one apart, named, with why.
    let list = s.get("/v1/schedules").await.ok(200).clone();
    assert_eq!(names(&list, "schedules"), ["a-first", "c-last"], "{list}");
    assert_eq!(names(&list, "unreadable"), ["b-broken"], "{list}");
    let why = list["unreadable"][0]["error"].as_str().expect("error");
    for part in ["b-broken", "job", "from_a_newer_idemq"] {
        assert!(why.contains(part), "{why:?} does not say {part:?}");
    }
    assert_eq!(
        list["unreadable"][0].as_object().map(|o| o.len()),
        Some(2),
        "{list}"
    );

    // Setting another schedule is answered with it, not failed by the row.
    let a = s
        .put(
            "/v1/schedules/c-last",
            json!({"every_ms": 120000, "job": {"type": "report"}}),
        )
        .await;
    assert_eq!(a.ok(200)["every_ms"], 120000, "{}", a.text);

    // The dashboard lists it too, marked.
    let page = s.get("/schedules").await;
    assert_eq!(page.status.as_u16(), 200, "{}", page.text);
    for part in [
        "a-first",
        "c-last",
        "b-broken",
        "unreadable",
        "from_a_newer_idemq",
    ] {
        assert!(page.text.contains(part), "no {part:?} in {}", page.text);
    }

    // Set anew, it reads again.
    s.put(
        "/v1/schedules/b-broken",
        json!({"every_ms": 60000, "job": {"type": "report"}}),
    )
    .await
    .ok(200);
    let list = s.get("/v1/schedules").await.ok(200).clone();
    assert_eq!(
        names(&list, "schedules"),
        ["a-first", "b-broken", "c-last"],
        "{list}"
    );
    assert_eq!(list["unreadable"], json!([]));
    s.stop().await;
}
