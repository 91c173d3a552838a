//! What of the launcher's environment a sandbox inherits.

/// Names the launcher's operator lists in `RUNPLANE_SANDBOX_INHERIT` (comma-separated)
/// to let sandboxes inherit a credential they otherwise do not get.
pub const ENV_SANDBOX_INHERIT: &str = "RUNPLANE_SANDBOX_INHERIT";

/// The part of this process's environment a sandbox inherits: the platform basics
/// (PATH, HOME, locale, time zone, temp dir), log and OpenTelemetry exporter settings
/// (but not `OTEL_SERVICE_NAME`: the runner names itself), and the CA its runner trusts
/// servers by. Everything else, runplane's own configuration included, stays out; the
/// launch adds what the runner needs. See [`sandbox_env_from`] for the credentials.
pub fn sandbox_env() -> Vec<(String, String)> {
    let tls = runplane_grpc::tls::child_env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v));
    sandbox_env_from(std::env::vars(), tls)
}

/// [`sandbox_env`] of `vars` (a launcher's environment) and `tls` (its TLS client side,
/// as `runplane_grpc::tls::child_env` gives it to a child). The agent is untrusted and
/// shares what its runner inherits, so credentials of the launcher stay out unless the
/// operator opts in by listing them in `RUNPLANE_SANDBOX_INHERIT`:
/// - `tls_client_identity`: the launcher's TLS client certificate and key
///   (`RUNPLANE_TLS__CERT_FILE`/`KEY_FILE`, which a runner needs only where servers
///   require mutual TLS, and `OTEL_EXPORTER_OTLP_*CLIENT_KEY`/`CLIENT_CERTIFICATE`);
/// - `otlp_headers`: `OTEL_EXPORTER_OTLP_HEADERS` and its per-signal forms, which
///   usually carry a collector's API key.
pub fn sandbox_env_from(
    vars: impl IntoIterator<Item = (String, String)>,
    tls: impl IntoIterator<Item = (String, String)>,
) -> Vec<(String, String)> {
    const KEEP: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "RUST_LOG",
        "RUST_BACKTRACE",
    ];
    let vars: Vec<(String, String)> = vars.into_iter().collect();
    let opted_in = |what: &str| {
        vars.iter()
            .filter(|(k, _)| k == ENV_SANDBOX_INHERIT)
            .any(|(_, v)| v.split(',').any(|item| item.trim() == what))
    };
    let (identity, headers) = (opted_in("tls_client_identity"), opted_in("otlp_headers"));
    let otel = |k: &str| {
        let client_identity = k.ends_with("_CLIENT_KEY") || k.ends_with("_CLIENT_CERTIFICATE");
        k.starts_with("OTEL_")
            && k != "OTEL_SERVICE_NAME"
            && (identity || !client_identity)
            && (headers || !k.ends_with("_HEADERS"))
    };
    let mut env: Vec<(String, String)> = vars
        .iter()
        .filter(|(k, _)| KEEP.contains(&k.as_str()) || k.starts_with("LC_") || otel(k))
        .cloned()
        .collect();
    use runplane_grpc::tls::{ENV_CERT_FILE, ENV_KEY_FILE};
    env.extend(
        tls.into_iter()
            .filter(|(k, _)| identity || (k != ENV_CERT_FILE && k != ENV_KEY_FILE)),
    );
    env
}
