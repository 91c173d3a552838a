//! Revoking a node's credential fences the node: its next call is refused, its agent
//! stops, it gets no placement, and its sandboxes are lost at once, so the run on it ends
//! attempt 1 `sandbox_lost` and succeeds on another node. The loss grace is 10 minutes
//! here, longer than the test waits: only the fence can end the attempt. A new
//! credential for the same node id makes it a fresh node again.

use std::time::Duration;

use runplane_integration_tests::sandboxes::{
    ControlPlane, ReapSession, eventually, mint_node_credential, node_ready, session_members,
    start_node_with_credential,
};
use runplane_integration_tests::{channel, process_alive, runplane_bin};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_testkit::authed;

const TOKEN: &str = "node-fencing-operator-token-0123456789abcdef";

/// `runplane node token revoke NODE` as the operator; its stdout.
async fn revoke(control_plane: &ControlPlane, node: &str) -> String {
    let out = tokio::process::Command::new(runplane_bin())
        .args(["node", "token", "revoke", node, "--endpoint"])
        .arg(&control_plane.endpoint)
        .env("RUNPLANE_TOKEN", TOKEN)
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_NODE_TOKEN")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "runplane node token revoke {node}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Node `id`'s agent on `<state>/<id>` with `credential`.
fn node(control_plane: &ControlPlane, id: &str, credential: &str) -> tokio::process::Child {
    start_node_with_credential(
        id,
        &runplane_testkit::free_local_addr().to_string(),
        &control_plane.endpoint,
        &control_plane.endpoint,
        &control_plane.state.path().join(id),
        credential,
        &[],
    )
}

/// The nodes as ListNodes shows them: (id, state).
async fn node_states(
    api: &mut SandboxServiceClient<tonic::transport::Channel>,
) -> Vec<(String, reconciler_pb::NodeState)> {
    api.list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
        .await
        .unwrap()
        .into_inner()
        .nodes
        .iter()
        .map(|n| (n.id.clone(), n.state()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_nodes_credential_fences_it_and_its_run_goes_on_on_another_node() {
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS", "600"),
        ],
    )
    .await;
    let mut api = SandboxServiceClient::new(channel(&control_plane.endpoint).await);
    let credential_a = mint_node_credential(&control_plane.endpoint, TOKEN, "node-a");
    let mut node_a = node(&control_plane, "node-a", &credential_a);
    node_ready(&api, TOKEN, "node-a").await;

    // Attempt 1 runs on node-a, the only node, and waits there.
    let run = control_plane
        .create_script_run(
            "node-fencing-request-0001",
            "echo \"attempt $RUNPLANE_ATTEMPT after ${RUNPLANE_PREVIOUS_ATTEMPT:-nothing}\"; \
             if [ \"$RUNPLANE_ATTEMPT\" = 1 ]; then exec sleep 600; fi",
        )
        .await;
    let first = control_plane
        .sandbox_when(&run.id, "attempt 1's sandbox started", |s| {
            s.status() == reconciler_pb::SandboxStatus::Started
        })
        .await;
    assert_eq!(first.active_node_id, "node-a", "{first:?}");
    let shell: u32 = std::fs::read_to_string(
        control_plane
            .state
            .path()
            .join("node-a")
            .join(&first.id)
            .join("pid"),
    )
    .expect("node-a recorded the sandbox's pid")
    .trim()
    .parse()
    .expect("a pid");
    let _reap = ReapSession(shell);
    control_plane
        .run_when(&run.id, "attempt 1 to print", |r| r.last_sequence >= 1)
        .await;
    let credential_b = mint_node_credential(&control_plane.endpoint, TOKEN, "node-b");
    let _node_b = node(&control_plane, "node-b", &credential_b);
    node_ready(&api, TOKEN, "node-b").await;

    // node-a's agent is healthy and its credential works: only the revocation can
    // explain what follows.
    let epoch = api
        .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
        .await
        .unwrap()
        .into_inner()
        .nodes
        .iter()
        .find(|n| n.id == "node-a")
        .expect("node-a listed")
        .epoch;
    let heartbeat = || {
        authed(
            reconciler_pb::HeartbeatRequest {
                node_id: "node-a".into(),
                epoch,
                used: 1,
            },
            &credential_a,
        )
    };
    let mut nodes = NodeServiceClient::new(channel(&control_plane.endpoint).await);
    nodes
        .heartbeat(heartbeat())
        .await
        .expect("node-a's credential works before the revocation");
    assert_eq!(
        revoke(&control_plane, "node-a").await,
        "revoked 1 credential of node node-a\n\
         fenced node node-a: 1 sandbox lost, its attempt retried elsewhere\n"
    );

    // Its next call is refused, and its agent stops: no process of it is left.
    let refused = nodes.heartbeat(heartbeat()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let pid = node_a.id().expect("node-a's agent runs") as i32;
    let exit = tokio::time::timeout(Duration::from_secs(60), node_a.wait())
        .await
        .expect("node-a's agent stops once its credential is revoked")
        .unwrap();
    assert!(!exit.success(), "{exit:?}");
    assert!(!process_alive(pid), "node-a's agent ({pid}) is gone");

    // Attempt 1 ended `sandbox_lost` once, by the fence (the grace is 10 minutes), and
    // attempt 2 ran on node-b and succeeded.
    let ended = control_plane.ended(&run.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    let attempts: Vec<(u32, &str, &str, &str)> = ended
        .attempts
        .iter()
        .map(|a| {
            (
                a.number,
                a.node_id.as_str(),
                a.sandbox_id.as_str(),
                a.end_reason.as_str(),
            )
        })
        .collect();
    assert_eq!(attempts.len(), 2, "{ended:?}");
    assert_eq!(
        attempts[0],
        (1, "node-a", first.id.as_str(), "sandbox_lost"),
        "{ended:?}"
    );
    assert_eq!(
        ended.attempts[0].end_message,
        format!(
            "sandbox {} lost: its node node-a was fenced (its credentials were revoked)",
            first.id
        )
    );
    assert_eq!((attempts[1].0, attempts[1].1), (2, "node-b"), "{ended:?}");
    assert_eq!(attempts[1].3, "exit_zero", "{ended:?}");
    let attempt_ends = control_plane
        .events(&run.id)
        .await
        .iter()
        .filter(|e| e.kind() == runstore_pb::EventKind::AttemptEnded)
        .count();
    assert_eq!(attempt_ends, 1, "attempt 1 ended once");
    assert_eq!(
        control_plane.stdout(&run.id).await,
        ["attempt 1 after nothing", "attempt 2 after sandbox_lost"]
    );
    // Attempt 1's runner, its keys revoked with its attempt, stops its agent and exits:
    // nothing of the fenced sandbox keeps running.
    eventually(
        Duration::from_secs(60),
        "attempt 1's sandbox on node-a to stop",
        || async { session_members(shell).is_empty().then_some(()) },
    )
    .await;

    // node-a is fenced: shown so, and no run is placed on it.
    let states = node_states(&mut api).await;
    assert!(
        states.contains(&("node-a".to_owned(), reconciler_pb::NodeState::Fenced)),
        "{states:?}"
    );
    let live_on_a = api
        .list_sandboxes(authed(
            reconciler_pb::ListSandboxesRequest::default(),
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .into_iter()
        .filter(|s| s.active_node_id == "node-a" && s.id != first.id)
        .collect::<Vec<_>>();
    assert!(live_on_a.is_empty(), "nothing new on node-a: {live_on_a:?}");

    // The revoked credential stays refused and lifts nothing; a new one for node-a makes
    // it a fresh node, which takes runs again (node-b, fenced now, takes none).
    let again = nodes
        .register_node(authed(register("node-a"), &credential_a))
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::Unauthenticated, "{again:?}");
    let states = node_states(&mut api).await;
    assert!(
        states.contains(&("node-a".to_owned(), reconciler_pb::NodeState::Fenced)),
        "still fenced: {states:?}"
    );
    let renewed = mint_node_credential(&control_plane.endpoint, TOKEN, "node-a");
    let _node_a = node(&control_plane, "node-a", &renewed);
    node_ready(&api, TOKEN, "node-a").await;
    // Attempt 2's sandbox is gone from node-b first, so fencing node-b loses nothing.
    control_plane
        .sandbox_when(&run.id, "attempt 2's sandbox deleted", |s| {
            s.id != first.id && s.status() == reconciler_pb::SandboxStatus::Deleted
        })
        .await;
    assert_eq!(
        revoke(&control_plane, "node-b").await,
        "revoked 1 credential of node node-b\n\
         fenced node node-b: it held no live sandbox\n"
    );
    let second = control_plane
        .create_script_run("node-fencing-request-0002", "echo back on node-a")
        .await;
    let ended = control_plane.ended(&second.id).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Succeeded, "{ended:?}");
    assert_eq!(ended.attempts.len(), 1, "{ended:?}");
    assert_eq!(ended.attempts[0].node_id, "node-a", "{ended:?}");
}

/// RegisterNode for `node`, on a boot and endpoint that are never dialled.
fn register(node: &str) -> reconciler_pb::RegisterNodeRequest {
    reconciler_pb::RegisterNodeRequest {
        node_id: node.into(),
        boot_id: format!("{node}-fencing-test-boot-id"),
        endpoint: "127.0.0.1:1".into(),
        capacity: 1,
        labels: Default::default(),
        agent_version: "test".into(),
    }
}
