//! A suspended sandbox's stream is parked, not lost: a node agent idle-suspends a real
//! runner (SIGSTOP) after ParkStream, watchers tail and plan it for longer than five
//! leases on the coordinator's clock and nothing takes it over, then a wake restores it
//! (UnparkStream) and the run finishes with every line once, with no replay_gap.

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::Secret;
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_integration_tests::sandboxes::{ReapSession, eventually, start_node};
use runplane_integration_tests::{Process, channel, start_serve};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::{TestDatabase, TestRedis, free_local_addr};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const TOKEN: &str = "parked-stream-test-operator-token-0123456";
const RECEIPT_KEY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
/// The runner's lease time (services/runner/src/frames.rs).
const LEASE: Duration = Duration::from_secs(30);

type Recovery = StreamRecoveryServiceClient<InterceptedService<Channel, Bearer>>;
type Sandboxes = SandboxServiceClient<InterceptedService<Channel, Bearer>>;

/// The coordinator in this process, on a clock the test moves, so five leases pass in
/// no time; it reaches the run store over gRPC.
async fn coordinator(redis: &TestRedis, run_store: &str, clock: &ManualClock) -> String {
    let mut config = runplane_testkit::config::with_operator(TOKEN);
    config.auth.service_token = Secret::new(runplane_integration_tests::SERVICE_TOKEN);
    config.run_store.endpoint = run_store.to_owned();
    let store = RedisStore::connect(redis.url(), redis.prefix())
        .await
        .unwrap();
    let coordinator =
        StreamRecovery::with_store(Arc::new(store), &config, Arc::new(clock.clone())).unwrap();
    let mut services = ServiceSet::new();
    coordinator.register(&mut services);
    coordinator.start();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    endpoint
}

async fn sandbox_of(api: &Sandboxes, run_id: &str) -> Option<reconciler_pb::Sandbox> {
    api.clone()
        .list_sandboxes(reconciler_pb::ListSandboxesRequest {
            run_id: run_id.to_owned(),
            ..Default::default()
        })
        .await
        .ok()?
        .into_inner()
        .sandboxes
        .into_iter()
        .next()
}

