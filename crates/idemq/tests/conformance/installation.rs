//! Conformance cases: one key secret per installation, checked at connect
//! (docs/idempotency.md, "One key secret per installation").

use std::sync::Arc;

use idemq::store::{KeyCheck, Store};
use idemq::{EnqueueRequest, Error, Outcome, Queue, QueueOptions};
use idemq_testkit::Harness;

idemq_testkit::instantiate!(
    the_first_process_records_its_hashing,
    a_process_with_another_secret_is_refused_at_connect,
    a_process_without_the_secret_is_refused_at_connect,
    concurrent_first_connects_agree_on_one_hashing,
    replacing_the_secret_counts_the_bindings_it_orphans,
);

fn secret(s: &str) -> QueueOptions {
    QueueOptions {
        key_secret: Some(s.as_bytes().to_vec()),
        ..QueueOptions::default()
    }
}

fn no_secret() -> QueueOptions {
    QueueOptions {
        key_secret: None,
        ..QueueOptions::default()
    }
}

async fn open(h: &Harness, options: QueueOptions) -> idemq::Result<Queue> {
    Queue::open(h.queue.store().clone(), options).await
}

#[track_caller]
fn assert_mismatch(r: idemq::Result<Queue>) {
    match r {
        Err(e @ Error::KeySecretMismatch { .. }) => {
            let message = e.to_string();
            assert!(message.contains("IDEMQ_KEY_SECRET"), "{message}");
            assert!(
                !message.contains("secret-a") && !message.contains("secret-b"),
                "{message}"
            );
        }
        Err(e) => panic!("expected KeySecretMismatch, got {e}"),
        Ok(_) => panic!("a process hashing keys differently was accepted"),
    }
}

async fn the_first_process_records_its_hashing(h: Harness) {
    let a = open(&h, secret("secret-a")).await.expect("first connect");
    let id = a
        .enqueue(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    // The same secret connects again, and its repeat is a replay.
    let again = open(&h, secret("secret-a")).await.expect("same secret");
    let r = again
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn a_process_with_another_secret_is_refused_at_connect(h: Harness) {
    open(&h, secret("secret-a")).await.expect("first connect");
    assert_mismatch(open(&h, secret("secret-b")).await);
    assert_eq!(h.totals().await, (0, 0), "a refused connect writes nothing");
    open(&h, secret("secret-a"))
        .await
        .expect("the recorded secret still connects");
}

async fn a_process_without_the_secret_is_refused_at_connect(h: Harness) {
    open(&h, no_secret())
        .await
        .expect("first connect, no secret");
    assert_mismatch(open(&h, secret("secret-a")).await);
    let keyed = Harness::fresh_like(&h).await;
    open(&keyed, secret("secret-a"))
        .await
        .expect("first connect, secret");
    assert_mismatch(open(&keyed, no_secret()).await);
}

async fn concurrent_first_connects_agree_on_one_hashing(h: Harness) {
    let store: Arc<dyn Store> = h.queue.store().clone();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let store = store.clone();
            let options = if i % 2 == 0 {
                secret("secret-a")
            } else {
                secret("secret-b")
            };
            tokio::spawn(async move { (i % 2, Queue::open(store, options).await.is_ok()) })
        })
        .collect();
    let mut accepted = [0, 0];
    for t in tasks {
        let (side, ok) = t.await.unwrap();
        accepted[side] += usize::from(ok);
    }
    assert!(
        accepted == [8, 0] || accepted == [0, 8],
        "one hashing wins, every process of the other is refused: {accepted:?}"
    );
}

async fn replacing_the_secret_counts_the_bindings_it_orphans(h: Harness) {
    let a = open(&h, secret("secret-a")).await.unwrap();
    for k in ["k1", "k2"] {
        a.enqueue(EnqueueRequest::new("t").idempotency_key(k))
            .await
            .unwrap();
    }
    a.enqueue(EnqueueRequest::new("t")).await.unwrap();
    let b_check = idemq::fingerprint::KeyHasher::with_secret(b"secret-b".to_vec()).check_value();
    let change = h
        .queue
        .store()
        .installation_key_check_replace(KeyCheck {
            value: b_check.clone(),
        })
        .await
        .unwrap();
    let a_check = idemq::fingerprint::KeyHasher::with_secret(b"secret-a".to_vec()).check_value();
    assert_eq!(change.previous.as_deref(), Some(a_check.as_str()));
    assert_eq!(change.live_bindings, 2);
    // Now the new secret connects and the old one is refused; the orphaned
    // key is accepted again (the cost the operator was told of).
    assert_mismatch(open(&h, secret("secret-a")).await);
    let b = open(&h, secret("secret-b")).await.expect("the new secret");
    let r = b
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k1"))
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    // Replacing with the check already recorded costs nothing.
    let same = h
        .queue
        .store()
        .installation_key_check_replace(KeyCheck { value: b_check })
        .await
        .unwrap();
    assert_eq!(same.live_bindings, 0);
}
