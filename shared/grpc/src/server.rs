//! Serving a set of runplane services with health, reflection, request spans and a
//! graceful shutdown that has a deadline.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic_health::ServingStatus;
use tower_service::Service;

use crate::guard::{MessageLimits, RequestGuardLayer};
use crate::shed::LoadShedLayer;
use crate::tls::ServerTls;
use crate::trace_context::ServerTraceLayer;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reflection descriptors are invalid: {0}")]
    Reflection(String),
    #[error("gRPC server failed: {0}")]
    Transport(String),
    #[error("TLS settings are unusable: {0}")]
    Tls(String),
    #[error("background task {0} failed; the process stops so a fresh one takes over")]
    Task(&'static str),
}

/// What one server allows a connection and a call, from `[server]`.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_concurrent_streams: u32,
    pub max_local_error_reset_streams: usize,
    pub keepalive_interval: Option<Duration>,
    pub keepalive_timeout: Duration,
    pub max_connection_age: Option<Duration>,
    pub max_connection_age_grace: Duration,
    pub max_decoding_message_bytes: usize,
    pub max_decoding_message_bytes_by_service: std::collections::BTreeMap<String, usize>,
    /// Ordinary calls one service handles at once (`None`: no limit), and overrides.
    pub max_concurrent_requests: Option<usize>,
    pub max_concurrent_requests_by_service: std::collections::BTreeMap<String, usize>,
    pub overload_pushback: Duration,
    /// How long a call over the limit waits for a slot before it is shed.
    pub overload_queue: Duration,
}

impl ServerLimits {
    /// The concurrency limit of each of `services`, where it has one.
    fn concurrency_limits<'a>(
        &'a self,
        services: &'a [&'static str],
    ) -> impl Iterator<Item = (String, usize)> + 'a {
        services.iter().filter_map(|name| {
            let limit = match self.max_concurrent_requests_by_service.get(*name) {
                Some(0) => None,
                Some(n) => Some(*n),
                None => self.max_concurrent_requests,
            };
            limit.map(|n| ((*name).to_owned(), n))
        })
    }
}

impl From<&runplane_config::ServerConfig> for ServerLimits {
    fn from(server: &runplane_config::ServerConfig) -> Self {
        let seconds = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        Self {
            max_concurrent_streams: server.max_concurrent_streams,
            max_local_error_reset_streams: server.max_local_error_reset_streams as usize,
            keepalive_interval: seconds(server.keepalive_interval_seconds),
            keepalive_timeout: Duration::from_secs(server.keepalive_timeout_seconds),
            max_connection_age: seconds(server.max_connection_age_seconds),
            max_connection_age_grace: Duration::from_secs(server.max_connection_age_grace_seconds),
            max_decoding_message_bytes: server.max_decoding_message_bytes as usize,
            max_decoding_message_bytes_by_service: server
                .max_decoding_message_bytes_by_service
                .iter()
                .map(|(service, bytes)| (service.clone(), *bytes as usize))
                .collect(),
            max_concurrent_requests: (server.max_concurrent_requests > 0)
                .then_some(server.max_concurrent_requests as usize),
            max_concurrent_requests_by_service: server
                .max_concurrent_requests_by_service
                .iter()
                .map(|(service, n)| (service.clone(), *n as usize))
                .collect(),
            overload_pushback: Duration::from_millis(server.overload_pushback_ms),
            overload_queue: Duration::from_millis(server.overload_queue_ms),
        }
    }
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self::from(&runplane_config::ServerConfig::default())
    }
}

/// The runplane services one server will host. Health and reflection are added by
/// [`serve`]; their names come from here.
#[derive(Default)]
pub struct ServiceSet {
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    on_shutdown: Vec<Box<dyn FnOnce() + Send>>,
    limits: ServerLimits,
    tokens: crate::auth::Tokens,
    background: Vec<crate::tasks::Tasks>,
}

