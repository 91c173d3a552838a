//! Two real node agents: a sandbox is launched on one, suspended for idleness and
//! published unplaced; a reattach answers NOT_PLACED and queues a wake; a node restores
//! it, and the next reattach routes to the node that restored it (seed 003 end to end).

use std::time::Duration;

use runplane_integration_tests::sandboxes::{ReapSession, eventually, session_members, start_node};
use runplane_integration_tests::{Process, channel, start_serve};
use runplane_proto::reconciler::v1 as rpb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::{TestDatabase, free_local_addr};

const TOKEN: &str = "node-test-operator-token-0123456789abcdefg";
const RECEIPT_KEY: &str = "2f2e3d4c5b6a79887766554433221100ffeeddccbbaa99887766554433221100";

fn authed<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

/// The environment of `runplane serve run-store sandbox-reconciler` on `addr`, with
/// `extra` settings on top.
fn control_plane_env(
    run_db: &TestDatabase,
    reconciler_db: &TestDatabase,
    addr: &str,
    extra: &[(&'static str, &str)],
) -> Vec<(&'static str, String)> {
    let endpoint = format!("http://{addr}");
    let mut env = vec![
        ("RUNPLANE_SERVER__LISTEN", addr.to_owned()),
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
        ("RUNPLANE_STREAM_RECOVERY__ENDPOINT", endpoint),
        (
            "RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS",
            "300".to_owned(),
        ),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_suspended_sandbox_is_woken_and_routed_to_the_node_that_restored_it() {
    let run_db = TestDatabase::new().await;
    let reconciler_db = TestDatabase::new().await;
    let state = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let local_dir = state.path().join("reconciler");
    let env = control_plane_env(
        &run_db,
        &reconciler_db,
        &addr,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS", "3"),
            (
                "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR",
                &local_dir.display().to_string(),
            ),
        ],
    );
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _control_plane: Process = start_serve(
        &["run-store", "sandbox-reconciler", "stream-recovery"],
        &env_refs,
    )
    .await;

    // Both nodes share one state directory: they stand for two agents on one host, so
    // either can resume a process the other suspended.
    let sandboxes = state.path().join("nodes");
    let _a = start_node(
        "node-a",
        "127.0.0.1:17001",
        &endpoint,
        &endpoint,
        &sandboxes,
        TOKEN,
    );
    let _b = start_node(
        "node-b",
        "127.0.0.1:17002",
        &endpoint,
        &endpoint,
        &sandboxes,
        TOKEN,
    );
    let mut api = SandboxServiceClient::new(channel(&endpoint).await);
    eventually(Duration::from_secs(30), "two registered nodes", || {
        let mut api = api.clone();
        async move {
            let nodes = api
                .list_nodes(authed(rpb::ListNodesRequest::default()))
                .await
                .ok()?;
            (nodes.into_inner().nodes.len() == 2).then_some(())
        }
    })
    .await;

    let run = RunServiceClient::new(channel(&endpoint).await)
        .create_run(authed(pb::CreateRunRequest {
            client_request_id: "idle-wake-request-0001".into(),
            org_id: "acme".into(),
            target: Some(pb::create_run_request::Target::CredentialId("c".into())),
            command: "sh".into(),
            args: vec!["-c".into(), "exec sleep 20".into()],
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();

    // Dispatched to a node, launched, then suspended for idleness and published unplaced.
    let sandbox = eventually(
        Duration::from_secs(30),
        "the sandbox to start on a node",
        || {
            let mut api = api.clone();
            let run_id = run.id.clone();
            async move {
                let list = api
                    .list_sandboxes(authed(rpb::ListSandboxesRequest {
                        run_id,
                        ..Default::default()
                    }))
                    .await
                    .ok()?
                    .into_inner();
                list.sandboxes.into_iter().find(|s| {
                    s.status() == rpb::SandboxStatus::Started
                        && s.active_node_id.starts_with("node-")
                })
            }
        },
    )
    .await;
    let launched_on = sandbox.active_node_id.clone();
    eventually(Duration::from_secs(30), "the idle suspend", || {
        let mut api = api.clone();
        let id = sandbox.id.clone();
        async move {
            let s = api
                .get_sandbox(authed(rpb::GetSandboxRequest { sandbox_id: id }))
                .await
                .ok()?
                .into_inner()
                .sandbox?;
            (s.status() == rpb::SandboxStatus::Suspended && s.active_node_id.is_empty())
                .then_some(())
        }
    })
    .await;

    // The reattach: not placed, a wake is queued.
    let resolve = || {
        authed(rpb::ResolveRouteRequest {
            sandbox_id: sandbox.id.clone(),
            session_id: "session-1".into(),
        })
    };
    let refused = api.resolve_route(resolve()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let info = runplane_grpc::error_info(&refused).unwrap();
    assert_eq!(
        info.reason, "NOT_PLACED",
        "not routed to {launched_on}'s stale identity"
    );

    // A node restores it; the next reattach routes to that node.
    let restored_on = eventually(Duration::from_secs(30), "the wake to restore it", || {
        let mut api = api.clone();
        let id = sandbox.id.clone();
        async move {
            let s = api
                .get_sandbox(authed(rpb::GetSandboxRequest { sandbox_id: id }))
                .await
                .ok()?
                .into_inner()
                .sandbox?;
            (s.status() == rpb::SandboxStatus::Started && !s.active_node_id.is_empty())
                .then_some(s.active_node_id)
        }
    })
    .await;
    let route = api
        .resolve_route(resolve())
        .await
        .expect("routed after the wake")
        .into_inner();
    assert_eq!(route.node_id, restored_on);
    let expected = if restored_on == "node-a" {
        "127.0.0.1:17001"
    } else {
        "127.0.0.1:17002"
    };
    assert_eq!(route.endpoint, expected);

    // A sandbox outlives its nodes and control plane by design; end its runner here (the
    // agent's `sleep` ends on its own).
    if let Ok(pid) = std::fs::read_to_string(sandboxes.join(&sandbox.id).join("pid")) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", pid.trim())])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_restarted_without_its_sandbox_reports_it_lost_and_the_run_ends() {
    // The agent and its sandbox die together (a container restart); the agent comes back
    // with the same id at once, so the reconciler still counts the node ready and assigns
    // the sandbox again. Its key was claimed by the dead runner: the agent must say the
    // sandbox is gone, or the run would stay RUNNING for ever.
    let run_db = TestDatabase::new().await;
    let reconciler_db = TestDatabase::new().await;
    let state = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let endpoint = format!("http://{addr}");
    let env = control_plane_env(
        &run_db,
        &reconciler_db,
        &addr,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS", "2"),
            (
                "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR",
                &state.path().join("reconciler").display().to_string(),
            ),
        ],
    );
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _control_plane: Process = start_serve(
        &["run-store", "sandbox-reconciler", "stream-recovery"],
        &env_refs,
    )
    .await;
    let sandboxes = state.path().join("nodes");
    let agent = start_node(
        "node-r",
        "127.0.0.1:17011",
        &endpoint,
        &endpoint,
        &sandboxes,
        TOKEN,
    );

    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    let run = runs
        .create_run(authed(pb::CreateRunRequest {
            client_request_id: "agent-restart-request-01".into(),
            org_id: "acme".into(),
            target: Some(pb::create_run_request::Target::CredentialId("c".into())),
            command: "sh".into(),
            args: vec!["-c".into(), "echo started; exec sleep 60".into()],
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let run_id = run.id.clone();
    let running = || {
        let mut runs = runs.clone();
        let run_id = run_id.clone();
        async move {
            let run = runs
                .get_run(authed(pb::GetRunRequest { run_id }))
                .await
                .ok()?
                .into_inner()
                .run?;
            (run.state() == pb::RunState::Running).then_some(())
        }
    };
    eventually(
        Duration::from_secs(30),
        "the run to start on the node",
        running,
    )
    .await;

    // The agent and its sandbox die.
    drop(agent);
    let mut api = SandboxServiceClient::new(channel(&endpoint).await);
    let sandbox = api
        .list_sandboxes(authed(rpb::ListSandboxesRequest {
            run_id: run.id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .remove(0);
    let pid: u32 = std::fs::read_to_string(sandboxes.join(&sandbox.id).join("pid"))
        .unwrap()
        .trim()
        .parse()
        .expect("a pid");
    assert!(pid > 1);
    // The agent this kill leaves orphaned must not outlive the test.
    let _reap = ReapSession(pid);
    // The sandbox's shell and its runner (by pid, never a process group: nothing else of
    // this test's may be hit).
    let _ = std::process::Command::new("pkill")
        .args(["-KILL", "-P", &pid.to_string()])
        .status();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();

    // Back at once, same id, same state directory.
    let _agent = start_node(
        "node-r",
        "127.0.0.1:17011",
        &endpoint,
        &endpoint,
        &sandboxes,
        TOKEN,
    );
    let ended = eventually(Duration::from_secs(30), "the run to end", || {
        let mut runs = runs.clone();
        let run_id = run.id.clone();
        async move {
            let run = runs
                .get_run(authed(pb::GetRunRequest { run_id }))
                .await
                .ok()?
                .into_inner()
                .run?;
            run.state().is_terminal().then_some(run)
        }
    })
    .await;
    assert_eq!(ended.state(), pb::RunState::Failed, "{ended:?}");
    assert_eq!(ended.verdict.unwrap().reason, "sandbox_lost");
    // Nothing of it keeps running: the agent the dead runner left behind is stopped with
    // the sandbox's session when the ended run's sandbox is destroyed.
    eventually(
        Duration::from_secs(15),
        "the orphaned agent to be gone",
        || async move { session_members(pid).is_empty().then_some(()) },
    )
    .await;
}
