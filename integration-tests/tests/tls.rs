//! TLS through the real binary: `runplane serve` with `[tls]` from the environment admits
//! only clients with a certificate its client CA signed (mutual TLS), server-only TLS
//! admits any TLS client, unusable files stop the start naming the field, and a run of
//! `runplane dev` with `[tls]` in its config file completes end to end: the CLI, the
//! services among themselves and the sandbox's runner (opted in to the launcher's client
//! identity) all over mutual TLS.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use runplane_grpc::tls::ClientTls;
use runplane_integration_tests::{Process, runplane_bin, start_dev_with_env, start_serve};
use runplane_testkit::pki::{PkiFiles, TestPki};
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const TOKEN: &str = "integration-test-operator-token-0123456789";
const SERVICE: &str = "runplane.credentials.v1.CredentialHealthService";

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `runplane serve credential-health` on SQLite with TLS from `RUNPLANE_TLS__*`;
/// `mutual` adds the client CA.
async fn serve_credential_health(dir: &Path, files: &PkiFiles, mutual: bool) -> Process {
    let database = format!("sqlite://{}", dir.join("ch.sqlite").display());
    let cert = path(&files.server_cert);
    let key = path(&files.server_key);
    let ca = path(&files.ca_cert);
    let mut env = vec![
        ("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
        (
            "RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL",
            database.as_str(),
        ),
        ("RUNPLANE_TLS__CERT_FILE", cert.as_str()),
        ("RUNPLANE_TLS__KEY_FILE", key.as_str()),
    ];
    if mutual {
        env.push(("RUNPLANE_TLS__CLIENT_CA_FILE", ca.as_str()));
    }
    start_serve(&["credential-health"], &env).await
}

/// Connects and asks for credential health's status; any failure (handshake,
/// connection, RPC) comes back as text.
async fn health(endpoint: Endpoint) -> Result<ServingStatus, String> {
    let call = async {
        let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: SERVICE.into(),
            })
            .await
            .map_err(|s| format!("{s:?}"))?;
        Ok(response.into_inner().status())
    };
    tokio::time::timeout(Duration::from_secs(15), call)
        .await
        .map_err(|_| "timed out".to_owned())?
}

fn tls_client(pki: &TestPki, identity: Option<&runplane_testkit::pki::Pem>) -> ClientTls {
    ClientTls::from_pem(
        &pki.ca.cert,
        identity.map(|p| (p.cert.as_bytes(), p.key.as_bytes())),
    )
    .expect("client TLS settings")
}

fn https(url: &str, tls: &ClientTls) -> Endpoint {
    runplane_grpc::client::endpoint_with_tls(url, Some(tls)).expect("https endpoint")
}

#[tokio::test]
async fn mutual_tls_serves_a_certificate_of_the_ca_and_refuses_every_other_client() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate();
    let files = pki.write_to(dir.path());
    let mut process = serve_credential_health(dir.path(), &files, true).await;
    let url = process.https_endpoint();
    let by_name = url.replace("127.0.0.1", "localhost");

    let valid = tls_client(&pki, Some(&pki.client));
    assert_eq!(
        health(https(&url, &valid)).await,
        Ok(ServingStatus::Serving),
        "a client certificate of the CA, by IP"
    );
    assert_eq!(
        health(https(&by_name, &valid)).await,
        Ok(ServingStatus::Serving),
        "a client certificate of the CA, by name"
    );

    let refused = health(https(&url, &tls_client(&pki, None))).await;
    assert!(
        refused.is_err(),
        "TLS without a client certificate: {refused:?}"
    );

    let refused = health(https(&url, &tls_client(&pki, Some(&pki.rogue_client)))).await;
    assert!(
        refused.is_err(),
        "a client certificate of an unrelated CA: {refused:?}"
    );

    let refused =
        health(runplane_grpc::client::endpoint_with_tls(&process.endpoint(), None).unwrap()).await;
    assert!(refused.is_err(), "plaintext: {refused:?}");

    // The refusals cost the server nothing: it still serves a valid client.
    assert_eq!(
        health(https(&url, &valid)).await,
        Ok(ServingStatus::Serving)
    );

    assert!(process.terminate().await.success());
    let logs = process.stderr().await;
    assert!(
        logs.contains("mutual"),
        "TLS mode is logged at start:\n{logs}"
    );
    for secret in [&pki.server.key, &pki.client.key] {
        let body = secret.lines().nth(1).expect("a PEM body line");
        assert!(!logs.contains(body), "key material leaked into logs");
    }
    assert!(!logs.contains(TOKEN), "the operator token leaked into logs");
}

