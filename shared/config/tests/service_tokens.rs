//! `[auth]`'s tokens split by caller role: each service's own token
//! (`service_tokens.<role>`) or its digest (`service_token_sha256.<role>`), beside the
//! shared `service_token`. Every refusal names its field and never the token.

use std::path::Path;

use runplane_config::{Config, ConfigError, ServiceRole};

const OPERATOR: &str = "operator-token-0123456789abcdef0123456789";
const SHARED: &str = "shared-service-token-0123456789abcdef01234";
const RUN_STORE: &str = "run-store-token-0123456789abcdef0123456789";
const RECONCILER: &str = "reconciler-token-0123456789abcdef012345678";

// `figment::Error` is large and Jail's closure signature is figment's, not ours.
#[allow(clippy::result_large_err)]
fn load_with(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let mut result = None;
    figment::Jail::expect_with(|jail| {
        jail.create_file("runplane.toml", toml)?;
        for (k, v) in env {
            jail.set_env(k, v);
        }
        result = Some(Config::load(Some(Path::new("runplane.toml"))));
        Ok(())
    });
    result.expect("jail ran")
}

fn refused(toml: &str, env: &[(&str, &str)]) -> String {
    let Err(error) = load_with(toml, env) else {
        panic!("loaded: {toml}");
    };
    let message = error.to_string();
    for secret in [OPERATOR, SHARED, RUN_STORE, RECONCILER, "hunter2"] {
        assert!(!message.contains(secret), "a token in the error: {message}");
    }
    message
}

