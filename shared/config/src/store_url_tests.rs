//! The stores' URLs at load: what sqlx and redis-rs cannot use is refused naming the
//! field, files a URL names must exist, and no password is ever repeated.

use super::*;

const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
const KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n";

/// A directory with `ca.pem`, `client.pem` and `client.key` (PEM-shaped), and
/// `notes.txt` (no PEM at all).
fn pem_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("ca.pem"), CA_PEM).unwrap();
    std::fs::write(dir.path().join("client.pem"), CA_PEM).unwrap();
    std::fs::write(dir.path().join("client.key"), KEY_PEM).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not a certificate\n").unwrap();
    dir
}

fn with_database_url(url: &str) -> Result<(), ConfigError> {
    let mut config = Config::default();
    config.sandbox_reconciler.database_url = url.to_owned();
    config.validate()
}

fn with_redis(url: &str, ca_file: &str) -> Result<(), ConfigError> {
    let mut config = Config::default();
    config.stream_recovery.redis_url = url.to_owned();
    config.stream_recovery.redis_ca_file = ca_file.to_owned();
    config.validate()
}

/// The error names `field`, says `what`, and holds no `secret`.
fn refused(result: Result<(), ConfigError>, field: &str, what: &str) {
    let message = result.expect_err("refused").to_string();
    assert!(
        message.starts_with(&format!("invalid config: {field}: ")),
        "{message}"
    );
    assert!(message.contains(what), "{message:?} does not say {what:?}");
    assert!(!message.contains("s3cret"), "{message}");
}

