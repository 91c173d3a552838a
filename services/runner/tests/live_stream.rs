//! The live stream is not given up when the coordinator is unreachable at the start: a
//! runner whose first AcquireLease failed for good (the coordinator down past the
//! transport's budget) acquires the lease once the coordinator is back and streams the
//! agent's output, instead of leaving the run without a live stream for its whole life.

mod common;

use std::time::Duration;

use common::TOKEN;
use runplane_config::Secret;
use runplane_grpc::ServiceSet;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_run_store::RunStore;
use runplane_runner::RunnerEnv;
use runplane_stream_recovery::StreamRecovery;
use runplane_testkit::authed;
use runplane_testkit::run_store::serve_on_own_runtime;
use runplane_transport::RetryConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_whose_first_acquire_failed_streams_once_the_coordinator_is_back() {
    let scratch = tempfile::tempdir().unwrap();
    let stop = scratch.path().join("stop");
    let sqlite = runplane_testkit::TestSqlite::new();
    let mut config = runplane_testkit::config::run_store(TOKEN, &sqlite.url());
    let addr = runplane_testkit::free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    config.run_store.endpoint = endpoint.clone();
    let server = serve_on_own_runtime(&config, addr);
    // Where the coordinator will be: nothing listens there yet.
    let coordinator_addr = runplane_testkit::free_local_addr();
    let coordinator = format!("http://{coordinator_addr}");

    let mut op = RunServiceClient::new(common::connected(&endpoint).await);
    let (run, key) = common::run_with_key(
        &mut op,
        "live-stream-request-01",
        "sh",
        vec![
            "-c".into(),
            format!(
                "i=0; while [ ! -f {} ]; do echo line $i; i=$((i+1)); sleep 0.1; done",
                stop.display()
            ),
        ],
        "live-stream-key-000001",
    )
    .await;
    let runner = tokio::spawn(runplane_runner::run(
        RunnerEnv {
            endpoint: endpoint.clone(),
            recovery_endpoint: coordinator.clone(),
            run_id: run.id.clone(),
            run_key: Secret::new(key),
        },
        // A short budget: the first AcquireLease fails for good within a second.
        RetryConfig {
            ordinary_budget: Duration::from_millis(500),
            ..RetryConfig::default()
        },
        runplane_clock::SystemClock::shared(),
    ));
    let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    // The agent runs and its events arrive; the acquire has failed meanwhile.
    while store.store().count_events(&run.id).await.unwrap() < 10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The coordinator comes up.
    let recovery =
        StreamRecovery::embedded(&config, runplane_clock::SystemClock::shared()).unwrap();
    let mut services = ServiceSet::new();
    recovery.register(&mut services);
    let listener = tokio::net::TcpListener::bind(coordinator_addr)
        .await
        .unwrap();
    tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    let mut api = StreamRecoveryServiceClient::new(common::connected(&coordinator).await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let budget = api
            .get_recovery_budget(authed(
                recovery_pb::GetRecoveryBudgetRequest {
                    run_id: run.id.clone(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner();
        let held = budget
            .lease
            .as_ref()
            .is_some_and(|l| l.state() == recovery_pb::LeaseState::Held);
        if held && budget.next_sequence > 10 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the runner never took the lease: {budget:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    std::fs::write(&stop, "").unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(60), runner)
        .await
        .expect("the runner ends")
        .unwrap()
        .unwrap();
    assert!(outcome.recorded, "{outcome:?}");
    server.shutdown_background();
}
