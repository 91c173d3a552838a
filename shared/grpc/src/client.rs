//! Channels to runplane services. Every request carries the caller's trace context.

use tonic::transport::Endpoint;
use tower_layer::Layer;

use crate::balance::Balanced;
pub use crate::endpoints::CONNECT_TIMEOUT;
use crate::endpoints::{EndpointList, endpoint_settings};
pub use crate::error::ClientError;
use crate::tls::ClientTls;
use crate::trace_context::{ClientTrace, ClientTraceLayer};

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

/// A client of another runplane service at `endpoints` (as [`connect_lazy`]), calling
/// with `token` as its bearer: the one way the services build their clients of each
/// other, e.g. `service_client(endpoint, token, RunServiceClient::with_interceptor)`.
pub fn service_client<C>(
    endpoints: &str,
    token: &runplane_config::Secret,
    client: impl FnOnce(TracedChannel, Bearer) -> C,
) -> Result<C, ClientError> {
    Ok(client(
        connect_lazy(endpoints)?,
        Bearer::new(token.expose()),
    ))
}
