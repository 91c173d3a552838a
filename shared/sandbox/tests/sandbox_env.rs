//! What a sandbox inherits from its launcher: nothing that is a credential of the
//! launcher (its TLS client key, its collector's headers) unless the operator opts in.

use runplane_sandbox::process::sandbox_env_from;

fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const LAUNCHER: &[(&str, &str)] = &[
    ("PATH", "/usr/bin:/bin"),
    ("LC_ALL", "C.UTF-8"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/otel/ca.pem"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=collector-secret"),
    (
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "x-api-key=traces-secret",
    ),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/otel/launcher.key"),
    (
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
        "/etc/otel/launcher.pem",
    ),
    ("OTEL_SERVICE_NAME", "runplane"),
    (
        "RUNPLANE_AUTH__OPERATOR_TOKEN",
        "operator-token-0123456789abcdef0123",
    ),
    ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", "00ff"),
];

const TLS: &[(&str, &str)] = &[
    ("RUNPLANE_TLS__CA_FILE", "/etc/runplane/ca.pem"),
    ("RUNPLANE_TLS__CERT_FILE", "/etc/runplane/launcher.pem"),
    ("RUNPLANE_TLS__KEY_FILE", "/etc/runplane/launcher.key"),
];

fn names(env: &[(String, String)]) -> Vec<&str> {
    let mut names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    names.sort();
    names
}

#[test]
fn a_sandbox_inherits_no_credential_of_its_launcher_by_default() {
    let env = sandbox_env_from(vars(LAUNCHER), vars(TLS));
    assert_eq!(
        names(&env),
        [
            "LC_ALL",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "PATH",
            "RUNPLANE_TLS__CA_FILE",
        ]
    );
    let all: String = env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    for secret in ["secret", ".key", "launcher", "operator-token"] {
        assert!(!all.contains(secret), "{secret} in\n{all}");
    }
}

#[test]
fn the_operator_opts_in_to_each_credential_by_name() {
    let mut launcher = vars(LAUNCHER);
    launcher.extend(vars(&[("RUNPLANE_SANDBOX_INHERIT", "tls_client_identity")]));
    let inherited = sandbox_env_from(launcher.clone(), vars(TLS));
    let env = names(&inherited);
    for name in [
        "RUNPLANE_TLS__CERT_FILE",
        "RUNPLANE_TLS__KEY_FILE",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
    ] {
        assert!(env.contains(&name), "{name} opted in: {env:?}");
    }
    assert!(!env.contains(&"OTEL_EXPORTER_OTLP_HEADERS"), "{env:?}");

    launcher.extend(vars(&[(
        "RUNPLANE_SANDBOX_INHERIT",
        "otlp_headers, tls_client_identity",
    )]));
    let inherited = sandbox_env_from(launcher, vars(TLS));
    let env = names(&inherited);
    assert!(env.contains(&"OTEL_EXPORTER_OTLP_HEADERS"), "{env:?}");
    assert!(
        env.contains(&"OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
        "{env:?}"
    );
    // Opting in never lets the control plane's own settings through.
    assert!(!env.contains(&"RUNPLANE_AUTH__OPERATOR_TOKEN"), "{env:?}");
    assert!(!env.contains(&"RUNPLANE_SANDBOX_INHERIT"), "{env:?}");
}
