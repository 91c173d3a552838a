//! Fair share over real processes, as deployed: the run store, credential health and the
//! coordinator in one `runplane serve` on PostgreSQL, two sandbox-reconciler replicas
//! (`runplane serve sandbox-reconciler`) sharing one database, both dispatching, and a
//! node agent (given both replicas) that launches the sandboxes. Several reconcilers run
//! with `local_sandboxes = false`: a local sandbox lives in one replica's process tree.
//!
//! The field report: capacity 2, acme queued 24 runs, then beta created one, and beta's
//! run waited behind acme's whole queue (49 s). Now beta's run takes the next slot that
//! frees, whichever replica claims it.

use std::time::Duration;

use runplane_integration_tests::sandboxes::{mint_node_credential, start_node_with_credential};
use runplane_integration_tests::{Process, channel, start_serve};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::{TestDatabase, authed, free_local_addr};
use tonic::transport::Channel;

const TOKEN: &str = "fair-share-test-operator-token-0123456789ab";
const RECEIPT_KEY: &str = "1f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f1";

fn refs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

async fn create(runs: &mut RunServiceClient<Channel>, org: &str, id: &str) -> String {
    runs.create_run(authed(
        runstore_pb::CreateRunRequest {
            client_request_id: format!("{id:0>16}"),
            org_id: org.into(),
            target: Some(runstore_pb::create_run_request::Target::Profile(
                "shared".into(),
            )),
            command: "sh".into(),
            args: vec!["-c".into(), "sleep 2".into()],
            ..Default::default()
        },
        TOKEN,
    ))
    .await
    .expect("admitted")
    .into_inner()
    .run
    .unwrap()
    .id
}

/// The runs of `org` no longer QUEUED.
async fn left_the_queue(runs: &mut RunServiceClient<Channel>, org: &str) -> Vec<runstore_pb::Run> {
    runs.list_runs(authed(
        runstore_pb::ListRunsRequest {
            org_id: org.into(),
            page_size: 500,
            view: runstore_pb::RunView::Basic as i32,
            ..Default::default()
        },
        TOKEN,
    ))
    .await
    .unwrap()
    .into_inner()
    .runs
    .into_iter()
    .filter(|r| r.state() != runstore_pb::RunState::Queued)
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_run_of_another_org_takes_the_next_slot_before_a_queue_of_24_with_two_reconcilers() {
    let run_db = TestDatabase::new().await;
    let health_db = TestDatabase::new().await;
    let reconciler_db = TestDatabase::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        r#"
[[credential_health.profiles]]
name = "shared"
credential_id = "shared"
capacity = 2
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#,
    )
    .unwrap();
    let addr = free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let common: Vec<(&str, String)> = vec![
        ("RUNPLANE_CONFIG", config.display().to_string()),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN.to_owned()),
        ("RUNPLANE_RUN_STORE__ENDPOINT", endpoint.clone()),
        ("RUNPLANE_CREDENTIAL_HEALTH__ENDPOINT", endpoint.clone()),
        ("RUNPLANE_STREAM_RECOVERY__ENDPOINT", endpoint.clone()),
    ];
    let mut services = common.clone();
    services.extend([
        ("RUNPLANE_SERVER__LISTEN", addr.clone()),
        ("RUNPLANE_RUN_STORE__DATABASE_URL", run_db.url().to_owned()),
        (
            "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY",
            RECEIPT_KEY.to_owned(),
        ),
        (
            "RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL",
            health_db.url().to_owned(),
        ),
        (
            "RUNPLANE_STREAM_RECOVERY__REDIS_URL",
            "memory://".to_owned(),
        ),
    ]);
    let _services: Process = start_serve(
        &["run-store", "credential-health", "stream-recovery"],
        &refs(&services),
    )
    .await;
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        let listen = free_local_addr().to_string();
        let mut env = common.clone();
        env.extend([
            ("RUNPLANE_SERVER__LISTEN", listen.clone()),
            (
                "RUNPLANE_SANDBOX_RECONCILER__ENDPOINT",
                format!("http://{listen}"),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL",
                reconciler_db.url().to_owned(),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR",
                dir.path().join(name).display().to_string(),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS",
                "200".to_owned(),
            ),
            // Every sandbox goes to the node agent.
            (
                "RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES",
                "false".to_owned(),
            ),
        ]);
        replicas.push(start_serve(&["sandbox-reconciler"], &refs(&env)).await);
    }
    let reconcilers = replicas
        .iter()
        .map(Process::endpoint)
        .collect::<Vec<_>>()
        .join(",");
    let _node = start_node_with_credential(
        "node-f",
        &free_local_addr().to_string(),
        &reconcilers,
        &endpoint,
        &dir.path().join("node-f"),
        &mint_node_credential(&replicas[0].endpoint(), TOKEN, "node-f"),
        // The agents only sleep; containment is not what this test is about.
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    );

    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    for i in 0..24 {
        create(&mut runs, "acme", &format!("acme-run-{i:02}")).await;
    }
    // Both slots taken by acme's oldest runs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while left_the_queue(&mut runs, "acme").await.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "acme's first runs never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let beta = create(&mut runs, "beta", "beta-run-only").await;
    // When beta's run leaves the queue, acme has started at most the two that held the
    // slots and the one that shared the freed pair with beta's: never its whole queue.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let beta_run = left_the_queue(&mut runs, "beta").await;
        if beta_run.iter().any(|r| r.id == beta) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "beta's run never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let acme_started = left_the_queue(&mut runs, "acme").await.len();
    assert!(
        acme_started <= 4,
        "beta's run waited behind {acme_started} of acme's runs"
    );
    drop(replicas);
}
