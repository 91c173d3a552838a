//! A drain held up by an outage keeps taking the agent's output into its bounded pending
//! buffer: the queue never stays full, the oldest events past the bound are dropped and
//! counted by one marker at their place, and the rest arrives once the run store is back.

mod common;

use std::time::Duration;

use common::TOKEN;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_runner::{Bearer, events};
use runplane_testkit::run_store::serve_on_own_runtime;
use runplane_transport::{RetryConfig, RetryLayer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_held_up_by_an_outage_keeps_the_newest_and_counts_the_dropped_in_one_marker() {
    let sqlite = runplane_testkit::TestSqlite::new();
    let config = runplane_testkit::config::run_store(TOKEN, &sqlite.url());
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let server = serve_on_own_runtime(&config, addr.clone());

    let mut op = RunServiceClient::new(common::connected(&endpoint).await);
    let (run, key) = common::run_with_key(
        &mut op,
        "drain-loss-request-01",
        "agent",
        vec![],
        "drain-loss-key-000001",
    )
    .await;

    // The control plane goes away for longer than the (shortened) outage budget.
    server.shutdown_background();
    let layer = RetryLayer::new(RetryConfig {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(50),
        ordinary_budget: Duration::from_millis(300),
        ..RetryConfig::default()
    });
    let client = RunnerServiceClient::with_interceptor(
        runplane_transport::connect_lazy(&endpoint, &layer).unwrap(),
        Bearer::new(key),
    );
    let (tx, rx) = events::channel();
    let drain = tokio::spawn(events::drain(
        client,
        run.id.clone(),
        "drain-test-nonce".into(),
        runstore_pb::RunnerLimits {
            max_batch_events: 100,
            max_batch_bytes: 1 << 20,
            ..Default::default()
        },
        rx,
        runplane_runner::ending::Ending::new(),
        runplane_clock::SystemClock::shared(),
    ));

    // Far more than the pending buffer holds: the drain takes it all without waiting
    // (the producer never parks), keeping the newest and counting the oldest it drops.
    let line = |i: usize| runstore_pb::EventInput {
        kind: runstore_pb::EventKind::Stdout as i32,
        text: format!("line {i} {}", "y".repeat(4000)),
        ..Default::default()
    };
    let produced = 3 * events::QUEUE_EVENTS;
    tokio::time::timeout(Duration::from_secs(60), async {
        for i in 0..produced {
            tx.send(line(i)).await.unwrap();
        }
    })
    .await
    .expect("the producer never stayed parked");

    // The control plane returns; the held batch and the rest follow, and the last line
    // lands once everything before it has.
    let server = serve_on_own_runtime(&config, addr);
    tx.send(line(produced)).await.unwrap();
    let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    let mut stored = Vec::new();
    while stored
        .last()
        .is_none_or(|e: &runplane_run_store::store::entities::event::Model| {
            e.text != line(produced).text
        })
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = stored.last().map_or(0, |e| e.sequence as u64);
        stored.extend(
            store
                .store()
                .events_after(&run.id, after, 1000)
                .await
                .unwrap(),
        );
    }
    drop(tx);
    let report = drain.await.unwrap();

    // Every line is there in order, but for one gap that one marker counts exactly.
    let mut next = 0;
    let mut markers = 0;
    for event in &stored {
        if event.kind == runstore_pb::EventKind::EventsLost as i32 {
            markers += 1;
            next += serde_json::from_str::<serde_json::Value>(&event.data).unwrap()["count"]
                .as_f64()
                .unwrap() as usize;
        } else {
            assert_eq!(
                event.text,
                line(next).text,
                "at sequence {}",
                event.sequence
            );
            next += 1;
        }
    }
    assert_eq!(next, produced + 1, "every line is there or counted");
    assert_eq!(markers, 1, "one marker for the one gap");
    assert!(report.dropped > 0 && report.lost == 0, "{report:?}");
    assert_eq!(
        report.sent + report.dropped,
        produced as u64 + 1,
        "{report:?}"
    );
    server.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_respect_a_small_server_limit_and_an_oversized_event_is_cut_with_a_marker() {
    let sqlite = runplane_testkit::TestSqlite::new();
    let mut config = runplane_testkit::config::run_store(TOKEN, &sqlite.url());
    config.run_store.max_batch_bytes = 1024;
    config.run_store.max_batch_events = 5;
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let server = serve_on_own_runtime(&config, addr.clone());
    let mut op = RunServiceClient::new(common::connected(&endpoint).await);
    let (run, key) = common::run_with_key(
        &mut op,
        "drain-limit-request-01",
        "agent",
        vec![],
        "drain-limit-key-000001",
    )
    .await;
    let layer = RetryLayer::new(RetryConfig::default());
    let mut client = RunnerServiceClient::with_interceptor(
        runplane_transport::connect_lazy(&endpoint, &layer).unwrap(),
        Bearer::new(key),
    );
    let limits = client
        .hello(runstore_pb::HelloRequest {
            run_id: run.id.clone(),
            nonce: "drain-limit-nonce-01".into(),
            runner_version: "test".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .limits
        .unwrap();
    assert_eq!(limits.max_batch_bytes, 1024);

    let (tx, rx) = events::channel();
    let drain = tokio::spawn(events::drain(
        client,
        run.id.clone(),
        "drain-limit-nonce".into(),
        limits,
        rx,
        runplane_runner::ending::Ending::new(),
        runplane_clock::SystemClock::shared(),
    ));
    let texts: Vec<String> = (0..40)
        .map(|i| {
            if i == 20 {
                "x".repeat(5000)
            } else {
                format!("line {i} {}", "y".repeat(150))
            }
        })
        .collect();
    for text in &texts {
        tx.send(runstore_pb::EventInput {
            kind: runstore_pb::EventKind::Stdout as i32,
            text: text.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    drop(tx);
    let report = drain.await.unwrap();
    assert_eq!(
        (report.sent, report.lost),
        (40, 0),
        "nothing lost to BATCH_TOO_LARGE"
    );

    let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    let stored = store.store().events_after(&run.id, 0, 100).await.unwrap();
    assert_eq!(stored.len(), 40);
    for (got, sent) in stored.iter().zip(&texts) {
        if sent.len() > 1000 {
            assert!(got.text.starts_with("xxxx"), "{}", got.text);
            assert!(
                got.text.ends_with("bytes cut to fit the batch limit]"),
                "{}",
                got.text
            );
        } else {
            assert_eq!(&got.text, sent);
        }
    }
    server.shutdown_background();
}