fn hex_sha256(token: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn each_role_reads_its_own_token_and_digest_from_the_file_and_the_environment() {
    let digest = hex_sha256(RECONCILER);
    let config = load_with(
        &format!("[auth.service_tokens]\nrun_store = \"{RUN_STORE}\"\n"),
        &[
            ("RUNPLANE_AUTH__OPERATOR_TOKEN", OPERATOR),
            (
                "RUNPLANE_AUTH__SERVICE_TOKEN_SHA256__SANDBOX_RECONCILER",
                &digest,
            ),
            (
                "RUNPLANE_AUTH__SERVICE_TOKENS__STREAM_RECOVERY",
                "stream-recovery-token-0123456789abcdef012",
            ),
        ],
    )
    .expect("loads");
    let auth = &config.auth;
    assert_eq!(auth.service_tokens.run_store.expose(), RUN_STORE);
    assert_eq!(
        auth.service_tokens.stream_recovery.expose(),
        "stream-recovery-token-0123456789abcdef012"
    );
    assert_eq!(auth.service_token_sha256.sandbox_reconciler, digest);
    assert!(auth.service_tokens.credential_health.is_empty());
    let debug = format!("{config:?}");
    assert!(!debug.contains(RUN_STORE), "{debug}");
}

#[test]
fn a_role_calls_with_its_own_token_else_the_shared_one_and_needs_one_to_serve() {
    let own_only = load_with(
        &format!(
            "[auth]\noperator_token = \"{OPERATOR}\"\n[auth.service_tokens]\nrun_store = \"{RUN_STORE}\"\n"
        ),
        &[],
    )
    .unwrap();
    assert_eq!(
        own_only
            .require_calling_token(ServiceRole::RunStore)
            .unwrap()
            .expose(),
        RUN_STORE
    );
    let missing = own_only
        .require_calling_token(ServiceRole::StreamRecovery)
        .unwrap_err()
        .to_string();
    assert!(
        missing
            .starts_with("invalid config: auth.service_token: required to serve stream_recovery"),
        "{missing}"
    );
    assert!(
        missing.contains("auth.service_tokens.stream_recovery")
            && missing.contains("RUNPLANE_AUTH__SERVICE_TOKENS__STREAM_RECOVERY"),
        "{missing}"
    );

    let both = load_with(
        &format!(
            "[auth]\noperator_token = \"{OPERATOR}\"\nservice_token = \"{SHARED}\"\n[auth.service_tokens]\nrun_store = \"{RUN_STORE}\"\n"
        ),
        &[],
    )
    .unwrap();
    let calling = |role| both.auth.calling_token(role).expose().to_owned();
    assert_eq!(calling(ServiceRole::RunStore), RUN_STORE, "its own wins");
    assert_eq!(calling(ServiceRole::CredentialHealth), SHARED);
}

#[test]
fn a_short_role_token_or_bad_digest_is_refused_by_its_field() {
    let short = refused("[auth.service_tokens]\nrun_store = \"hunter2\"\n", &[]);
    assert!(
        short.starts_with("invalid config: auth.service_tokens.run_store: must be at least 32"),
        "{short}"
    );
    let bad = refused(
        "[auth.service_token_sha256]\ncredential_health = \"not-hex\"\n",
        &[],
    );
    assert!(
        bad.starts_with(
            "invalid config: auth.service_token_sha256.credential_health: must be 64 hex digits"
        ),
        "{bad}"
    );
    let unknown = refused("[auth.service_tokens]\nnode = \"x\"\n", &[]);
    assert!(unknown.contains("node"), "{unknown}");
    let not_a_string = refused("[auth.service_tokens]\nrun_store = 12345\n", &[]);
    assert!(
        not_a_string.contains("a secret: not shown"),
        "{not_a_string}"
    );
}

#[test]
fn a_role_given_as_token_and_digest_is_refused() {
    let both = refused(
        &format!(
            "[auth.service_tokens]\nsandbox_reconciler = \"{RECONCILER}\"\n[auth.service_token_sha256]\nsandbox_reconciler = \"{}\"\n",
            hex_sha256(RECONCILER)
        ),
        &[],
    );
    assert!(
        both.starts_with("invalid config: auth.service_token_sha256.sandbox_reconciler:")
            && both.contains("not both"),
        "{both}"
    );
}

#[test]
fn every_service_token_differs_from_the_others_the_shared_one_and_the_operators() {
    let twice = refused(
        &format!(
            "[auth.service_tokens]\nrun_store = \"{RUN_STORE}\"\nstream_recovery = \"{RUN_STORE}\"\n"
        ),
        &[],
    );
    assert!(
        twice.starts_with(
            "invalid config: auth.service_tokens.stream_recovery: must differ from auth.service_tokens.run_store"
        ),
        "{twice}"
    );
    let shared = refused(
        &format!(
            "[auth]\nservice_token = \"{SHARED}\"\n[auth.service_tokens]\ncredential_health = \"{SHARED}\"\n"
        ),
        &[],
    );
    assert!(
        shared.starts_with(
            "invalid config: auth.service_tokens.credential_health: must differ from auth.service_token"
        ),
        "{shared}"
    );
    let operator = refused(
        &format!(
            "[auth]\noperator_token = \"{OPERATOR}\"\n[auth.service_tokens]\nrun_store = \"{OPERATOR}\"\n"
        ),
        &[],
    );
    assert!(
        operator.starts_with(
            "invalid config: auth.service_tokens.run_store: must differ from auth.operator_token"
        ),
        "{operator}"
    );
    // A digest stands for its token: the same secret given once in full and once hashed
    // is the same secret twice.
    let hashed = refused(
        &format!(
            "[auth.service_tokens]\nrun_store = \"{RUN_STORE}\"\n[auth.service_token_sha256]\nsandbox_reconciler = \"{}\"\n",
            hex_sha256(RUN_STORE)
        ),
        &[],
    );
    assert!(
        hashed.starts_with(
            "invalid config: auth.service_token_sha256.sandbox_reconciler: must differ from auth.service_tokens.run_store"
        ),
        "{hashed}"
    );
    let operator_digest = refused(
        &format!(
            "[auth]\noperator_token_sha256 = \"{}\"\nservice_token = \"{OPERATOR}\"\n",
            hex_sha256(OPERATOR)
        ),
        &[],
    );
    assert!(
        operator_digest.starts_with(
            "invalid config: auth.service_token: must differ from auth.operator_token"
        ),
        "{operator_digest}"
    );
}
