//! The OpenAPI document, pinned: `tests/snapshots/openapi.json` is the
//! committed contract, and any drift of the generated document fails this
//! test. After an intended change, regenerate the snapshot with
//! `IDEMQ_UPDATE_SNAPSHOTS=1 cargo test -p idemq-server --test openapi`
//! and review the diff.

use std::path::PathBuf;

#[tokio::test]
async fn openapi_matches_snapshot() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("idemq.db").display());
    let queue = idemq::Queue::connect(&url).await.expect("open sqlite");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(idemq_server::serve(
        listener,
        queue,
        idemq_server::ServerOptions::default(),
        async move {
            let _ = rx.await;
        },
    ));
    let resp = reqwest::get(format!("http://{addr}/openapi.json"))
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    let live: serde_json::Value = resp.json().await.expect("json");
    let _ = tx.send(());
    let _ = server.await;

    assert_eq!(live["openapi"], "3.1.0");
    let rendered = format!("{}\n", serde_json::to_string_pretty(&live).expect("render"));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/openapi.json");
    if std::env::var_os("IDEMQ_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &rendered).expect("write the snapshot");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "{} is missing: run with IDEMQ_UPDATE_SNAPSHOTS=1 to create it",
            path.display()
        )
    });
    if committed != rendered {
        let first = committed
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(rendered.lines().count()));
        panic!(
            "the OpenAPI document drifted from tests/snapshots/openapi.json (first difference \
             at line {}). If the change is intended, run \
             IDEMQ_UPDATE_SNAPSHOTS=1 cargo test -p idemq-server --test openapi and commit it.",
            first + 1
        );
    }
}
