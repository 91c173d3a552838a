//! A real runner streams its output as frames under its lease; the coordinator takes the
//! stream over (the lease lapsed), the claim reaches the runner as resume_stream, and the
//! runner continues with the new token: a tail sees every line once, in order.

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::{Config, Secret};
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_integration_tests::runplane_bin;
use runplane_proto::recovery::v1 as pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as rs;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_run_store::RunStore;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::{TestDatabase, TestRedis};

const TOKEN: &str = "takeover-test-service-token-0123456789ab";

async fn serve(services: ServiceSet) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_over_stream_continues_with_the_new_token() {
    let db = TestDatabase::new().await;
    let redis = TestRedis::new().await;
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.run_store.database_url = db.url().to_owned();
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    let run_store = RunStore::open(&config, runplane_clock::SystemClock::shared())
        .await
        .unwrap();
    let mut services = ServiceSet::new();
    run_store.register(&mut services);
    let run_store_endpoint = serve(services).await;
    config.run_store.endpoint = run_store_endpoint.clone();

    let clock = ManualClock::new(chrono::Utc::now());
    let store = RedisStore::connect(redis.url(), redis.prefix())
        .await
        .unwrap();
    let coordinator =
        StreamRecovery::with_store(Arc::new(store), &config, Arc::new(clock.clone())).unwrap();
    let mut services = ServiceSet::new();
    coordinator.register(&mut services);
    let coordinator_endpoint = serve(services).await;

    let channel = |e: String| async move {
        tonic::transport::Endpoint::from_shared(e)
            .unwrap()
            .connect()
            .await
            .unwrap()
    };
    let mut op = RunServiceClient::with_interceptor(
        channel(run_store_endpoint.clone()).await,
        Bearer::new(TOKEN),
    );
    let run = op
        .create_run(rs::CreateRunRequest {
            client_request_id: "takeover-request-000001".into(),
            org_id: "acme".into(),
            target: Some(rs::create_run_request::Target::CredentialId("c".into())),
            command: "sh".into(),
            args: vec![
                "-c".into(),
                "for i in $(seq 1 10); do echo line $i; done; sleep 4; for i in $(seq 11 20); do echo line $i; done".into(),
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = op
        .issue_run_key(rs::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "takeover-sandbox-key-1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .run_key;
    let mut runner = tokio::process::Command::new(runplane_bin())
        .arg("runner")
        .env("RUNPLANE_ENDPOINT", &run_store_endpoint)
        .env("RUNPLANE_RECOVERY_ENDPOINT", &coordinator_endpoint)
        .env("RUNPLANE_RUN_ID", &run.id)
        .env("RUNPLANE_RUN_KEY", &key)
        .env_remove("RUNPLANE_CONFIG")
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let mut recovery = StreamRecoveryServiceClient::with_interceptor(
        channel(coordinator_endpoint.clone()).await,
        Bearer::new(TOKEN),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let b = recovery
            .get_recovery_budget(pb::GetRecoveryBudgetRequest {
                run_id: run.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        if b.next_sequence >= 11 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first frames arrive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The controller is presumed dead: its lease lapses (on the coordinator's clock), and a
    // tail's recovery plan claims the stream. A renewal racing the jump can keep the
    // lease once; jump again then.
    let mut claimed = None;
    for _ in 0..3 {
        clock.advance(Duration::from_secs(31));
        let plan = recovery
            .plan_recovery(pb::PlanRecoveryRequest {
                run_id: run.id.clone(),
                reason: "test".into(),
            })
            .await
            .unwrap()
            .into_inner();
        if plan.decision() == pb::RecoveryDecision::Claimed {
            claimed = Some(plan);
            break;
        }
    }
    let claimed = claimed.expect("the stream was claimed");
    assert_eq!(claimed.next_sequence, 11);

    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    let mut tail = recovery
        .tail(pb::TailRequest {
            run_id: run.id.clone(),
            from_sequence: 0,
            follow: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut lines = Vec::new();
    while let Some(item) = tail.message().await.unwrap() {
        if let Some(pb::tail_response::Item::Frame(f)) = item.item {
            lines.push(String::from_utf8(f.data).unwrap());
        }
    }
    let expected: Vec<String> = (1..=20).map(|i| format!("line {i}")).collect();
    assert_eq!(
        lines, expected,
        "every line once, in order, across the takeover"
    );
    let budget = recovery
        .get_recovery_budget(pb::GetRecoveryBudgetRequest {
            run_id: run.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(budget.budget.unwrap().attempts, 1);
}