async fn budget(recovery: &Recovery, run_id: &str) -> recovery_pb::GetRecoveryBudgetResponse {
    recovery
        .clone()
        .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Every item of a non-following tail from the first frame.
async fn tail(recovery: &Recovery, run_id: &str) -> Vec<recovery_pb::tail_response::Item> {
    let mut tail = recovery
        .clone()
        .tail(recovery_pb::TailRequest {
            run_id: run_id.to_owned(),
            from_sequence: 0,
            follow: false,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
    let mut items = Vec::new();
    while let Some(item) = tail.message().await.unwrap() {
        items.extend(item.item);
    }
    items
}

fn lines(items: &[recovery_pb::tail_response::Item]) -> Vec<String> {
    items
        .iter()
        .filter_map(|i| match i {
            recovery_pb::tail_response::Item::Frame(f) => {
                Some(String::from_utf8(f.data.clone()).unwrap())
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_run_is_never_taken_over_and_finishes_after_its_restore() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17031 = runplane_testkit::free_local_addr().to_string();
    let run_db = TestDatabase::new().await;
    let reconciler_db = TestDatabase::new().await;
    let redis = TestRedis::new().await;
    let state = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let clock = ManualClock::new(chrono::Utc::now());
    let recovery_endpoint = coordinator(&redis, &endpoint, &clock).await;
    let env: Vec<(&str, String)> = vec![
        ("RUNPLANE_SERVER__LISTEN", addr.clone()),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN.to_owned()),
        ("RUNPLANE_RUN_STORE__DATABASE_URL", run_db.url().to_owned()),
        (
            "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY",
            RECEIPT_KEY.to_owned(),
        ),
        // Not about admission: runs are created on the credential they name.
        ("RUNPLANE_RUN_STORE__ADMISSION", "false".to_owned()),
        ("RUNPLANE_RUN_STORE__ENDPOINT", endpoint.clone()),
        (
            "RUNPLANE_STREAM_RECOVERY__ENDPOINT",
            recovery_endpoint.clone(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL",
            reconciler_db.url().to_owned(),
        ),
        ("RUNPLANE_SANDBOX_RECONCILER__ENDPOINT", endpoint.clone()),
        (
            "RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS",
            "300".to_owned(),
        ),
        // Every sandbox goes to the node agent.
        (
            "RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES",
            "false".to_owned(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS",
            "2".to_owned(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR",
            state.path().join("reconciler").display().to_string(),
        ),
    ];
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _control_plane: Process =
        start_serve(&["run-store", "sandbox-reconciler"], &env_refs).await;
    let node_dir = state.path().join("node-p");
    let _agent = start_node(
        "node-p",
        node_endpoint_17031.as_str(),
        &endpoint,
        &recovery_endpoint,
        &node_dir,
        TOKEN,
    );

    // Ten lines, then it waits for a line on its stdin (parked, so it may be suspended),
    // which the test steers to it after the restore, so the last ten come only then, on
    // the same stream.
    let script = "for i in $(seq 1 10); do echo line $i; done; \
         read go_on; \
         for i in $(seq 11 20); do echo line $i; done"
        .to_owned();
    let mut runs = RunServiceClient::with_interceptor(channel(&endpoint).await, Bearer::new(TOKEN));
    let run_id = runs
        .create_run(runstore_pb::CreateRunRequest {
            client_request_id: "parked-stream-request-0001".into(),
            org_id: "acme".into(),
            target: Some(runstore_pb::create_run_request::Target::CredentialId(
                "c".into(),
            )),
            command: "sh".into(),
            args: vec!["-c".into(), script],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id;

    let api: Sandboxes =
        SandboxServiceClient::with_interceptor(channel(&endpoint).await, Bearer::new(TOKEN));
    let recovery: Recovery = StreamRecoveryServiceClient::with_interceptor(
        channel(&recovery_endpoint).await,
        Bearer::new(TOKEN),
    );
    let sandbox = eventually(Duration::from_secs(30), "the idle suspend", || {
        let (api, run_id) = (api.clone(), run_id.clone());
        async move {
            sandbox_of(&api, &run_id).await.filter(|s| {
                s.status() == reconciler_pb::SandboxStatus::Suspended && s.active_node_id.is_empty()
            })
        }
    })
    .await;
    let pid: u32 = std::fs::read_to_string(node_dir.join(&sandbox.id).join("pid"))
        .expect("the node recorded the sandbox's pid")
        .trim()
        .parse()
        .expect("a pid");
    assert!(pid > 1);
    let _reap = ReapSession(pid);

    let before = budget(&recovery, &run_id).await;
    assert_eq!(
        before.lease.as_ref().unwrap().state(),
        recovery_pb::LeaseState::Parked,
        "parked before the suspend: {before:?}"
    );
    assert_eq!(before.next_sequence, 11, "the first ten lines are in");

    // Watchers tail and plan it for longer than five leases: nothing takes it over.
    for _ in 0..6 {
        clock.advance(LEASE + Duration::from_secs(1));
        let plan = recovery
            .clone()
            .plan_recovery(recovery_pb::PlanRecoveryRequest {
                run_id: run_id.clone(),
                reason: "test".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            plan.decision(),
            recovery_pb::RecoveryDecision::LeaseHeld,
            "{plan:?}"
        );
        let items = tail(&recovery, &run_id).await;
        assert_eq!(lines(&items).len(), 10);
        assert!(
            !items
                .iter()
                .any(|i| matches!(i, recovery_pb::tail_response::Item::Recovery(r) if r.decision() == recovery_pb::RecoveryDecision::Claimed)),
            "a tail claimed a parked stream: {items:?}"
        );
    }
    let held = budget(&recovery, &run_id).await;
    assert_eq!(held.budget.unwrap().attempts, 0, "nothing was spent");
    assert_eq!(held.lease.unwrap().state(), recovery_pb::LeaseState::Parked);

    // A wake restores it; a steer gives the agent the line it waits for.
    api.clone()
        .request_wake(reconciler_pb::RequestWakeRequest {
            sandbox_id: sandbox.id.clone(),
            reason: "test".into(),
        })
        .await
        .unwrap();
    runs.steer(runstore_pb::SteerRequest {
        run_id: run_id.clone(),
        text: "go".into(),
        idempotency_key: "parked-stream-steer-00001".into(),
    })
    .await
    .unwrap();
    let status = eventually(Duration::from_secs(30), "the run to finish", || {
        let mut runs = runs.clone();
        let run_id = run_id.clone();
        async move {
            let run = runs
                .get_run(runstore_pb::GetRunRequest { run_id })
                .await
                .ok()?
                .into_inner()
                .run?;
            run.state().is_terminal().then_some(run)
        }
    })
    .await;
    assert_eq!(
        status.state(),
        runstore_pb::RunState::Succeeded,
        "{status:?}"
    );

    let items = tail(&recovery, &run_id).await;
    let expected: Vec<String> = (1..=20).map(|i| format!("line {i}")).collect();
    assert_eq!(lines(&items), expected, "every line once, in order");
    assert!(
        !items
            .iter()
            .any(|i| matches!(i, recovery_pb::tail_response::Item::ReplayGap(_))),
        "no replay_gap: {items:?}"
    );
    assert_eq!(budget(&recovery, &run_id).await.budget.unwrap().attempts, 0);
}
