//! Node credentials in the split topology (each service its own `runplane serve`, on
//! Postgres and Redis): a credential made with `runplane node token create` acts for its
//! node only (NodeService refuses it for any other node id), every other service refuses
//! it, a revoked one is refused, and a node agent holding only its own credential runs a
//! sandbox end to end (and stops once it is revoked). `runplane dev` keeps them the same
//! way on SQLite.

use std::time::Duration;

use runplane_integration_tests::sandboxes::{eventually, start_node_with_credential};
use runplane_integration_tests::split::{Split, TOKEN};
use runplane_integration_tests::{channel, runplane_bin};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_credential_service_client::NodeCredentialServiceClient;
use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_testkit::authed;

const PROFILES: &str = r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#;

async fn split(dir: &tempfile::TempDir) -> Split {
    let config = dir.path().join("runplane.toml");
    std::fs::write(&config, PROFILES).unwrap();
    Split::start(
        Some(&config),
        &dir.path().join("sandboxes"),
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    )
    .await
}

/// `runplane node token ARGS` against the split's reconciler, as an operator; stdout.
async fn cli(split: &Split, args: &[&str]) -> String {
    let out = token_command(&split.url("sandbox-reconciler"), TOKEN, args).await;
    assert!(
        out.status.success(),
        "runplane node token {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `runplane node token ARGS` against `endpoint` with `token` as RUNPLANE_TOKEN.
async fn token_command(endpoint: &str, token: &str, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(runplane_bin())
        .args(["node", "token"])
        .args(args)
        .args(["--endpoint", endpoint])
        .env("RUNPLANE_TOKEN", token)
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_NODE_TOKEN")
        .output()
        .await
        .unwrap()
}

/// The same rules on `runplane dev`'s SQLite, and a bad node id refused with nothing
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runplane_dev_keeps_node_credentials_on_sqlite_and_refuses_a_bad_node_id() {
    let dir = tempfile::tempdir().unwrap();
    let dev = runplane_integration_tests::start_dev_with_env(
        &dir.path().join(".runplane"),
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    )
    .await;
    let endpoint = dev.endpoint();
    let operator = std::fs::read_to_string(dir.path().join(".runplane/operator-token"))
        .unwrap()
        .trim()
        .to_owned();

    let bad = token_command(&endpoint, &operator, &["create", "bad id!"]).await;
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("INVALID_ARGUMENT") && stderr.contains("(INVALID_FIELD)"),
        "{stderr}"
    );
    let listed = token_command(&endpoint, &operator, &["list"]).await;
    assert_eq!(
        String::from_utf8(listed.stdout).unwrap().lines().count(),
        1,
        "only the header: nothing was written"
    );

    let created = token_command(&endpoint, &operator, &["create", "node-a"]).await;
    assert!(created.status.success());
    let own = String::from_utf8(created.stdout).unwrap().trim().to_owned();
    let mut nodes = NodeServiceClient::new(channel(&endpoint).await);
    nodes
        .register_node(authed(register("node-a"), &own))
        .await
        .expect("node-a registers with its credential");
    assert_eq!(
        refusal(nodes.register_node(authed(register("node-b"), &own)).await),
        (
            tonic::Code::PermissionDenied,
            "NODE_CREDENTIAL_WRONG_NODE".to_owned()
        )
    );
    // Nothing but a node's own credential acts as a node: not the operator token either.
    assert_eq!(
        refusal(
            nodes
                .register_node(authed(register("node-b"), &operator))
                .await
        ),
        (
            tonic::Code::PermissionDenied,
            "PERMISSION_DENIED".to_owned()
        )
    );
    let revoked = token_command(&endpoint, &operator, &["revoke", "node-a"]).await;
    assert!(revoked.status.success());
    assert_eq!(
        refusal(nodes.register_node(authed(register("node-a"), &own)).await),
        (tonic::Code::Unauthenticated, "UNAUTHENTICATED".to_owned())
    );
}

/// A credential made with `--max-capacity` bounds the capacity its node may register
/// with: above it is INVALID_ARGUMENT naming capacity, and nothing is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_credential_bounds_the_capacity_its_node_may_claim() {
    let dir = tempfile::tempdir().unwrap();
    let dev = runplane_integration_tests::start_dev_with_env(
        &dir.path().join(".runplane"),
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    )
    .await;
    let endpoint = dev.endpoint();
    let operator = std::fs::read_to_string(dir.path().join(".runplane/operator-token"))
        .unwrap()
        .trim()
        .to_owned();
    let created = token_command(
        &endpoint,
        &operator,
        &["create", "node-c", "--max-capacity", "4"],
    )
    .await;
    assert!(created.status.success(), "{created:?}");
    let own = String::from_utf8(created.stdout).unwrap().trim().to_owned();
    let listed =
        String::from_utf8(token_command(&endpoint, &operator, &["list"]).await.stdout).unwrap();
    assert!(
        listed.lines().next().unwrap().contains("MAX CAPACITY"),
        "{listed}"
    );
    let row: Vec<&str> = listed.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!((row[1], row[3]), ("node-c", "4"), "{listed}");

    let mut nodes = NodeServiceClient::new(channel(&endpoint).await);
    let claim = |capacity: u32| reconciler_pb::RegisterNodeRequest {
        capacity,
        ..register("node-c")
    };
    let status = nodes
        .register_node(authed(claim(5), &own))
        .await
        .expect_err("above the ceiling");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let info = runplane_grpc::error_info(&status).unwrap();
    assert_eq!(info.metadata["field"], "capacity", "{status:?}");
    assert!(status.message().contains("at most 4"), "{status:?}");
    let mut sandboxes = SandboxServiceClient::new(channel(&endpoint).await);
    let listed = sandboxes
        .list_nodes(authed(
            reconciler_pb::ListNodesRequest::default(),
            &operator,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(listed.nodes.is_empty(), "nothing registered: {listed:?}");
    let node = nodes
        .register_node(authed(claim(4), &own))
        .await
        .expect("at the ceiling")
        .into_inner()
        .node
        .unwrap();
    assert_eq!(node.capacity, 4);

    let bad = token_command(
        &endpoint,
        &operator,
        &["create", "node-d", "--max-capacity", "10001"],
    )
    .await;
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("max_capacity"),
        "{bad:?}"
    );
}

/// The gRPC code and ErrorInfo reason of a refusal.
fn refusal<T: std::fmt::Debug>(answer: Result<T, tonic::Status>) -> (tonic::Code, String) {
    let status = answer.expect_err("refused");
    let reason = runplane_grpc::error_info(&status)
        .map(|i| i.reason)
        .unwrap_or_default();
    (status.code(), reason)
}

const BOOT: &str = "boot-0123456789abcdef";

/// RegisterNode for `node`, on a boot and endpoint that are never dialled.
fn register(node: &str) -> reconciler_pb::RegisterNodeRequest {
    reconciler_pb::RegisterNodeRequest {
        node_id: node.into(),
        boot_id: BOOT.into(),
        endpoint: "127.0.0.1:1".into(),
        capacity: 1,
        ..Default::default()
    }
}
const SANDBOX: &str = "5a3f3c56-9a4b-4c57-8d2a-0f6b7b6a5c11";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_credential_acts_only_for_its_node_and_is_refused_everywhere_else() {
    let dir = tempfile::tempdir().unwrap();
    let split = split(&dir).await;
    let reconciler = split.url("sandbox-reconciler");
    let own = cli(&split, &["create", "node-a"]).await.trim().to_owned();
    assert!(own.starts_with("rpnode_"), "one line, the secret: {own:?}");

    let mut nodes = NodeServiceClient::new(channel(&reconciler).await);
    // Its own node: accepted.
    let epoch = nodes
        .register_node(authed(register("node-a"), &own))
        .await
        .expect("node-a registers with node-a's credential")
        .into_inner()
        .epoch;
    nodes
        .heartbeat(authed(
            reconciler_pb::HeartbeatRequest {
                node_id: "node-a".into(),
                epoch,
                used: 0,
            },
            &own,
        ))
        .await
        .expect("node-a heartbeats");

    // Any other node: PERMISSION_DENIED on every NodeService method.
    let wrong = (
        tonic::Code::PermissionDenied,
        "NODE_CREDENTIAL_WRONG_NODE".to_owned(),
    );
    let b = || "node-b".to_owned();
    assert_eq!(
        refusal(nodes.register_node(authed(register("node-b"), &own)).await),
        wrong,
        "RegisterNode as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .heartbeat(authed(
                    reconciler_pb::HeartbeatRequest {
                        node_id: b(),
                        epoch: 1,
                        used: 0
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "Heartbeat as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .list_assigned_sandboxes(authed(
                    reconciler_pb::ListAssignedSandboxesRequest {
                        node_id: b(),
                        epoch: 1,
                        ..Default::default()
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "ListAssignedSandboxes as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .claim_launch(authed(
                    reconciler_pb::ClaimLaunchRequest {
                        node_id: b(),
                        epoch: 1,
                        sandbox_id: SANDBOX.into(),
                        execution_generation: 1,
                        idempotency_key: format!("{SANDBOX}:1"),
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "ClaimLaunch as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .publish_sandbox_state(authed(
                    reconciler_pb::PublishSandboxStateRequest {
                        node_id: b(),
                        epoch: 1,
                        sandbox_id: SANDBOX.into(),
                        execution_generation: 1,
                        observation_seq: 1,
                        status: reconciler_pb::SandboxStatus::Lost as i32,
                        ..Default::default()
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "PublishSandboxState as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .report_restored(authed(
                    reconciler_pb::ReportRestoredRequest {
                        node_id: b(),
                        epoch: 1,
                        wake_id: SANDBOX.into(),
                        sandbox_id: SANDBOX.into(),
                        ..Default::default()
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "ReportRestored as node-b"
    );
    assert_eq!(
        refusal(
            nodes
                .report_wake_failed(authed(
                    reconciler_pb::ReportWakeFailedRequest {
                        node_id: b(),
                        epoch: 1,
                        wake_id: SANDBOX.into(),
                        ..Default::default()
                    },
                    &own
                ))
                .await
        ),
        wrong,
        "ReportWakeFailed as node-b"
    );
    // Nothing was written for node-b.
    let registered: Vec<String> = SandboxServiceClient::new(channel(&reconciler).await)
        .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
        .await
        .unwrap()
        .into_inner()
        .nodes
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(registered, ["node-a"]);

    // Every other service: UNAUTHENTICATED (it is not their token).
    let unauthenticated = (tonic::Code::Unauthenticated, "UNAUTHENTICATED".to_owned());
    let mut sandboxes = SandboxServiceClient::new(channel(&reconciler).await);
    assert_eq!(
        refusal(
            sandboxes
                .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), &own))
                .await
        ),
        unauthenticated,
        "SandboxService.ListNodes"
    );
    assert_eq!(
        refusal(
            sandboxes
                .list_sandboxes(authed(reconciler_pb::ListSandboxesRequest::default(), &own))
                .await
        ),
        unauthenticated,
        "SandboxService.ListSandboxes"
    );
    assert_eq!(
        refusal(
            sandboxes
                .destroy_sandbox(authed(
                    reconciler_pb::DestroySandboxRequest {
                        sandbox_id: SANDBOX.into(),
                        reason: "x".into()
                    },
                    &own
                ))
                .await
        ),
        unauthenticated,
        "SandboxService.DestroySandbox"
    );
    let mut credentials = NodeCredentialServiceClient::new(channel(&reconciler).await);
    assert_eq!(
        refusal(
            credentials
                .create_node_credential(authed(
                    reconciler_pb::CreateNodeCredentialRequest {
                        node_id: "node-b".into(),
                        max_capacity: 0,
                    },
                    &own
                ))
                .await
        ),
        unauthenticated,
        "a node cannot mint credentials"
    );
    assert_eq!(
        refusal(
            credentials
                .revoke_node_credentials(authed(
                    reconciler_pb::RevokeNodeCredentialsRequest {
                        node_id: "node-a".into()
                    },
                    &own
                ))
                .await
        ),
        unauthenticated,
        "NodeCredentialService.RevokeNodeCredentials"
    );
    let mut runs = RunServiceClient::new(channel(&split.url("run-store")).await);
    assert_eq!(
        refusal(
            runs.list_runs(authed(runstore_pb::ListRunsRequest::default(), &own))
                .await
        ),
        unauthenticated,
        "RunService.ListRuns"
    );
    let refused = refusal(
        runs.issue_run_key(authed(
            runstore_pb::IssueRunKeyRequest {
                run_id: SANDBOX.into(),
                sandbox_id: SANDBOX.into(),
                sandbox_generation: 1,
                idempotency_key: format!("{SANDBOX}:1"),
                ..Default::default()
            },
            &own,
        ))
        .await,
    );
    assert_eq!(refused, unauthenticated, "RunService.IssueRunKey");
    let refused = refusal(
        RunnerServiceClient::new(channel(&split.url("run-store")).await)
            .hello(authed(
                runstore_pb::HelloRequest {
                    run_id: SANDBOX.into(),
                    ..Default::default()
                },
                &own,
            ))
            .await,
    );
    assert_eq!(
        refused.0,
        tonic::Code::Unauthenticated,
        "RunnerService.Hello"
    );
    let mut recovery =
        StreamRecoveryServiceClient::new(channel(&split.url("stream-recovery")).await);
    assert_eq!(
        refusal(
            recovery
                .park_stream(authed(
                    recovery_pb::ParkStreamRequest {
                        run_id: SANDBOX.into(),
                        sandbox_id: SANDBOX.into()
                    },
                    &own
                ))
                .await
        ),
        unauthenticated,
        "StreamRecoveryService.ParkStream"
    );
    assert_eq!(
        refusal(
            recovery
                .sweep_orphans(authed(recovery_pb::SweepOrphansRequest::default(), &own))
                .await
        ),
        unauthenticated,
        "StreamRecoveryService.SweepOrphans"
    );
    assert_eq!(
        refusal(
            CredentialHealthServiceClient::new(channel(&split.url("credential-health")).await)
                .get_fleet(authed(credentials_pb::GetFleetRequest::default(), &own))
                .await
        ),
        unauthenticated,
        "CredentialHealthService.GetFleet"
    );

    // Listed without its secret; revoked, it is refused even for its own node.
    let listed = cli(&split, &["list"]).await;
    assert!(listed.contains("node-a"), "{listed}");
    assert!(!listed.contains(&own), "no secret in the listing");
    assert_eq!(
        cli(&split, &["revoke", "node-a"]).await,
        "revoked 1 credential of node node-a\n\
         fenced node node-a: it held no live sandbox\n"
    );
    assert_eq!(
        refusal(
            nodes
                .heartbeat(authed(
                    reconciler_pb::HeartbeatRequest {
                        node_id: "node-a".into(),
                        epoch,
                        used: 0
                    },
                    &own
                ))
                .await
        ),
        unauthenticated,
        "a revoked credential"
    );
    assert_eq!(
        refusal(nodes.register_node(authed(register("node-a"), &own)).await),
        unauthenticated,
        "a revoked credential cannot re-register its node"
    );
    let listed = cli(&split, &["list", "node-a"]).await;
    let row = listed.lines().nth(1).expect("one credential row");
    assert!(!row.trim_end().ends_with('-'), "shown revoked: {row}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_with_only_its_own_credential_runs_a_sandbox_to_the_end() {
    // Each node listens on its advertised endpoint: a free port, not a shared one.
    let node_endpoint_17011 = runplane_testkit::free_local_addr().to_string();
    let dir = tempfile::tempdir().unwrap();
    let split = split(&dir).await;
    let reconciler = split.url("sandbox-reconciler");
    let own = cli(&split, &["create", "node-own"]).await.trim().to_owned();
    let mut node = start_node_with_credential(
        "node-own",
        node_endpoint_17011.as_str(),
        &reconciler,
        &split.url("stream-recovery"),
        &dir.path().join("node"),
        &own,
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    );
    let api = SandboxServiceClient::new(channel(&reconciler).await);
    eventually(Duration::from_secs(30), "node-own registered", || {
        let mut api = api.clone();
        async move {
            let nodes = api
                .list_nodes(authed(reconciler_pb::ListNodesRequest::default(), TOKEN))
                .await
                .ok()?
                .into_inner()
                .nodes;
            nodes.iter().any(|n| n.id == "node-own").then_some(())
        }
    })
    .await;

    let go = dir.path().join("go");
    let mut runs = RunServiceClient::new(channel(&split.url("run-store")).await);
    let run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "node-credential-e2e-0001".into(),
                org_id: "acme".into(),
                lead_id: "lead-1".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "sh".into(),
                // Runs until the test has seen where it runs; fails if the node's
                // credential reached it.
                args: vec![
                    "-c".into(),
                    format!(
                        "while [ ! -e {go} ]; do sleep 0.1; done; \
                         [ -z \"${{RUNPLANE_NODE_TOKEN:-}}\" ] || exit 3; echo hello from node-own",
                        go = go.display()
                    ),
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
    let placed = eventually(Duration::from_secs(60), "the sandbox started", || {
        let mut api = api.clone();
        let run_id = run.id.clone();
        async move {
            api.list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    run_id,
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .ok()?
            .into_inner()
            .sandboxes
            .into_iter()
            .find(|s| s.status() == reconciler_pb::SandboxStatus::Started)
        }
    })
    .await;
    assert_eq!(
        placed.active_node_id, "node-own",
        "run by the node agent, not the reconciler's local driver: {placed:?}"
    );
    std::fs::write(&go, "").unwrap();
    let ended = eventually(Duration::from_secs(60), "the run to end", || {
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

    // Revoked, the agent is refused and stops rather than spinning on refusals.
    cli(&split, &["revoke", "node-own"]).await;
    let exit = tokio::time::timeout(Duration::from_secs(30), node.wait())
        .await
        .expect("the agent stops once its credential is revoked")
        .unwrap();
    assert!(!exit.success(), "{exit:?}");
}
