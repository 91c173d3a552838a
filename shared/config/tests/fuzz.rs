//! Fuzzing the config loader: arbitrary TOML and environment variables give a config or
//! a [`ConfigError`] naming what is wrong, never a panic, and never echo a secret.
//!
//! proptest properties rather than cargo-fuzz targets: cargo-fuzz needs a nightly
//! toolchain and runplane builds on stable only. A failing case's seed is saved in
//! `fuzz.proptest-regressions` beside this file and replayed first on later runs.
//! `RUNPLANE_FUZZ_CASES=N` runs N cases instead of the default.

use figment::Figment;
use figment::providers::{Format, Toml};
use proptest::prelude::*;
use proptest::test_runner::{Config as Cases, FileFailurePersistence};
use runplane_config::{Config, ConfigError};

fn cases(default: u32) -> Cases {
    let cases = std::env::var("RUNPLANE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Cases {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Cases::default()
    }
}

/// Every section and a few of its fields, plus a name no section has.
const KEYS: &[(&str, &[&str])] = &[
    ("server", &["listen", "shutdown_grace_seconds"]),
    ("auth", &["operator_token", "service_token"]),
    ("telemetry", &["log_format"]),
    (
        "run_store",
        &[
            "database_url",
            "endpoint",
            "receipt_signing_key",
            "max_batch_events",
            "max_batch_bytes",
            "max_poll_wait_seconds",
            "admission",
            "max_run_duration_seconds",
            "deadline_sweep_interval_ms",
        ],
    ),
    (
        "sandbox_reconciler",
        &[
            "database_url",
            "endpoint",
            "loss_grace_seconds",
            "route_token_key",
            "route_token_ttl_seconds",
            "tick_interval_ms",
            "idle_timeout_seconds",
            "dispatch",
        ],
    ),
    ("stream_recovery", &["redis_url", "key_prefix", "endpoint"]),
    (
        "credential_health",
        &[
            "database_url",
            "outage_threshold",
            "outage_window_seconds",
            "cool_off_seconds",
            "quarantine_seconds",
            "notice_retention_hours",
        ],
    ),
    (
        "node",
        &["id", "endpoint", "listen", "capacity", "state_dir"],
    ),
    (
        "tls",
        &["cert_file", "key_file", "client_ca_file", "ca_file"],
    ),
    ("nonsense", &["no_such_field"]),
];

const SECRET: &str = "s3cr3t-never-echoed-0123456789abcdef";

/// The fields whose values are secrets: an error about them never shows the value.
const SECRET_FIELDS: &[&str] = &[
    "operator_token",
    "service_token",
    "receipt_signing_key",
    "route_token_key",
];

fn echoes_a_secret(error: &ConfigError, fields: &[(String, String, String)]) -> bool {
    let message = error.to_string();
    let secret = |field: &str| SECRET_FIELDS.contains(&field);
    // A value also given to a field that is no secret may be shown for that field.
    let shown_elsewhere = |v: &str| fields.iter().any(|(_, f, w)| !secret(f) && w == v);
    fields.iter().any(|(_, field, value)| {
        let bare = value.trim_matches('"');
        secret(field) && bare.len() >= 8 && !shown_elsewhere(value) && message.contains(bare)
    })
}

/// A TOML value of any type, with the edges of the numeric fields.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        prop_oneof![Just(0i64), Just(1), Just(-1), Just(u32::MAX as i64 + 1)]
            .prop_map(|n| n.to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:?}")),
        any::<String>().prop_map(|s| toml_string(&s)),
        Just(toml_string(SECRET)),
        "[a-z0-9.:/@_-]{0,40}".prop_map(|s| toml_string(&s)),
        Just("[]".to_owned()),
        Just("{ a = 1 }".to_owned()),
    ]
}

fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn assignment() -> impl Strategy<Value = (String, String, String)> {
    (0..KEYS.len(), any::<prop::sample::Index>(), toml_value()).prop_map(|(s, f, v)| {
        let (section, fields) = KEYS[s];
        (section.to_owned(), f.get(fields).to_string(), v)
    })
}

/// The error names the field it is about: a checked field by its path, a value serde
/// could not take by its key, an unknown field or section by its name.
fn names_a_field(error: &ConfigError, fields: &[(String, String, String)]) -> bool {
    match error {
        ConfigError::Invalid { field, .. } => !field.is_empty(),
        ConfigError::Parse(message) => {
            // Environment keys are reported upper case.
            let message = message.to_lowercase();
            fields.iter().any(|(section, field, _)| {
                message.contains(field.as_str()) || message.contains(section.as_str())
            })
        }
        ConfigError::MissingFile { .. } => false,
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn arbitrary_toml_text_is_a_config_or_an_error(text in any::<String>()) {
        if let Err(e) = Config::from_figment(Figment::new().merge(Toml::string(&text))) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn any_value_in_any_field_is_a_config_or_an_error_naming_a_field(
        fields in proptest::collection::vec(assignment(), 1..6),
    ) {
        let mut text = String::new();
        for (section, field, value) in &fields {
            text.push_str(&format!("[{section}]\n{field} = {value}\n"));
        }
        match Config::from_figment(Figment::new().merge(Toml::string(&text))) {
            Ok(config) => prop_assert!(config.validate().is_ok()),
            Err(e) => {
                // A table twice is a TOML syntax error, which names no field.
                let duplicate = {
                    let mut sections: Vec<_> = fields.iter().map(|f| &f.0).collect();
                    sections.sort();
                    sections.windows(2).any(|w| w[0] == w[1])
                };
                prop_assert!(duplicate || names_a_field(&e, &fields), "{e} for\n{text}");
                prop_assert!(!echoes_a_secret(&e, &fields), "{e}");
            }
        }
    }
}

/// One load under figment's jail with `var` set. `figment::Error` is large and the
/// closure's signature is figment's, not ours.
#[allow(clippy::result_large_err)]
fn load_with_env(var: &str, value: &str) -> Option<Result<Config, ConfigError>> {
    let mut outcome = None;
    figment::Jail::expect_with(|jail| {
        jail.set_env(var, value);
        outcome = Some(Config::load(None));
        Ok(())
    });
    outcome
}

proptest! {
    // Each case takes figment's process-wide jail (environment variables are global),
    // so fewer cases.
    #![proptest_config(cases(64))]

    #[test]
    fn any_environment_override_is_a_config_or_an_error_naming_a_field(
        (section, field, _) in assignment(),
        value in prop_oneof![any::<String>(), Just(SECRET.to_owned()), "[0-9-]{0,22}"],
    ) {
        let var = format!("RUNPLANE_{}__{}", section.to_uppercase(), field.to_uppercase());
        // Environment variables cannot hold NUL.
        let value = value.replace('\0', "");
        if let Some(Err(e)) = load_with_env(&var, &value) {
            let fields = [(section.clone(), field.clone(), value.clone())];
            prop_assert!(names_a_field(&e, &fields), "{e} for {var}={value:?}");
            prop_assert!(!echoes_a_secret(&e, &fields), "{e}");
        }
    }
}