#[test]
fn postgres_urls_with_tls_settings_sqlx_can_use_load() {
    let dir = pem_dir();
    let ca = dir.path().join("ca.pem").display().to_string();
    let cert = dir.path().join("client.pem").display().to_string();
    let key = dir.path().join("client.key").display().to_string();
    for url in [
        "postgres://app:s3cret@db:5432/runs".to_owned(),
        "postgresql://app@db/runs?sslmode=require".to_owned(),
        "postgres://app@db/runs?sslmode=Verify-Full".to_owned(),
        "postgres://app@db/runs?sslmode=disable&application_name=runplane".to_owned(),
        format!("postgres://app@db/runs?sslmode=verify-full&sslrootcert={ca}"),
        format!("postgres://app@db/runs?sslmode=verify-ca&ssl-root-cert={ca}"),
        format!("postgres://app@db/runs?sslmode=require&sslcert={cert}&sslkey={key}"),
        "postgres://app@db/runs?options[statement_timeout]=5000".to_owned(),
        "sqlite://.runplane/x.db".to_owned(),
    ] {
        with_database_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

#[test]
fn postgres_urls_sqlx_cannot_use_are_refused_naming_the_field() {
    let dir = pem_dir();
    let field = "sandbox_reconciler.database_url";
    let missing = dir.path().join("missing.pem").display().to_string();
    let notes = dir.path().join("notes.txt").display().to_string();
    let ca = dir.path().join("ca.pem").display().to_string();
    let cert = dir.path().join("client.pem").display().to_string();
    for (url, what) in [
        (
            "mysql://app:s3cret@db/runs".to_owned(),
            "must start with postgres://",
        ),
        (
            "postgres://app:s3cret@db/runs?sslmode=strict".to_owned(),
            "sslmode `strict` is not one of disable, allow, prefer, require, verify-ca, verify-full",
        ),
        (
            format!("postgres://app:s3cret@db/runs?sslmode=verify-full&sslrootcert={missing}"),
            "missing.pem",
        ),
        (
            format!("postgres://app:s3cret@db/runs?sslmode=verify-full&sslrootcert={notes}"),
            "holds no PEM CERTIFICATE",
        ),
        // sqlx would not check the server against the CA with `require`.
        (
            format!("postgres://app:s3cret@db/runs?sslmode=require&sslrootcert={ca}"),
            "only used with sslmode=verify-full",
        ),
        (
            format!("postgres://app:s3cret@db/runs?sslrootcert={ca}"),
            "sslmode=prefer",
        ),
        (
            format!("postgres://app:s3cret@db/runs?sslmode=require&sslcert={cert}"),
            "sslcert and sslkey go together",
        ),
        (
            "postgres://app:s3cret@db/runs?connect_timeout=5".to_owned(),
            "`connect_timeout` is not one runplane's Postgres driver (sqlx) reads",
        ),
        // A mistyped password parameter is named by its key, never its value.
        (
            "postgres://app@db/runs?pasword=s3cret".to_owned(),
            "`pasword`",
        ),
    ] {
        refused(with_database_url(&url), field, what);
    }
}

#[test]
fn redis_urls_with_tls_and_passwords_load() {
    let dir = pem_dir();
    let ca = dir.path().join("ca.pem").display().to_string();
    for (url, ca_file) in [
        ("rediss://:s3cret@redis.internal:6380", ca.as_str()),
        ("rediss://runplane:s3cret@redis.internal:6380/2", ""),
        ("redis://:s3cret@127.0.0.1:6379", ""),
        ("rediss://redis.internal:6380?protocol=resp3", ca.as_str()),
        ("rediss+cluster://:s3cret@a:7000,b:7001", ca.as_str()),
        (
            "rediss://:s3cret@a:7000,rediss://:s3cret@b:7001",
            ca.as_str(),
        ),
        ("redis://[::1]:6379", ""),
    ] {
        with_redis(url, ca_file).unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}

#[test]
fn redis_urls_and_ca_files_redis_rs_cannot_use_are_refused_naming_the_field() {
    let dir = pem_dir();
    let ca = dir.path().join("ca.pem").display().to_string();
    let missing = dir.path().join("missing.pem").display().to_string();
    let notes = dir.path().join("notes.txt").display().to_string();
    let url_field = "stream_recovery.redis_url";
    let ca_field = "stream_recovery.redis_ca_file";
    for (url, ca_file, field, what) in [
        (
            "rediss://:s3cret@h:6380",
            missing.as_str(),
            ca_field,
            "missing.pem",
        ),
        (
            "rediss://:s3cret@h:6380",
            notes.as_str(),
            ca_field,
            "holds no PEM CERTIFICATE",
        ),
        (
            "redis://:s3cret@h:6379",
            ca.as_str(),
            ca_field,
            "not TLS: use rediss://",
        ),
        (
            "redis+cluster://:s3cret@a:1,b:2",
            ca.as_str(),
            ca_field,
            "not TLS",
        ),
        ("memory://", ca.as_str(), ca_field, "not TLS"),
        (
            "rediss://:s3cret@h:6380/#insecure",
            "",
            url_field,
            "#insecure",
        ),
        (
            "rediss://s3cret@h:6380",
            "",
            url_field,
            "credentials without a password",
        ),
        (
            "redis://:s3cret@h:port",
            "",
            url_field,
            "port that is not a number",
        ),
        (
            "redis://:s3cret@h:6379/zero",
            "",
            url_field,
            "not a database number",
        ),
        ("redis://:s3cret@:6379", "", url_field, "has no host"),
        (
            "redis://:s3cret@h:6379?timeout=1",
            "",
            url_field,
            "`timeout`",
        ),
        (
            "redis://:s3cret@a:1,rediss://:s3cret@b:2",
            "",
            url_field,
            "mixes redis:// and rediss://",
        ),
        (
            "redis://a:1,redis://b:2/x",
            "",
            url_field,
            "seed 2 has a path",
        ),
    ] {
        refused(with_redis(url, ca_file), field, what);
    }
}

#[test]
fn store_urls_are_printed_without_their_passwords() {
    for (url, shown) in [
        (
            "postgres://app:s3cret@db:5432/runs?sslmode=require",
            "postgres://app:***@db:5432/runs?sslmode=require",
        ),
        (
            "postgres://app@db/runs?sslmode=verify-full&password=s3cret",
            "postgres://app@db/runs?sslmode=verify-full&password=***",
        ),
        ("rediss://:s3cret@h:6380", "rediss://:***@h:6380"),
        (
            "rediss+cluster://u:s3cret@a:1,b:2",
            "rediss+cluster://u:***@a:1,b:2",
        ),
        ("redis://h:6379", "redis://h:6379"),
    ] {
        assert_eq!(redact_url(url), shown);
    }
}

#[test]
fn the_redis_password_is_not_in_the_configs_debug() {
    let mut config = Config::default();
    config.stream_recovery.redis_url = "rediss://:s3cret@h:6380".to_owned();
    let debug = format!("{config:?}");
    assert!(!debug.contains("s3cret"), "{debug}");
    assert!(debug.contains("rediss://:***@h:6380"), "{debug}");
}
