//! `runplane serve` of one service against the real Postgres: only the named services
//! are hosted, the database is migrated, and configuration errors name the field.

use runplane_integration_tests::{channel, runplane_bin, start_serve};
use runplane_testkit::TestDatabase;
use sea_orm::{ConnectionTrait, Database, Statement};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const TOKEN: &str = "integration-test-operator-token-0123456789";
/// A fixed Ed25519 seed; tests only.
const RECEIPT_KEY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

#[tokio::test]
async fn serve_run_store_hosts_only_the_run_store_on_migrated_postgres() {
    let db = TestDatabase::new().await;
    let mut process = start_serve(
        &["run-store"],
        &[
            ("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0"),
            ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
            ("RUNPLANE_RUN_STORE__DATABASE_URL", db.url()),
            ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", RECEIPT_KEY),
        ],
    )
    .await;

    let mut health = HealthClient::new(channel(&process.endpoint()).await);
    for service in [
        "runplane.runstore.v1.RunService",
        "runplane.runstore.v1.RunnerService",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::Serving);
    }
    let err = health
        .check(HealthCheckRequest {
            service: "runplane.reconciler.v1.SandboxService".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    let conn = Database::connect(db.url()).await.unwrap();
    let migrated = conn
        .query_one_raw(Statement::from_string(
            conn.get_database_backend(),
            "SELECT to_regclass('public.seaql_migrations') IS NOT NULL AS present",
        ))
        .await
        .unwrap()
        .unwrap();
    assert!(migrated.try_get::<bool>("", "present").unwrap());
    conn.close().await.unwrap();

    assert!(process.terminate().await.success());
    let logs = process.stderr().await;
    assert!(!logs.contains(TOKEN), "the operator token leaked into logs");
    assert!(
        !logs.contains(RECEIPT_KEY),
        "the signing key leaked into logs"
    );
}

#[tokio::test]
async fn serve_without_an_operator_token_refuses_to_start() {
    let output = tokio::process::Command::new(runplane_bin())
        .args(["serve", "run-store"])
        .env_remove("RUNPLANE_AUTH__OPERATOR_TOKEN")
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("invalid config: auth.operator_token: required to serve"),
        "{stderr}"
    );
}

#[tokio::test]
async fn serve_without_a_service_token_or_with_the_operator_token_as_one_refuses_to_start() {
    for (service_token, expected) in [
        (
            None,
            "invalid config: auth.service_token: required to serve",
        ),
        (
            Some(TOKEN),
            "invalid config: auth.service_token: must differ from auth.operator_token",
        ),
    ] {
        let mut command = tokio::process::Command::new(runplane_bin());
        command
            .args(["serve", "run-store"])
            .env("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN)
            .env_remove("RUNPLANE_AUTH__SERVICE_TOKEN")
            .env_remove("RUNPLANE_CONFIG");
        if let Some(token) = service_token {
            command.env("RUNPLANE_AUTH__SERVICE_TOKEN", token);
        }
        let output = command.output().await.unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{stderr}");
        assert!(!stderr.contains(TOKEN), "a token in the error: {stderr}");
    }
}

#[tokio::test]
async fn a_bad_override_names_the_field_and_its_variable() {
    let output = tokio::process::Command::new(runplane_bin())
        .args(["serve", "all"])
        .env("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN)
        .env(
            "RUNPLANE_AUTH__SERVICE_TOKEN",
            runplane_integration_tests::SERVICE_TOKEN,
        )
        .env("RUNPLANE_SERVER__LISTEN", "not-an-address")
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("invalid config: server.listen: `not-an-address` is not a socket address"),
        "{stderr}"
    );
}

#[tokio::test]
async fn an_invalid_error_pattern_stops_credential_health_naming_the_profile() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        r#"
[[credential_health.profiles]]
name = "sonnet"
credentialId = "acct-1"
capacity = 2
errorPattern = "API Error: (unclosed"
exhaustedPattern = "credit balance is too low"
"#,
    )
    .unwrap();
    let output = tokio::process::Command::new(runplane_bin())
        .args(["serve", "credential-health", "--config"])
        .arg(&config)
        .env("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN)
        .env(
            "RUNPLANE_AUTH__SERVICE_TOKEN",
            runplane_integration_tests::SERVICE_TOKEN,
        )
        .env("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0")
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "profile `sonnet` (credential `acct-1`) has an invalid error_pattern `API Error: (unclosed`"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A reconciler with local sandboxes would run agents beside the process's secrets:
/// `runplane serve` refuses it, naming the setting and the way out, unless the risk is
/// accepted by name.
#[tokio::test]
async fn a_reconciler_with_local_sandboxes_beside_its_secrets_is_refused_unless_accepted() {
    let output = tokio::process::Command::new(runplane_bin())
        .args(["serve", "sandbox-reconciler"])
        .env("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN)
        .env(
            "RUNPLANE_AUTH__SERVICE_TOKEN",
            runplane_integration_tests::SERVICE_TOKEN,
        )
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES_BESIDE_SECRETS")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(
            "sandbox_reconciler.local_sandboxes: agents would run beside this process's secrets"
        ) && stderr.contains("local_sandboxes_beside_secrets"),
        "{stderr}"
    );
    assert!(!stderr.contains(TOKEN), "a token in the error: {stderr}");
}
