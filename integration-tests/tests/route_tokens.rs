//! Route tokens are verified where they are presented: at the node agent's session
//! endpoint (`runplane.node.v1.SessionService`), by `runplane node` processes with state
//! directories of their own. A node accepts the token ResolveRoute signed for its own
//! sandbox, and refuses one for another sandbox, one signed for another node, a forged one
//! and every other credential.

use std::time::Duration;

use runplane_integration_tests::channel;
use runplane_integration_tests::sandboxes::{self, ControlPlane, eventually};
use runplane_proto::node::v1 as node_pb;
use runplane_proto::node::v1::session_service_client::SessionServiceClient;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;

const TOKEN: &str = "route-token-test-operator-token-0123456789";

/// The sandbox of `run_id` once it runs on a node.
async fn placed(
    api: &SandboxServiceClient<tonic::transport::Channel>,
    run_id: &str,
) -> reconciler_pb::Sandbox {
    sandboxes::sandbox_where(
        api,
        TOKEN,
        run_id,
        Duration::from_secs(30),
        "the sandbox placed",
        |s| s.status() == reconciler_pb::SandboxStatus::Started && !s.active_node_id.is_empty(),
    )
    .await
}

/// Attach at the node at `endpoint` to `sandbox_id` with `bearer`: the reason of a refusal.
async fn attach(
    endpoint: &str,
    bearer: &str,
    sandbox_id: &str,
) -> Result<node_pb::AttachResponse, String> {
    let mut node = SessionServiceClient::new(channel(&format!("http://{endpoint}")).await);
    node.attach(runplane_testkit::authed(
        node_pb::AttachRequest {
            sandbox_id: sandbox_id.to_owned(),
        },
        bearer,
    ))
    .await
    .map(tonic::Response::into_inner)
    .map_err(|s| {
        let reason = runplane_grpc::error_info(&s)
            .map(|i| i.reason)
            .unwrap_or_default();
        format!("{:?}/{reason}", s.code())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_accepts_only_the_route_token_signed_for_its_own_sandbox() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let (endpoint_a, endpoint_b) = (
        runplane_testkit::free_local_addr().to_string(),
        runplane_testkit::free_local_addr().to_string(),
    );
    let control_plane = ControlPlane::start(
        TOKEN,
        &[("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false")],
    )
    .await;
    let api = SandboxServiceClient::new(channel(&control_plane.endpoint).await);

    // One sandbox on each node: node-a alone first, then node-b, least used, takes the
    // second.
    let _a = control_plane.node("node-a", &endpoint_a);
    sandboxes::node_ready(&api, TOKEN, "node-a").await;
    let run_a = control_plane
        .create_script_run("route-token-run-a-0001", "sleep 120")
        .await;
    let on_a = placed(&api, &run_a.id).await;
    assert_eq!(on_a.active_node_id, "node-a");
    // node-a's heartbeat has counted its sandbox, so node-b is the less used.
    eventually(Duration::from_secs(30), "node-a counted as used", || {
        let mut api = api.clone();
        let request = runplane_testkit::authed(reconciler_pb::ListNodesRequest::default(), TOKEN);
        async move {
            let nodes = api.list_nodes(request).await.ok()?.into_inner().nodes;
            nodes
                .iter()
                .any(|n| n.id == "node-a" && n.used == 1)
                .then_some(())
        }
    })
    .await;
    let _b = control_plane.node("node-b", &endpoint_b);
    sandboxes::node_ready(&api, TOKEN, "node-b").await;
    let run_b = control_plane
        .create_script_run("route-token-run-b-0001", "sleep 120")
        .await;
    let on_b = placed(&api, &run_b.id).await;
    assert_eq!(on_b.active_node_id, "node-b");
    let _reap: Vec<_> = [&on_a, &on_b]
        .iter()
        .map(|s| {
            let dir = control_plane
                .state
                .path()
                .join(&s.active_node_id)
                .join(&s.id);
            let pid = std::fs::read_to_string(dir.join("pid"))
                .expect("a pid")
                .trim()
                .parse()
                .expect("a pid");
            sandboxes::ReapSession(pid)
        })
        .collect();

    let route = |sandbox: &reconciler_pb::Sandbox| {
        let mut api = api.clone();
        let request = runplane_testkit::authed(
            reconciler_pb::ResolveRouteRequest {
                sandbox_id: sandbox.id.clone(),
                session_id: "session-1".into(),
            },
            TOKEN,
        );
        async move {
            api.resolve_route(request)
                .await
                .expect("ResolveRoute")
                .into_inner()
        }
    };
    let route_a = route(&on_a).await;
    let route_b = route(&on_b).await;
    assert_eq!(
        (route_a.endpoint.as_str(), route_b.endpoint.as_str()),
        (endpoint_a.as_str(), endpoint_b.as_str())
    );

    // The node's own sandbox, with the token for it: attached.
    let attached = attach(&endpoint_a, &route_a.route_token, &on_a.id)
        .await
        .expect("node-a accepts the token ResolveRoute signed for its sandbox");
    assert_eq!(
        (
            attached.sandbox_id.as_str(),
            attached.execution_generation,
            attached.session_id.as_str()
        ),
        (on_a.id.as_str(), route_a.execution_generation, "session-1")
    );

    let refused = "Unauthenticated/ROUTE_TOKEN_INVALID".to_owned();
    // A token for node-a's sandbox, presented for another sandbox.
    assert_eq!(
        attach(&endpoint_a, &route_a.route_token, &on_b.id)
            .await
            .unwrap_err(),
        refused
    );
    // node-b's token, at node-a, for either sandbox.
    assert_eq!(
        attach(&endpoint_a, &route_b.route_token, &on_b.id)
            .await
            .unwrap_err(),
        refused
    );
    assert_eq!(
        attach(&endpoint_a, &route_b.route_token, &on_a.id)
            .await
            .unwrap_err(),
        refused
    );
    // node-a's token at node-b.
    assert_eq!(
        attach(&endpoint_b, &route_a.route_token, &on_a.id)
            .await
            .unwrap_err(),
        refused
    );
    // A forged one: node-a's signature on a payload naming node-b's sandbox.
    let (_, signature) = route_a.route_token.split_once('.').unwrap();
    let (payload_b, _) = route_b.route_token.split_once('.').unwrap();
    assert_eq!(
        attach(&endpoint_a, &format!("{payload_b}.{signature}"), &on_b.id)
            .await
            .unwrap_err(),
        refused
    );
    // The operator token is no route token.
    assert_eq!(
        attach(&endpoint_a, TOKEN, &on_a.id).await.unwrap_err(),
        refused
    );
    // No bearer at all: the authentication layer's answer.
    let mut bare = SessionServiceClient::new(channel(&format!("http://{endpoint_a}")).await);
    let none = bare
        .attach(node_pb::AttachRequest {
            sandbox_id: on_a.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(none.code(), tonic::Code::Unauthenticated);

    // node-b still takes its own.
    attach(&endpoint_b, &route_b.route_token, &on_b.id)
        .await
        .expect("node-b accepts its own token");
}
