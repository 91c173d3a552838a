//! Service tokens split by caller role, in the split topology (each service its own
//! `runplane serve`, on Postgres and Redis): every process holds only its own role's
//! token (`auth.service_tokens.<role>`) and the others' digests
//! (`auth.service_token_sha256.<role>`), no shared token. A run goes end to end through
//! all four, and a role's token on a method its role is not named on is refused
//! PERMISSION_DENIED with nothing written.

use std::path::Path;
use std::time::Duration;

use runplane_integration_tests::split::{SERVICES, Split, TOKEN};
use runplane_integration_tests::{channel, wait_for};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::node_credential_service_client::NodeCredentialServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

const PROFILES: &str = r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 8
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#;

/// Each role's own token, and its `[auth]` key.
fn token_of(service: &str) -> String {
    format!("{service}-own-role-token-0123456789abcdef")
}

fn key_of(service: &str) -> String {
    service.replace('-', "_").to_uppercase()
}

fn hex_sha256(token: &str) -> String {
    runplane_grpc::auth::sha256(token)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What `service`'s process is given: no shared token, its own role's token, the other
/// roles' digests.
fn own_tokens(service: &str) -> Vec<(String, String)> {
    let mut env = vec![("RUNPLANE_AUTH__SERVICE_TOKEN".to_owned(), String::new())];
    for other in SERVICES {
        if other == service {
            env.push((
                format!("RUNPLANE_AUTH__SERVICE_TOKENS__{}", key_of(other)),
                token_of(other),
            ));
        } else {
            env.push((
                format!("RUNPLANE_AUTH__SERVICE_TOKEN_SHA256__{}", key_of(other)),
                hex_sha256(&token_of(other)),
            ));
        }
    }
    env
}

async fn split(dir: &Path) -> Split {
    let config = dir.join("runplane.toml");
    std::fs::write(&config, PROFILES).unwrap();
    // The agent waits for the test's file, so it runs uncontained (a private /tmp would
    // hide it).
    Split::start_each(
        Some(&config),
        &dir.join("sandboxes"),
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
        own_tokens,
    )
    .await
}

async fn runs(split: &Split) -> RunServiceClient<tonic::transport::Channel> {
    RunServiceClient::new(channel(&split.url("run-store")).await)
}

async fn run_of(split: &Split, run_id: &str) -> runstore_pb::Run {
    runs(split)
        .await
        .get_run(authed(
            runstore_pb::GetRunRequest {
                run_id: run_id.into(),
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
}

fn assert_denied<T: std::fmt::Debug>(result: Result<T, tonic::Status>, what: &str) {
    let status = result.expect_err(what);
    assert_eq!(
        status.code(),
        tonic::Code::PermissionDenied,
        "{what}: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_holding_only_their_own_tokens_run_a_run_and_refuse_each_others_methods() {
    let dir = tempfile::tempdir().unwrap();
    let split = split(dir.path()).await;
    let go = dir.path().join("go");
    let run = runs(&split)
        .await
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "service-roles-run-0001".into(),
                org_id: "acme".into(),
                lead_id: "lead-1".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "sh".into(),
                args: vec![
                    "-c".into(),
                    format!(
                        "while [ ! -e {} ]; do sleep 0.1; done; echo finished",
                        go.display()
                    ),
                ],
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .expect("the run store, asking credential health with its own token, admits the run")
        .into_inner()
        .run
        .unwrap();
    // Dispatched by the reconciler with its own token (WaitForRuns, ClaimSlots,
    // IssueRunKey), its runner's stream leased through stream recovery (CheckRunKey).
    wait_for("the run runs", Duration::from_secs(60), async || {
        run_of(&split, &run.id).await.state() == runstore_pb::RunState::Running
    })
    .await;
    let before = run_of(&split, &run.id).await;

    // Each a method the token's role is not named on.
    let mut store = runs(&split).await;
    assert_denied(
        store
            .issue_run_key(authed(
                runstore_pb::IssueRunKeyRequest {
                    run_id: run.id.clone(),
                    sandbox_id: "sbx-stolen".into(),
                    sandbox_generation: 1_000,
                    idempotency_key: "stolen-token-issue-0001".into(),
                    ..Default::default()
                },
                &token_of("stream-recovery"),
            ))
            .await,
        "the stream recovery token mints no run key",
    );
    assert_denied(
        store
            .fail_run(authed(
                runstore_pb::FailRunRequest {
                    run_id: run.id.clone(),
                    reason: "backend_error".into(),
                    message: "stolen".into(),
                    idempotency_key: "stolen-token-fail-0001".into(),
                    ..Default::default()
                },
                &token_of("credential-health"),
            ))
            .await,
        "the credential health token fails no run",
    );
    assert_denied(
        store
            .check_run_key(authed(
                runstore_pb::CheckRunKeyRequest {
                    run_id: run.id.clone(),
                    ..Default::default()
                },
                &token_of("run-store"),
            ))
            .await,
        "the run store's own token checks no run key",
    );
    let mut credentials =
        NodeCredentialServiceClient::new(channel(&split.url("sandbox-reconciler")).await);
    assert_denied(
        credentials
            .create_node_credential(authed(
                reconciler_pb::CreateNodeCredentialRequest {
                    node_id: "node-stolen".into(),
                    max_capacity: 0,
                },
                &token_of("stream-recovery"),
            ))
            .await,
        "the stream recovery token mints no node credential",
    );

    // Nothing was written: no credential, the run untouched and its runner's key still
    // good (a key issued for generation 1000 would have superseded it).
    let listed = credentials
        .list_node_credentials(authed(
            reconciler_pb::ListNodeCredentialsRequest::default(),
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed,
        reconciler_pb::ListNodeCredentialsResponse::default()
    );
    let after = run_of(&split, &run.id).await;
    assert_eq!(after.state(), runstore_pb::RunState::Running);
    assert_eq!(after.failure_reason, before.failure_reason);
    assert_eq!(after.sandbox_generation, before.sandbox_generation);

    std::fs::write(&go, "").unwrap();
    wait_for("the run succeeds", Duration::from_secs(60), async || {
        run_of(&split, &run.id).await.state() == runstore_pb::RunState::Succeeded
    })
    .await;
}
