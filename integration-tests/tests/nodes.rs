//! Real node agents, each on a state directory of its own as on a host of its own: a
//! sandbox is launched on one, suspended for idleness and published unplaced; a reattach
//! answers NOT_PLACED and queues a wake; the node holding the sandbox restores it (no
//! other can), the next reattach routes there and the run finishes (a reattach to an idle-suspended
//! sandbox, end to end). A launch the reconciler refuses is not asked for again on every poll.

use std::time::Duration;

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{
    self, ControlPlane, ReapSession, eventually, session_members, start_node, start_node_logging,
};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const TOKEN: &str = "node-test-operator-token-0123456789abcdefg";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_suspended_sandbox_is_woken_on_the_node_holding_it_and_its_run_finishes() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17001 = runplane_testkit::free_local_addr().to_string();
    let node_endpoint_17002 = runplane_testkit::free_local_addr().to_string();
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS", "3"),
            // Every sandbox goes to a node agent.
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
        ],
    )
    .await;
    let endpoint = control_plane.endpoint.clone();

    // Two hosts: each node its own state directory, so only the node that suspended a
    // sandbox can resume its processes. node-b comes first and gets the run.
    let (_b, holder_dir) = control_plane.node("node-b", node_endpoint_17002.as_str());
    let mut api = SandboxServiceClient::new(channel(&endpoint).await);
    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    // The agent waits for a line on its stdin (parked, so it may be suspended) and
    // finishes once the test steers one to it: frozen, it cannot.
    let run = control_plane
        .create_script_run("idle-wake-request-0001", "read go; echo done")
        .await;

    // Launched on node-b, then suspended for idleness and published unplaced.
    let (sandbox, pid) =
        sandboxes::idle_suspended(&api, TOKEN, &run.id, &holder_dir, Duration::from_secs(30)).await;
    // Frozen processes must not outlive a failing test.
    let _reap = ReapSession(pid);

    // node-a joins: registered, ready, using no more than node-b and first of the two by
    // id, so the least-used rule would hand it the wake.
    let _a = control_plane.node("node-a", node_endpoint_17001.as_str());
    eventually(Duration::from_secs(30), "node-a ready and idle", || {
        let mut api = api.clone();
        async move {
            let nodes = api
                .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
                .await
                .ok()?
                .into_inner()
                .nodes;
            let a = nodes.iter().find(|n| n.id == "node-a")?;
            let b = nodes.iter().find(|n| n.id == "node-b")?;
            (a.state() == reconciler_pb::NodeState::Ready && a.used <= b.used).then_some(())
        }
    })
    .await;

    // The reattach: not placed, a wake is queued.
    let resolve = || {
        authed(
            reconciler_pb::ResolveRouteRequest {
                sandbox_id: sandbox.id.clone(),
                session_id: "session-1".into(),
            },
            TOKEN,
        )
    };
    let refused = api.resolve_route(resolve()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let info = runplane_grpc::error_info(&refused).unwrap();
    assert_eq!(
        info.reason, "NOT_PLACED",
        "not routed to node-b's stale identity"
    );

    // node-b, which holds it, restores it; the next reattach routes there.
    eventually(Duration::from_secs(30), "the wake to restore it", || {
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
            (s.status() == reconciler_pb::SandboxStatus::Started && !s.active_node_id.is_empty())
                .then_some(())
        }
    })
    .await;
    let route = api
        .resolve_route(resolve())
        .await
        .expect("routed after the wake")
        .into_inner();
    assert_eq!(
        (route.node_id.as_str(), route.endpoint.as_str()),
        ("node-b", node_endpoint_17002.as_str()),
        "the wake went to the node holding the sandbox"
    );

    // Thawed, the agent is given its line, finishes and so does the run.
    runs.steer(authed(
        runstore_pb::SteerRequest {
            run_id: run.id.clone(),
            text: "go".into(),
            idempotency_key: "idle-wake-steer-00001".into(),
        },
        TOKEN,
    ))
    .await
    .unwrap();
    let ended = eventually(Duration::from_secs(30), "the run to finish", || {
        let mut runs = runs.clone();
        let run_id = run.id.clone();
        async move {
            let run = runs
                .get_run(authed(runstore_pb::GetRunRequest { run_id }, TOKEN))
                .await
                .ok()?
                .into_inner()
                .run?;
            run.state().is_terminal().then_some(run)
        }
    })
    .await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_restarted_without_its_sandbox_reports_it_lost_and_the_run_retries() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17011 = runplane_testkit::free_local_addr().to_string();
    // The agent and its sandbox die together (a container restart); the agent comes back
    // with the same id at once, so the reconciler still counts the node ready and assigns
    // the sandbox again. Its key was claimed by the dead runner: the agent must say the
    // sandbox is gone, or the run would stay RUNNING for ever. Past the grace the attempt
    // ends sandbox_lost and the run's second attempt runs in a new sandbox.
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS", "2"),
        ],
    )
    .await;
    let (endpoint, state) = (control_plane.endpoint.clone(), &control_plane.state);
    let sandboxes = state.path().join("nodes");
    let agent = start_node(
        "node-r",
        node_endpoint_17011.as_str(),
        &endpoint,
        &endpoint,
        &sandboxes,
        TOKEN,
    );

    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    let run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "agent-restart-request-01".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: "sh".into(),
                args: vec![
                    "-c".into(),
                    "echo attempt $RUNPLANE_ATTEMPT; [ $RUNPLANE_ATTEMPT = 1 ] && exec sleep 60; \
                     echo done"
                        .into(),
                ],
                ..Default::default()
            },
            TOKEN,
        ))
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
                .get_run(authed(runstore_pb::GetRunRequest { run_id }, TOKEN))
                .await
                .ok()?
                .into_inner()
                .run?;
            (run.state() == runstore_pb::RunState::Running).then_some(())
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
        .list_sandboxes(authed(
            reconciler_pb::ListSandboxesRequest {
                run_id: run.id.clone(),
                ..Default::default()
            },
            TOKEN,
        ))
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
        node_endpoint_17011.as_str(),
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
                .get_run(authed(runstore_pb::GetRunRequest { run_id }, TOKEN))
                .await
                .ok()?
                .into_inner()
                .run?;
            run.state().is_terminal().then_some(run)
        }
    })
    .await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    let reasons: Vec<&str> = ended
        .attempts
        .iter()
        .map(|a| a.end_reason.as_str())
        .collect();
    assert_eq!(reasons, ["sandbox_lost", "exit_zero"], "{ended:?}");
    // Nothing of attempt 1 keeps running: the agent the dead runner left behind is stopped
    // with the sandbox's session when the superseded sandbox is destroyed.
    eventually(
        Duration::from_secs(15),
        "the orphaned agent to be gone",
        || async move { session_members(pid).is_empty().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_the_reconciler_refuses_is_not_claimed_again_on_every_poll() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17031 = runplane_testkit::free_local_addr().to_string();
    // The run store has moved the run to a newer sandbox generation, so the claim of
    // generation 1 is FAILED_PRECONDITION/GENERATION_STALE however often it is asked. The
    // RUN assignment stays listed; the agent must take the answer as final.
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            // The test places the sandbox itself.
            ("RUNPLANE_SANDBOX_RECONCILER__DISPATCH", "false"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
        ],
    )
    .await;
    let (endpoint, state) = (control_plane.endpoint.clone(), &control_plane.state);
    let log = state.path().join("node-q.log");
    let _agent = start_node_logging(
        "node-q",
        node_endpoint_17031.as_str(),
        &endpoint,
        &endpoint,
        &state.path().join("node-q"),
        TOKEN,
        &log,
    );

    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    let run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "refused-launch-request-1".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: "true".into(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    runs.issue_run_key(authed(
        runstore_pb::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "0b0e5c1a-7d3e-4f60-9a2b-5c6d7e8f9a0b".into(),
            sandbox_generation: 5,
            idempotency_key: "a-newer-generation-0001".into(),
            ..Default::default()
        },
        TOKEN,
    ))
    .await
    .unwrap();
    let mut api = SandboxServiceClient::new(channel(&endpoint).await);
    eventually(Duration::from_secs(30), "node-q registered", || {
        let mut api = api.clone();
        async move {
            let nodes = api
                .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
                .await
                .ok()?
                .into_inner()
                .nodes;
            nodes.iter().any(|n| n.id == "node-q").then_some(())
        }
    })
    .await;
    api.create_sandbox(authed(
        reconciler_pb::CreateSandboxRequest {
            client_request_id: "refused-launch-sandbox-1".into(),
            run_id: run.id.clone(),
            substrate: reconciler_pb::Substrate::Direct as i32,
            idle_timeout: None,
            node_id: "node-q".into(),
        },
        TOKEN,
    ))
    .await
    .unwrap();

    let refusals = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("launch not claimed")
            .count()
    };
    eventually(Duration::from_secs(30), "the refused claim", || async {
        (refusals() > 0).then_some(())
    })
    .await;
    // A window of five heartbeats (one every 2 s; the agent polls its assignments about
    // once a second in between, each poll listing the refused RUN assignment again).
    let heartbeat_of = |api: &SandboxServiceClient<_>| {
        let mut api = api.clone();
        async move {
            api.list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
                .await
                .ok()?
                .into_inner()
                .nodes
                .into_iter()
                .find(|n| n.id == "node-q")?
                .last_heartbeat_at
        }
    };
    for _ in 0..5 {
        let before = heartbeat_of(&api).await;
        eventually(Duration::from_secs(30), "the next heartbeat", || {
            let api = api.clone();
            async move {
                let now = heartbeat_of(&api).await;
                (now.is_some() && now != before).then_some(())
            }
        })
        .await;
    }
    assert_eq!(refusals(), 1, "the refusal is final for that assignment");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_on_a_host_lost_for_good_runs_its_next_attempt_on_another_node() {
    // A host gone (its node agent and the sandbox killed, nothing comes back): past the
    // loss grace the attempt ends sandbox_lost, once, and attempt 2 runs on the node still
    // standing, learns why attempt 1 ended, and the run succeeds.
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS", "2"),
        ],
    )
    .await;
    let endpoint = control_plane.endpoint.clone();
    let api = SandboxServiceClient::new(channel(&endpoint).await);
    let (node_a, dir_a) =
        control_plane.node("node-a", &runplane_testkit::free_local_addr().to_string());
    sandboxes::node_ready(&api, TOKEN, "node-a").await;
    let run = control_plane
        .create_script_run(
            "host-lost-request-000001",
            "echo \"attempt $RUNPLANE_ATTEMPT after ${RUNPLANE_PREVIOUS_ATTEMPT:-nothing}\"; \
             if [ \"$RUNPLANE_ATTEMPT\" = 1 ]; then exec sleep 600; fi",
        )
        .await;
    let first = control_plane
        .sandbox_when(&run.id, "attempt 1's sandbox on node-a", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    control_plane
        .run_when(&run.id, "attempt 1 to print", |r| r.last_sequence >= 1)
        .await;
    // A second node, free, before the first host goes.
    let (_node_b, _dir_b) =
        control_plane.node("node-b", &runplane_testkit::free_local_addr().to_string());
    sandboxes::node_ready(&api, TOKEN, "node-b").await;
    let shell: u32 = std::fs::read_to_string(dir_a.join(&first.id).join("pid"))
        .unwrap()
        .trim()
        .parse()
        .expect("a pid");
    let session = ReapSession(shell);
    drop(node_a);
    let _ = std::process::Command::new("pkill")
        .args(["-KILL", "-P", &shell.to_string()])
        .status();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &shell.to_string()])
        .status();
    // The agent attempt 1 leaves behind is the host's: a host gone takes it too.
    drop(session);

    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    let attempts: Vec<(u32, &str, &str)> = ended
        .attempts
        .iter()
        .map(|a| (a.number, a.node_id.as_str(), a.end_reason.as_str()))
        .collect();
    assert_eq!(
        attempts,
        [(1, "node-a", "sandbox_lost"), (2, "node-b", "exit_zero")],
        "{ended:?}"
    );
    assert_eq!(
        control_plane.stdout(&run.id).await,
        ["attempt 1 after nothing", "attempt 2 after sandbox_lost"]
    );
}
