//! A drain that fails for good releases the agent's pipes and reports the loss once the
//! run store answers again: the queue never stays full, nothing is silently dropped.

use std::time::Duration;

use runplane_config::{Config, Secret};
use runplane_grpc::ServiceSet;
use runplane_proto::runstore::v1 as pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_runner::{Bearer, events};
use runplane_transport::{RetryConfig, RetryLayer};

const TOKEN: &str = "drain-test-service-token-0123456789abcdef";

/// A fresh run store (its own pool) on its own runtime: shutting the runtime down is a
/// crashed process.
fn serve(config: &Config, addr: String) -> tokio::runtime::Runtime {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let config = config.clone();
    runtime.spawn(async move {
        let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
            .await
            .unwrap();
        let mut services = ServiceSet::new();
        store.register(&mut services);
        let listener = loop {
            match tokio::net::TcpListener::bind(&addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        let _ = runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        )
        .await;
    });
    runtime
}

fn authed<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_fails_for_good_releases_the_pipes_and_reports_the_loss() {
    let sqlite = runplane_testkit::TestSqlite::new();
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.run_store.database_url = sqlite.url();
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    // Not about admission: runs are created on the credential they name.
    config.run_store.admission = false;
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let server = serve(&config, addr.clone());

    let channel = loop {
        if let Ok(c) = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut op = RunServiceClient::new(channel);
    let run = op
        .create_run(authed(pb::CreateRunRequest {
            client_request_id: "drain-loss-request-01".into(),
            org_id: "acme".into(),
            target: Some(pb::create_run_request::Target::CredentialId("c".into())),
            command: "agent".into(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = op
        .issue_run_key(authed(pb::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "drain-loss-key-000001".into(),
        }))
        .await
        .unwrap()
        .into_inner()
        .run_key;

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
        pb::RunnerLimits {
            max_batch_events: 100,
            max_batch_bytes: 1 << 20,
            ..Default::default()
        },
        rx,
        runplane_runner::ending::Ending::new(),
    ));

    // More than the queue holds: if the drain kept the queue full, this would park forever.
    let line = |i: usize| pb::EventInput {
        kind: pb::EventKind::Stdout as i32,
        text: format!("line {i}"),
        ..Default::default()
    };
    let produced = 3 * events::QUEUE_EVENTS;
    tokio::time::timeout(Duration::from_secs(60), async {
        for i in 0..produced {
            tx.send(line(i)).await.unwrap();
        }
    })
    .await
    .expect("the pipes were released: the producer never stayed parked");

    // The control plane returns; after the probe interval the next batch reports the loss.
    let server = serve(&config, addr);
    tokio::time::sleep(events::PROBE_EVERY + Duration::from_millis(500)).await;
    tx.send(line(produced)).await.unwrap();
    drop(tx);
    let report = drain.await.unwrap();

    let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    let stored = store.store().events_after(&run.id, 0, 100).await.unwrap();
    let lost: Vec<_> = stored
        .iter()
        .filter(|e| e.kind == pb::EventKind::EventsLost as i32)
        .collect();
    assert_eq!(lost.len(), 1, "one report of the loss: {stored:?}");
    let reported: f64 = serde_json::from_str::<serde_json::Value>(&lost[0].data).unwrap()["count"]
        .as_f64()
        .unwrap();
    // Everything not delivered is accounted for: reported, or still to report at the end.
    assert_eq!(
        reported as u64 + report.lost,
        produced as u64 + 1 - report.sent
    );
    assert!(reported as usize >= produced - 100, "reported {reported}");
    server.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_respect_a_small_server_limit_and_an_oversized_event_is_cut_with_a_marker() {
    let sqlite = runplane_testkit::TestSqlite::new();
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.run_store.database_url = sqlite.url();
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    config.run_store.admission = false;
    config.run_store.max_batch_bytes = 1024;
    config.run_store.max_batch_events = 5;
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let server = serve(&config, addr.clone());
    let channel = loop {
        if let Ok(c) = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut op = RunServiceClient::new(channel);
    let run = op
        .create_run(authed(pb::CreateRunRequest {
            client_request_id: "drain-limit-request-01".into(),
            org_id: "acme".into(),
            target: Some(pb::create_run_request::Target::CredentialId("c".into())),
            command: "agent".into(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = op
        .issue_run_key(authed(pb::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "drain-limit-key-000001".into(),
        }))
        .await
        .unwrap()
        .into_inner()
        .run_key;
    let layer = RetryLayer::new(RetryConfig::default());
    let mut client = RunnerServiceClient::with_interceptor(
        runplane_transport::connect_lazy(&endpoint, &layer).unwrap(),
        Bearer::new(key),
    );
    let limits = client
        .hello(pb::HelloRequest {
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
        tx.send(pb::EventInput {
            kind: pb::EventKind::Stdout as i32,
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