#[tokio::test]
async fn server_only_tls_accepts_a_client_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate();
    let files = pki.write_to(dir.path());
    let mut process = serve_credential_health(dir.path(), &files, false).await;

    assert_eq!(
        health(https(&process.https_endpoint(), &tls_client(&pki, None))).await,
        Ok(ServingStatus::Serving)
    );
    let refused =
        health(runplane_grpc::client::endpoint_with_tls(&process.endpoint(), None).unwrap()).await;
    assert!(refused.is_err(), "plaintext to a TLS server: {refused:?}");
    assert!(process.terminate().await.success());
}

#[tokio::test]
async fn unusable_tls_settings_stop_the_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let files = TestPki::generate().write_to(dir.path());
    let database = format!("sqlite://{}", dir.path().join("ch.sqlite").display());
    let missing = path(&dir.path().join("missing.key"));
    for (env, field) in [
        (
            vec![("RUNPLANE_TLS__CERT_FILE", path(&files.server_cert))],
            "tls.key_file",
        ),
        (
            vec![
                ("RUNPLANE_TLS__CERT_FILE", path(&files.server_cert)),
                ("RUNPLANE_TLS__KEY_FILE", missing.clone()),
            ],
            "tls.key_file",
        ),
    ] {
        let output = tokio::process::Command::new(runplane_bin())
            .args(["serve", "credential-health"])
            .env_remove("RUNPLANE_CONFIG")
            .env("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0")
            .env("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN)
            .env(
                "RUNPLANE_AUTH__SERVICE_TOKEN",
                runplane_integration_tests::SERVICE_TOKEN,
            )
            .env("RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL", &database)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{env:?} started:\n{stderr}");
        assert!(
            stderr.contains(&format!("invalid config: {field}:")),
            "{env:?}:\n{stderr}"
        );
    }
}

/// `runplane dev` with `[tls]` in its config file: the CLI reaches the run store over
/// mutual TLS, the run store asks credential health for admission over it, and the
/// sandbox's runner, which reads no config file, gets the client side through its
/// environment and reports the run over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_completes_over_mutual_tls_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate();
    let files = pki.write_to(dir.path());
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert_file = {:?}\nkey_file = {:?}\nclient_ca_file = {:?}\nca_file = {:?}\n",
            path(&files.server_cert),
            path(&files.server_key),
            path(&files.ca_cert),
            path(&files.ca_cert),
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let config_env = path(&config);
    // The servers require a client certificate, so the sandbox's runner needs the
    // launcher's: a credential a sandbox inherits only when the operator opts in.
    let mut dev = start_dev_with_env(
        &data,
        &[
            ("RUNPLANE_CONFIG", config_env.as_str()),
            ("RUNPLANE_SANDBOX_INHERIT", "tls_client_identity"),
        ],
    )
    .await;
    assert!(
        dev.stdout_lines.iter().any(|l| l.contains("-cacert")),
        "the banner's grpcurl lines use TLS: {:?}",
        dev.stdout_lines
    );

    let cli = tokio::process::Command::new(runplane_bin())
        .args(["run", "--endpoint", &dev.https_endpoint(), "--token-file"])
        .arg(data.join("operator-token"))
        .args(["--", "sh", "-c", "echo hello over tls"])
        .env("RUNPLANE_CONFIG", &config)
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let output = match tokio::time::timeout(Duration::from_secs(90), cli).await {
        Ok(output) => output.unwrap(),
        Err(_) => {
            dev.kill().await;
            let mut runners = String::new();
            for entry in std::fs::read_dir(data.join("sandboxes"))
                .into_iter()
                .flatten()
            {
                let log = entry.unwrap().path().join("runner.log");
                runners += &std::fs::read_to_string(&log).unwrap_or_default();
            }
            panic!(
                "runplane run did not end within 90 s\n--- dev logs\n{}\n--- runner logs\n{runners}",
                dev.stderr().await
            );
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "runplane run: {stderr}");
    assert_eq!(stdout.trim(), "hello over tls", "{stderr}");
    assert!(stderr.contains("succeeded (exit_zero"), "{stderr}");
    assert!(dev.terminate().await.success());
}
