//! One webhook POST over HTTP/1.1, plain or TLS, to an address checked first: a name is
//! resolved once, every address it gives is checked against the private ranges (unless
//! the endpoint allows them), and the connection goes to a checked address, so a name
//! that re-resolves to an internal host between check and connect cannot be used to
//! reach it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use runplane_config::{WebhookTarget, is_private_target};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

/// Where the system's CAs are when an endpoint names no `ca_file`.
pub const SYSTEM_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Most bytes of a response body read (and thrown away) so the connection ends cleanly.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// A TLS client for `https://` endpoints, its roots from `ca_file` (PEM).
pub fn tls_connector(ca_file: &str) -> Result<tokio_rustls::TlsConnector, String> {
    let pem = std::fs::read(ca_file).map_err(|e| format!("cannot read {ca_file}: {e}"))?;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|_| format!("{ca_file} holds a certificate that is not PEM"))?;
        // A bundle may carry a root rustls cannot use; the rest still count.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(format!("{ca_file} holds no usable CA certificate"));
    }
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A request to send: the headers besides Host, Content-Type and Content-Length.
pub struct Post<'a> {
    pub target: &'a WebhookTarget,
    pub tls: Option<&'a tokio_rustls::TlsConnector>,
    pub allow_private: bool,
    pub headers: &'a [(&'static str, String)],
    pub body: &'a str,
    pub timeout: Duration,
}

/// What came back: the status, or why none did.
pub enum Answer {
    Status(u16),
    Error(String),
}

/// Sends `post` once, bounded by its timeout end to end.
pub async fn send(post: Post<'_>) -> Answer {
    match tokio::time::timeout(post.timeout, send_unbounded(&post)).await {
        Ok(Ok(status)) => Answer::Status(status),
        Ok(Err(error)) => Answer::Error(error),
        Err(_) => Answer::Error(format!("no answer within {:?}", post.timeout)),
    }
}

async fn send_unbounded(post: &Post<'_>) -> Result<u16, String> {
    let target = post.target;
    let address = checked_address(target, post.allow_private).await?;
    let tcp = TcpStream::connect(address)
        .await
        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    if target.https {
        let tls = post.tls.ok_or("no TLS client for an https:// endpoint")?;
        let name = ServerName::try_from(target.host.clone())
            .map_err(|_| format!("{} is not a TLS server name", target.host))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {address} failed: {e}"))?;
        exchange(TokioIo::new(stream), post).await
    } else {
        exchange(TokioIo::new(tcp), post).await
    }
}

/// The one address to connect to: the IP literal, or the first a name resolves to, when
/// none of them is private (unless allowed).
async fn checked_address(
    target: &WebhookTarget,
    allow_private: bool,
) -> Result<SocketAddr, String> {
    let addresses: Vec<SocketAddr> = match target.ip() {
        Some(ip) => vec![SocketAddr::new(ip, target.port)],
        None => tokio::net::lookup_host((target.host.as_str(), target.port))
            .await
            .map_err(|e| format!("cannot resolve {}: {e}", target.host))?
            .collect(),
    };
    let first = *addresses
        .first()
        .ok_or_else(|| format!("{} resolves to no address", target.host))?;
    if !allow_private && let Some(private) = addresses.iter().find(|a| is_private_target(a.ip())) {
        return Err(format!(
            "{} resolves to {}, a loopback, private or link-local address; the endpoint \
             does not allow private targets",
            target.host,
            private.ip()
        ));
    }
    Ok(first)
}

async fn exchange<S>(io: TokioIo<S>, post: &Post<'_>) -> Result<u16, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("HTTP handshake failed: {e}"))?;
    let connection = tokio::spawn(connection);
    let target = post.target;
    let default_port = if target.https { 443 } else { 80 };
    let host = match (target.ip(), target.port) {
        (Some(std::net::IpAddr::V6(ip)), port) if port != default_port => format!("[{ip}]:{port}"),
        (Some(std::net::IpAddr::V6(ip)), _) => format!("[{ip}]"),
        (_, port) if port != default_port => format!("{}:{port}", target.host),
        _ => target.host.clone(),
    };
    let mut request = hyper::Request::post(target.path.as_str())
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::USER_AGENT, "runplane-webhooks/1");
    for (name, value) in post.headers {
        request = request.header(*name, value.as_str());
    }
    let request = request
        .body(Full::new(Bytes::copy_from_slice(post.body.as_bytes())))
        .map_err(|e| format!("cannot build the request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("the request failed: {e}"))?;
    let status = response.status().as_u16();
    // Read a bounded part of the body so the exchange completes, then drop the rest.
    let mut body = response.into_body();
    let mut read = 0;
    while read < MAX_RESPONSE_BYTES {
        match body.frame().await {
            Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
            _ => break,
        }
    }
    connection.abort();
    Ok(status)
}
