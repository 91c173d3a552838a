//! TLS and mutual TLS of `serve_with_tls` and `https://` channels over real sockets,
//! with plain servers in the same process, and `[tls]` files checked at start-up.

use std::time::Duration;

use runplane_config::TlsConfig;
use runplane_grpc::tls::{ClientTls, ServerTls, Tls};
use runplane_grpc::{ServiceSet, serve_with_tls};
use runplane_testkit::pki::TestPki;
use tokio::net::TcpListener;
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Starts a server with `tls` on a free port; returns its port. It runs until the test's
/// runtime ends.
async fn start(tls: Option<ServerTls>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_with_tls(
        listener,
        ServiceSet::new(),
        std::future::pending(),
        Duration::from_secs(1),
        tls,
    ));
    port
}

/// Connects and asks for the overall health; any failure (handshake, connection, RPC)
/// comes back as text.
async fn health(endpoint: Endpoint) -> Result<ServingStatus, String> {
    let call = async {
        let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest::default())
            .await
            .map_err(|s| format!("{s:?}"))?;
        Ok(response.into_inner().status())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| "timed out".to_owned())?
}

fn https(port: u16, host: &str, tls: &ClientTls) -> Endpoint {
    runplane_grpc::client::endpoint_with_tls(&format!("https://{host}:{port}"), Some(tls))
        .expect("https endpoint")
}

fn plain(port: u16) -> Endpoint {
    runplane_grpc::client::endpoint_with_tls(&format!("http://127.0.0.1:{port}"), None)
        .expect("http endpoint")
}

#[tokio::test]
async fn mutual_tls_admits_only_a_client_certificate_of_the_ca_and_plain_servers_stay_plain() {
    let pki = TestPki::generate();
    let server_tls = ServerTls::from_pem(
        &pki.server.cert,
        &pki.server.key,
        Some(pki.ca.cert.as_bytes()),
    )
    .unwrap();
    assert!(server_tls.requires_client_certificates());
    let mutual = start(Some(server_tls)).await;
    let plaintext = start(None).await;

    let with_cert = ClientTls::from_pem(
        &pki.ca.cert,
        Some((pki.client.cert.as_bytes(), pki.client.key.as_bytes())),
    )
    .unwrap();
    // The server certificate's IP SAN and its DNS SAN both verify.
    for host in ["127.0.0.1", "localhost"] {
        assert_eq!(
            health(https(mutual, host, &with_cert)).await,
            Ok(ServingStatus::Serving),
            "{host}"
        );
    }

    let without_cert = ClientTls::from_pem(&pki.ca.cert, None).unwrap();
    let refused = health(https(mutual, "127.0.0.1", &without_cert)).await;
    assert!(refused.is_err(), "no client certificate: {refused:?}");

    let rogue = ClientTls::from_pem(
        &pki.ca.cert,
        Some((
            pki.rogue_client.cert.as_bytes(),
            pki.rogue_client.key.as_bytes(),
        )),
    )
    .unwrap();
    let refused = health(https(mutual, "127.0.0.1", &rogue)).await;
    assert!(
        refused.is_err(),
        "an unrelated CA's certificate: {refused:?}"
    );

    let refused = health(plain(mutual)).await;
    assert!(refused.is_err(), "plaintext to a TLS server: {refused:?}");

    // A client that trusts another CA does not accept this server.
    let distrusting = ClientTls::from_pem(&pki.rogue_ca.cert, None).unwrap();
    let refused = health(https(mutual, "127.0.0.1", &distrusting)).await;
    assert!(refused.is_err(), "server of an untrusted CA: {refused:?}");

    // The plain server in the same process is untouched, and still serves after the
    // refused handshakes above.
    assert_eq!(health(plain(plaintext)).await, Ok(ServingStatus::Serving));
    assert_eq!(
        health(https(mutual, "localhost", &with_cert)).await,
        Ok(ServingStatus::Serving)
    );
}

#[tokio::test]
async fn server_only_tls_accepts_a_client_without_a_certificate() {
    let pki = TestPki::generate();
    let server_tls = ServerTls::from_pem(&pki.server.cert, &pki.server.key, None).unwrap();
    assert!(!server_tls.requires_client_certificates());
    let port = start(Some(server_tls)).await;

    let without_cert = ClientTls::from_pem(&pki.ca.cert, None).unwrap();
    assert_eq!(
        health(https(port, "127.0.0.1", &without_cert)).await,
        Ok(ServingStatus::Serving)
    );
    let refused = health(plain(port)).await;
    assert!(refused.is_err(), "plaintext to a TLS server: {refused:?}");
}