impl ServiceSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tonic service; its full name gets a health status of its own.
    pub fn add<S>(&mut self, service: S) -> &mut Self
    where
        S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.routes.add_service(service);
        self.names.push(S::NAME);
        self
    }

    /// Runs `hook` as soon as shutdown begins, before in-flight calls get their grace: a
    /// service ends its long polls and streams there so clients move on at once.
    pub fn on_shutdown(&mut self, hook: impl FnOnce() + Send + 'static) -> &mut Self {
        self.on_shutdown.push(Box::new(hook));
        self
    }

    /// A service's background tasks: [`serve`] cancels them when shutdown begins and
    /// awaits them within the grace, and stops serving when one that stops the process
    /// panics ([`crate::tasks::OnPanic::Stop`]).
    pub fn background(&mut self, tasks: &crate::tasks::Tasks) -> &mut Self {
        self.background.push(tasks.clone());
        self
    }

    /// Full names of the services added so far.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// The tokens the server's [`crate::auth`] layer knows. Each service sets them from
    /// its `[auth]` when it registers (one process serves one config); a set without them
    /// admits only the credentials handlers check themselves.
    pub fn authenticate(&mut self, tokens: crate::auth::Tokens) -> &mut Self {
        self.tokens = tokens;
        self
    }

    /// Replaces the default [`ServerLimits`] (those of `[server]`'s defaults).
    pub fn limits(&mut self, limits: ServerLimits) -> &mut Self {
        self.limits = limits;
        self
    }
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every in-flight call finished within the grace (or the server stopped on its own).
    Drained,
    /// Calls or background tasks were still running when the grace ran out; they were
    /// dropped.
    GraceExpired,
}

