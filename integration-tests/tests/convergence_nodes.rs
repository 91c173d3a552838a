//! Convergence over real processes: a node agent idle-suspends a sandbox (SIGSTOP,
//! published unplaced), the run is then ended through the run store, and within a round
//! or two the reconciler shows the sandbox DELETED and the node agent has stopped every
//! process of it, the stopped ones included (docs/architecture.md "A run's life and its end").

use std::time::Duration;

use runplane_integration_tests::sandboxes::{
    self, ReapSession, eventually, process_state, session_members, start_node,
};
use runplane_integration_tests::{Process, channel, start_serve};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use runplane_testkit::{TestDatabase, free_local_addr};

const TOKEN: &str = "convergence-test-operator-token-0123456789";
const RECEIPT_KEY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_suspended_sandbox_of_an_ended_run_is_deleted_and_its_processes_stopped() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17021 = runplane_testkit::free_local_addr().to_string();
    let run_db = TestDatabase::new().await;
    let reconciler_db = TestDatabase::new().await;
    let state = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
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
            "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL",
            reconciler_db.url().to_owned(),
        ),
        ("RUNPLANE_SANDBOX_RECONCILER__ENDPOINT", endpoint.clone()),
        // The coordinator in process: runners stream to it, node agents park with it.
        (
            "RUNPLANE_STREAM_RECOVERY__REDIS_URL",
            "memory://".to_owned(),
        ),
        ("RUNPLANE_STREAM_RECOVERY__ENDPOINT", endpoint.clone()),
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
    let _control_plane: Process = start_serve(
        &["run-store", "sandbox-reconciler", "stream-recovery"],
        &env_refs,
    )
    .await;
    let node_dir = state.path().join("node-c");
    let _agent = start_node(
        "node-c",
        node_endpoint_17021.as_str(),
        &endpoint,
        &endpoint,
        &node_dir,
        TOKEN,
    );

    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    let run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "convergence-request-0001".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: "sh".into(),
                // Waiting for a line nobody sends: parked, so the node may suspend it.
                args: vec!["-c".into(), "read line; exec sleep 120".into()],
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();

    // Launched on the node, then suspended for idleness and published unplaced.
    let api = SandboxServiceClient::new(channel(&endpoint).await);
    let (sandbox, pid) =
        sandboxes::idle_suspended(&api, TOKEN, &run.id, &node_dir, Duration::from_secs(60)).await;
    // A sandbox runs in a session of its own and outlives this test; should the test
    // fail, its frozen processes must not stay behind on the machine.
    let _reap = ReapSession(pid);
    // Every process of the sandbox is stopped: its shell, its runner and the agent.
    let members = eventually(Duration::from_secs(10), "a frozen sandbox", || async move {
        let members = session_members(pid);
        (members.len() >= 3 && members.iter().all(|m| process_state(*m) == Some('T')))
            .then_some(members)
    })
    .await;

    // The run ends (an operator's cancel, or a service's FailRun where cancel is not
    // served), while its sandbox is suspended and unplaced.
    let cancelled = runs
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run.id.clone(),
                reason: "convergence test".into(),
                idempotency_key: "convergence-cancel-0001".into(),
            },
            TOKEN,
        ))
        .await;
    if let Err(status) = cancelled {
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
        runs.fail_run(authed(
            runstore_pb::FailRunRequest {
                run_id: run.id.clone(),
                reason: "ended_by_test".into(),
                message: "ended while its sandbox was suspended".into(),
                idempotency_key: "convergence-fail-0001".into(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap();
    }

    // Within a round or two: DELETED, and nothing of it runs any more.
    eventually(Duration::from_secs(15), "the sandbox DELETED", || {
        let mut api = api.clone();
        let id = sandbox.id.clone();
        async move {
            let s = api
                .get_sandbox(authed(
                    reconciler_pb::GetSandboxRequest { sandbox_id: id },
                    TOKEN,
                ))
                .await
                .ok()?
                .into_inner()
                .sandbox?;
            (s.status() == reconciler_pb::SandboxStatus::Deleted).then_some(())
        }
    })
    .await;
    let left = eventually(
        Duration::from_secs(15),
        "every process of the sandbox to be gone",
        || {
            let members = members.clone();
            async move {
                let left: Vec<u32> = members
                    .iter()
                    .copied()
                    .filter(|m| process_state(*m).is_some())
                    .collect();
                (left.is_empty() && session_members(pid).is_empty()).then_some(left)
            }
        },
    )
    .await;
    assert!(left.is_empty());
    let run = runs
        .get_run(authed(
            runstore_pb::GetRunRequest {
                run_id: run.id.clone(),
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert!(run.state().is_terminal(), "{run:?}");
}
