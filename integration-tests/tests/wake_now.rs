//! A wake is handed to its node at once, not at the reconciler's next round: with the
//! round at 60 s, a reattach to an idle-suspended sandbox is routable within seconds
//! (the reattach asks for a round, and the round signals the node's long poll).

use std::time::Duration;

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{self, ControlPlane, ReapSession, eventually};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const TOKEN: &str = "wake-now-operator-token-0123456789abcdefgh";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reattach_is_routable_long_before_the_next_round() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17201 = runplane_testkit::free_local_addr().to_string();
    let control_plane = ControlPlane::start(
        TOKEN,
        &[
            ("RUNPLANE_SANDBOX_RECONCILER__IDLE_TIMEOUT_SECONDS", "1"),
            ("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false"),
            // Far past the test: only the event-driven path can hand the wake over.
            ("RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS", "60000"),
        ],
    )
    .await;
    let endpoint = control_plane.endpoint.clone();
    let (_node, node_dir) = control_plane.node("node-a", node_endpoint_17201.as_str());
    let mut api = SandboxServiceClient::new(channel(&endpoint).await);
    let mut runs = RunServiceClient::new(channel(&endpoint).await);
    // The node is ready before any run exists, so dispatch on creation has somewhere to go.
    sandboxes::node_ready(&api, TOKEN, "node-a").await;
    let run = control_plane
        .create_script_run("wake-now-request-0001", "read go; echo done")
        .await;
    // Dispatched on creation (WaitForRuns), then suspended for idleness by the node.
    let (sandbox, pid) =
        sandboxes::idle_suspended(&api, TOKEN, &run.id, &node_dir, Duration::from_secs(30)).await;
    let _reap = ReapSession(pid);

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
    assert_eq!(
        runplane_grpc::error_info(&refused).unwrap().reason,
        "NOT_PLACED"
    );
    // Well under the 60 s round.
    let route = eventually(Duration::from_secs(10), "routable after the wake", || {
        let mut api = api.clone();
        let request = resolve();
        async move { api.resolve_route(request).await.ok() }
    })
    .await
    .into_inner();
    assert_eq!(route.node_id, "node-a");

    runs.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: run.id.clone(),
            reason: "test over".into(),
            idempotency_key: "wake-now-cancel-0001".into(),
        },
        TOKEN,
    ))
    .await
    .unwrap();
}