/// Serves `services` on `listener` until `shutdown` resolves, with the TLS
/// [`crate::tls::install`] installed (plaintext when none was).
///
/// On shutdown every health status turns NOT_SERVING first (so load balancers stop
/// sending), then in-flight calls and background tasks get `grace` to finish; whatever is
/// still running after that is dropped. A background task that stops the process when it
/// panics begins the same shutdown, and `serve` then returns [`ServeError::Task`].
pub async fn serve(
    listener: TcpListener,
    services: ServiceSet,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<Stopped, ServeError> {
    serve_with_tls(listener, services, shutdown, grace, crate::tls::server()).await
}

/// [`serve`] with explicit TLS: `Some` serves TLS only (and requires client
/// certificates when its client CA is set), `None` serves plaintext, whatever is
/// installed.
pub async fn serve_with_tls(
    listener: TcpListener,
    services: ServiceSet,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
    tls: Option<ServerTls>,
) -> Result<Stopped, ServeError> {
    let ServiceSet {
        mut routes,
        names,
        on_shutdown,
        limits,
        tokens,
        background,
    } = services;

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::Serving).await;
    for name in &names {
        health
            .set_service_status(*name, ServingStatus::Serving)
            .await;
    }

    // Both versions list both reflection services, whichever a client speaks.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .include_reflection_service(false)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            )
            .register_encoded_file_descriptor_set(runplane_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // So grpcurl can decode the ErrorInfo in every runplane error.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    routes
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);

    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        // tonic turns hyper's reset-flood guard off unless this is set (RUSTSEC-2024-0003).
        .http2_max_local_error_reset_streams(Some(limits.max_local_error_reset_streams))
        .http2_keepalive_interval(limits.keepalive_interval)
        .http2_keepalive_timeout(Some(limits.keepalive_timeout));
    if let Some(age) = limits.max_connection_age {
        builder = builder
            .max_connection_age(age)
            .max_connection_age_grace(limits.max_connection_age_grace);
    }
    let tls_mode = tls.as_ref().map_or("off", ServerTls::mode);
    if let Some(tls) = tls {
        // Applies to `serve_with_incoming` too: each accepted stream is handshaken first.
        builder = builder
            .tls_config(tls.config())
            .map_err(|e| ServeError::Tls(crate::error::error_chain(&e)))?;
    }

    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, services = ?names, tls = tls_mode, "serving");
    }

    let shed = LoadShedLayer::new(
        limits.concurrency_limits(&names).collect::<Vec<_>>(),
        limits.overload_pushback,
    )
    .queueing(limits.overload_queue);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = builder
        .layer(ServerTraceLayer)
        .layer(RequestGuardLayer::new(MessageLimits::new(
            limits.max_decoding_message_bytes,
            limits.max_decoding_message_bytes_by_service,
        )))
        .layer(crate::auth::AuthLayer::new(tokens))
        .layer(shed)
        .add_routes(routes.routes())
        .serve_with_incoming_shutdown(incoming(listener), async {
            let _ = stop_rx.await;
        });
    let mut server = tokio::spawn(server);

    type Failing<'a> = std::pin::Pin<Box<dyn Future<Output = &'static str> + Send + 'a>>;
    let mut failing: Vec<Failing<'_>> = background
        .iter()
        .map(|tasks| Box::pin(tasks.failed()) as Failing<'_>)
        .collect();
    failing.push(Box::pin(std::future::pending()));
    let failed = futures::future::select_all(failing);
    let failed = tokio::select! {
        finished = &mut server => {
            // Stopped on its own (a transport failure): the tasks stop with it.
            let deadline = tokio::time::Instant::now() + grace;
            shut_down(&background, deadline).await;
            return flatten(finished);
        }
        () = shutdown => None,
        (name, _, _) = failed => Some(name),
    };
    let deadline = tokio::time::Instant::now() + grace;

    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    for name in &names {
        health
            .set_service_status(*name, ServingStatus::NotServing)
            .await;
    }
    // Tasks learn of the shutdown before the hooks close what some of them wait on, so a
    // task that returns then is not taken for one that ended on its own.
    for tasks in &background {
        tasks.cancel();
    }
    for hook in on_shutdown {
        hook();
    }
    let _ = stop_tx.send(());
    let (stopped, outlived) = tokio::join!(
        async {
            match tokio::time::timeout_at(deadline, &mut server).await {
                Ok(finished) => flatten(finished),
                Err(_) => {
                    tracing::warn!(
                        grace_seconds = grace.as_secs(),
                        "in-flight calls outlived the shutdown grace; dropping them"
                    );
                    server.abort();
                    Ok(Stopped::GraceExpired)
                }
            }
        },
        shut_down(&background, deadline),
    );
    if let Some(name) = failed {
        return Err(ServeError::Task(name));
    }
    match stopped? {
        Stopped::Drained if outlived.iter().any(|names| !names.is_empty()) => {
            Ok(Stopped::GraceExpired)
        }
        stopped => Ok(stopped),
    }
}

/// Cancels every group of background tasks and waits for them until `deadline`; the
/// names of those aborted there, per group.
async fn shut_down(
    background: &[crate::tasks::Tasks],
    deadline: tokio::time::Instant,
) -> Vec<Vec<&'static str>> {
    futures::future::join_all(background.iter().map(|tasks| tasks.shutdown(deadline))).await
}

/// Accepted connections with Nagle's algorithm off. h2 writes a response's frames in
/// separate small writes; with Nagle on, the second waits for the client's delayed ACK
/// (about 40 ms) whenever a response body crosses a write boundary. tonic's
/// `tcp_nodelay` setting only applies to the listeners it binds itself.
fn incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|accepted| {
        if let Ok(stream) = &accepted
            && let Err(e) = stream.set_nodelay(true)
        {
            tracing::debug!(error = %e, "could not turn Nagle off on an accepted socket");
        }
        accepted
    })
}

fn flatten(
    joined: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<Stopped, ServeError> {
    match joined {
        Ok(Ok(())) => Ok(Stopped::Drained),
        Ok(Err(e)) => Err(ServeError::Transport(e.to_string())),
        Err(e) => Err(ServeError::Transport(e.to_string())),
    }
}