#[test]
fn an_https_endpoint_without_a_trusted_ca_is_refused_naming_the_field() {
    let err = runplane_grpc::client::endpoint_with_tls("https://127.0.0.1:7070", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tls.ca_file"), "{err}");
    assert!(err.contains("RUNPLANE_TLS__CA_FILE"), "{err}");
}

#[test]
fn unusable_tls_files_stop_the_start_naming_the_field() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let files = pki.write_to(dir.path());
    let path = |p: &std::path::Path| p.display().to_string();
    let load = |config: TlsConfig| Tls::load(&config).map(drop).unwrap_err().to_string();

    let err = load(TlsConfig {
        cert_file: path(&files.server_cert),
        ..TlsConfig::default()
    });
    assert!(err.starts_with("invalid config: tls.key_file:"), "{err}");

    let missing = dir.path().join("missing.pem");
    let err = load(TlsConfig {
        cert_file: path(&missing),
        key_file: path(&files.server_key),
        ..TlsConfig::default()
    });
    assert!(
        err.starts_with("invalid config: tls.cert_file: cannot read"),
        "{err}"
    );
    assert!(err.contains("missing.pem"), "{err}");

    // A key for another certificate.
    let err = load(TlsConfig {
        cert_file: path(&files.server_cert),
        key_file: path(&files.client_key),
        ..TlsConfig::default()
    });
    assert!(err.starts_with("invalid config: tls.key_file:"), "{err}");

    // A certificate where the key should be; the message quotes no PEM.
    let err = load(TlsConfig {
        cert_file: path(&files.server_cert),
        key_file: path(&files.server_cert),
        ..TlsConfig::default()
    });
    assert!(err.starts_with("invalid config: tls.key_file:"), "{err}");
    assert!(!err.contains("BEGIN"), "{err}");

    let err = load(TlsConfig {
        ca_file: path(&files.server_key),
        ..TlsConfig::default()
    });
    assert!(err.starts_with("invalid config: tls.ca_file:"), "{err}");
    assert!(
        !err.contains(&pki.server.key[40..80]),
        "the key leaked: {err}"
    );

    let err = load(TlsConfig {
        cert_file: path(&files.server_cert),
        key_file: path(&files.server_key),
        client_ca_file: path(&missing),
        ..TlsConfig::default()
    });
    assert!(
        err.starts_with("invalid config: tls.client_ca_file:"),
        "{err}"
    );

    let tls = Tls::load(&TlsConfig {
        cert_file: path(&files.server_cert),
        key_file: path(&files.server_key),
        client_ca_file: path(&files.ca_cert),
        ca_file: path(&files.ca_cert),
    })
    .unwrap();
    assert_eq!(tls.server_mode(), "mutual");
    assert!(tls.client().unwrap().presents_certificate());
    let env: Vec<_> = tls.child_env().iter().map(|(k, _)| *k).collect();
    assert_eq!(
        env,
        [
            "RUNPLANE_TLS__CA_FILE",
            "RUNPLANE_TLS__CERT_FILE",
            "RUNPLANE_TLS__KEY_FILE"
        ]
    );
    assert!(
        tls.child_env()
            .iter()
            .all(|(_, p)| std::path::Path::new(p).is_absolute())
    );

    let plain = Tls::load(&TlsConfig::default()).unwrap();
    assert_eq!(plain.server_mode(), "off");
    assert!(plain.client().is_none());
    assert!(plain.child_env().is_empty());
}

/// The process-wide settings: what `install` reads is what `serve` and
/// `client::connect` use. The only test here that touches them.
#[tokio::test]
async fn installed_settings_drive_serve_and_https_channels() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().unwrap();
    let files = pki.write_to(dir.path());
    let path = |p: &std::path::Path| p.display().to_string();
    runplane_grpc::tls::install(&TlsConfig {
        cert_file: path(&files.server_cert),
        key_file: path(&files.server_key),
        client_ca_file: path(&files.ca_cert),
        ca_file: path(&files.ca_cert),
    })
    .unwrap();

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(runplane_grpc::serve(
        listener,
        ServiceSet::new(),
        std::future::pending(),
        Duration::from_secs(1),
    ));

    // The server's own identity is the client certificate, as between services.
    let channel = runplane_grpc::client::connect(&format!("https://localhost:{port}"))
        .await
        .unwrap();
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner()
        .status();
    assert_eq!(status, ServingStatus::Serving);

    let refused = health(plain(port)).await;
    assert!(refused.is_err(), "plaintext to the TLS server: {refused:?}");

    runplane_grpc::tls::set(Tls::default());
    let err = runplane_grpc::client::endpoint(&format!("https://localhost:{port}"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tls.ca_file"), "{err}");
}
