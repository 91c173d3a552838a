//! Channels to runplane services. Every request carries the caller's trace context.

use std::time::Duration;

use tonic::transport::Endpoint;

use crate::balance::Balanced;
use crate::endpoints::EndpointList;
use crate::tls::ClientTls;
use crate::trace_context::{ClientTrace, ClientTraceLayer};
use tower_layer::Layer;

/// Adds `authorization: Bearer <secret>` to every call of a client built
/// `with_interceptor(channel, Bearer::new(secret))`. The secret is kept out of `Debug`.
#[derive(Clone)]
pub struct Bearer(String);

impl Bearer {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }
}

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bearer(<redacted>)")
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        let value = format!("Bearer {}", self.0).parse().map_err(|_| {
            tonic::Status::unauthenticated("the bearer secret is not a valid header value")
        })?;
        request.metadata_mut().insert("authorization", value);
        Ok(request)
    }
}

/// A channel whose requests carry W3C trace context, spread over every address of its
/// endpoint list ([`crate::balance`]).
pub type TracedChannel = ClientTrace<Balanced>;

/// How long a TCP connect may take before it counts as failed (and provably unsent).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid endpoint `{endpoint}`: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("could not connect to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
}

/// The endpoint settings runplane uses for every service-to-service channel. An
/// `https://` URI speaks TLS with the settings [`crate::tls::install`] installed (and is
/// refused when none trust a CA); `http://` is plaintext.
pub fn endpoint(uri: &str) -> Result<Endpoint, ClientError> {
    endpoint_with_tls(uri, crate::tls::client().as_ref())
}

/// [`endpoint`] with explicit TLS for `https://` URIs, whatever is installed.
pub fn endpoint_with_tls(uri: &str, tls: Option<&ClientTls>) -> Result<Endpoint, ClientError> {
    Ok(endpoint_settings(uri, tls)?.connect_timeout(CONNECT_TIMEOUT))
}

/// h2 keepalive: a ping every interval on a connection with calls open; no answer
/// within the timeout breaks the connection.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// [`endpoint_with_tls`] without the connect timeout, for a caller whose own connector
/// bounds the connect (the retrying transport does, and classifies it).
pub fn endpoint_settings(uri: &str, tls: Option<&ClientTls>) -> Result<Endpoint, ClientError> {
    let invalid = |reason: String| ClientError::InvalidEndpoint {
        endpoint: crate::endpoints::shown(uri),
        reason,
    };
    let endpoint = Endpoint::from_shared(uri.to_owned())
        .map_err(|e| invalid(e.to_string()))?
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    if endpoint.uri().scheme_str() != Some("https") {
        return Ok(endpoint);
    }
    let tls = tls.ok_or_else(|| {
        invalid(
            "an https:// endpoint needs tls.ca_file (RUNPLANE_TLS__CA_FILE): the CA that \
             signed the server's certificate"
                .to_owned(),
        )
    })?;
    endpoint
        .tls_config(tls.config())
        .map_err(|e| invalid(error_chain(&e)))
}

/// Connects now; fails when no address of `endpoints` accepts a connection.
/// `endpoints` is an endpoint list ([`crate::endpoints`]).
pub async fn connect(endpoints: &str) -> Result<TracedChannel, ClientError> {
    let channel = Balanced::connect(EndpointList::parse(endpoints)?).await?;
    Ok(ClientTraceLayer.layer(channel))
}

/// Resolves and connects on first use, spreads calls over every address of
/// `endpoints` (one URI, several separated by commas, names standing for all their
/// addresses) and moves off one that fails or stalls; for long-lived clients.
pub fn connect_lazy(endpoints: &str) -> Result<TracedChannel, ClientError> {
    Ok(ClientTraceLayer.layer(Balanced::lazy(EndpointList::parse(endpoints)?)))
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
