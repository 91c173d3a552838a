//! A channel over every address of an endpoint list, for service-to-service clients.
//!
//! Why not tonic's `Channel::balance_list` / `balance_channel` (tower's p2c balancer):
//! - tower's p2c drops an endpoint whose readiness fails ("dropping failed endpoint") and
//!   never tries it again unless discovery inserts it anew; tonic's lazy connections hide
//!   connect failures from readiness (their calls fail instead), so nothing is dropped,
//!   but then p2c keeps handing calls to a dead replica, each failing with a connect
//!   error that is never retried on another one.
//! - tonic's `Connection` reports a constant load of 0, so p2c is a coin toss: a frozen
//!   replica (connection accepted, nothing answered) gets half the calls, each waiting
//!   until h2 keepalive breaks the connection (30 s + 10 s), then reconnecting to it.
//! - It dials with its own connector and resolves a name to one address per connect.
//!
//! So this extends the transport's `Upstream` approach to several live addresses: calls
//! go round robin over every resolved address; an attempt that provably never reached a
//! handler (connect failed, or the server sent not one byte within
//! [`HANDSHAKE_TIMEOUT`]) moves to the next address, for every method; an attempt that
//! failed after it was sent (reset, the connection's liveness ping unanswered) condemns
//! its connection and is sent to the next address once more only when the method is
//! replay-safe (`runplane_proto::policy_for`). An address that failed cools off (1 s
//! doubling to 30 s) and is then tried again, so a replica that restarts gets calls
//! back; while every address cools, they are still tried, in order.
//!
//! What bounds a frozen replica (SIGSTOPped: the kernel accepts, nothing answers): on a
//! fresh connection, [`HANDSHAKE_TIMEOUT`]; on an established one, an h2 ping after
//! [`LIVENESS_INTERVAL`] without a frame while a call is open, unanswered within
//! [`LIVENESS_TIMEOUT`], breaks it. A live server's h2 layer answers pings while its
//! handler works, so a slow call is not cut short; only a silent process is. The
//! call's own `grpc-timeout`, if any, is enforced by tonic.
//!
//! Requests are buffered to be resent: every runplane method takes a single message.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::transport::{Channel, Endpoint, Uri};
use tower_service::Service;

use crate::endpoints::{CONNECT_TIMEOUT, EndpointList, RESOLVE_EVERY, Target};
use crate::error::{ClientError, error_chain};

/// A fresh connection whose server sent nothing (not even its h2 SETTINGS) within this
/// proves that nothing sent on it reached a handler.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// While a call is open and nothing came for this long, the connection is pinged.
pub const LIVENESS_INTERVAL: Duration = Duration::from_secs(1);
/// A ping unanswered for this long breaks the connection and fails its calls.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(2);

/// Cool-off of an address after its first failure, doubling per failure in a row.
const COOL_OFF_BASE: Duration = Duration::from_secs(1);
const COOL_OFF_CAP: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Calls spread over the addresses of an endpoint list. Cheap to clone; clones share
/// connections and address health.
#[derive(Clone)]
pub struct Balanced {
    pool: Arc<Pool>,
}

impl std::fmt::Debug for Balanced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balanced")
            .field("endpoints", &self.pool.list.shown())
            .finish()
    }
}

struct Pool {
    list: EndpointList,
    state: Mutex<State>,
    /// Where the next call starts in the address list.
    turn: AtomicUsize,
    refreshing: AtomicBool,
}

#[derive(Default)]
struct State {
    members: Vec<Member>,
    resolved_at: Option<Instant>,
}

/// One resolved address and its connection.
#[derive(Clone)]
struct Member {
    target: usize,
    address: SocketAddr,
    /// `URI (address)`, for logs and errors.
    shown: Arc<str>,
    conn: Arc<Mutex<Conn>>,
    health: Arc<Mutex<Health>>,
}

#[derive(Clone)]
struct Conn {
    generation: u64,
    channel: Channel,
    heard: Arc<AtomicBool>,
    endpoint: Endpoint,
}

#[derive(Default)]
struct Health {
    failures: u32,
    cool_until: Option<Instant>,
}

impl Balanced {
    /// A balanced channel over `list`; nothing is resolved or connected before the
    /// first call.
    pub fn lazy(list: EndpointList) -> Self {
        Self {
            pool: Arc::new(Pool {
                list,
                state: Mutex::default(),
                turn: AtomicUsize::new(rand::random_range(0..1024)),
                refreshing: AtomicBool::new(false),
            }),
        }
    }

    /// Resolves the list and connects now: fails when no address accepts a connection.
    pub async fn connect(list: EndpointList) -> Result<Self, ClientError> {
        let balanced = Self::lazy(list);
        let pool = &balanced.pool;
        pool.refresh().await;
        let members = pool.state.lock().expect("pool poisoned").members.clone();
        let mut last = format!("{} resolves to no address", pool.list.shown());
        for member in &members {
            let heard = Arc::new(AtomicBool::new(false));
            let endpoint = liveness(pool.list.targets()[member.target].endpoint().clone());
            match endpoint
                .clone()
                .connect_with_connector(Dial::new(member.address, heard.clone()))
                .await
            {
                Ok(channel) => {
                    let mut conn = member.conn.lock().expect("conn poisoned");
                    *conn = Conn {
                        generation: conn.generation + 1,
                        channel,
                        heard,
                        endpoint,
                    };
                    return Ok(balanced.clone());
                }
                Err(e) => last = format!("{}: {}", member.shown, error_chain(&e)),
            }
        }
        Err(ClientError::Connect {
            endpoint: pool.list.shown(),
            reason: last,
        })
    }

    /// The addresses calls go to now, as `URI (address)`.
    pub fn addresses(&self) -> Vec<Arc<str>> {
        let state = self.pool.state.lock().expect("pool poisoned");
        state.members.iter().map(|m| m.shown.clone()).collect()
    }
}

impl Service<http::Request<Body>> for Balanced {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<http::Response<Body>, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each attempt awaits its own connection's readiness inside the call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let pool = self.pool.clone();
        Box::pin(async move { pool.call(request).await })
    }
}

/// What one attempt on one address came to.
enum Outcome {
    Answered(http::Response<Body>),
    /// Provably never reached a handler: try the next address.
    NotSent(BoxError),
    /// Failed after sending (reset, liveness ping unanswered): may have been processed.
    Failed(BoxError),
}

impl Pool {
    async fn call(
        self: Arc<Self>,
        request: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let (parts, body) = request.into_parts();
        let body = body.collect().await.map_err(BoxError::from)?.to_bytes();
        let replay_safe = runplane_proto::policy_for(parts.uri.path())
            .is_some_and(|p| p.replay_safety.is_replay_safe());
        let members = self.members().await;
        if members.is_empty() {
            return Err(Box::new(tonic::Status::unavailable(format!(
                "{} resolves to no address",
                self.list.shown()
            ))));
        }
        let mut last: Option<BoxError> = None;
        let mut resent = false;
        for member in self.order(members) {
            let request = rebuild(&parts, body.clone());
            match attempt(&member, request).await {
                Outcome::Answered(response) => {
                    member.recovered();
                    return Ok(response);
                }
                Outcome::NotSent(e) => {
                    tracing::info!(address = %member.shown, error = %e, "moving to the next address");
                    member.failed(true);
                    last = Some(e);
                }
                Outcome::Failed(e) => {
                    member.failed(true);
                    if !replay_safe || resent {
                        return Err(e);
                    }
                    tracing::info!(address = %member.shown, error = %e, "failed after sending: resending to the next address");
                    resent = true;
                    last = Some(e);
                }
            }
        }
        // Every address failed: resolve again before the next call.
        self.state.lock().expect("pool poisoned").resolved_at = None;
        Err(last.expect("at least one address was tried"))
    }

    /// The members to try, starting at the next turn, cooling ones last.
    fn order(&self, mut members: Vec<Member>) -> Vec<Member> {
        let n = members.len();
        members.rotate_left(self.turn.fetch_add(1, Ordering::Relaxed) % n);
        let now = Instant::now();
        // Stable: among the healthy and among the cooling, the round-robin order holds.
        members.sort_by_key(|m| m.cooling_at(now));
        members
    }

    /// The current members; resolves first when there are none, and in the background
    /// when the last resolution is older than [`RESOLVE_EVERY`].
    async fn members(self: &Arc<Self>) -> Vec<Member> {
        let (members, stale) = {
            let state = self.state.lock().expect("pool poisoned");
            let stale = state
                .resolved_at
                .is_none_or(|at| at.elapsed() >= RESOLVE_EVERY);
            (state.members.clone(), stale)
        };
        if members.is_empty() {
            self.refresh().await;
            return self.state.lock().expect("pool poisoned").members.clone();
        }
        if stale && !self.refreshing.swap(true, Ordering::SeqCst) {
            let pool = self.clone();
            tokio::spawn(async move {
                pool.refresh().await;
                pool.refreshing.store(false, Ordering::SeqCst);
            });
        }
        members
    }

    /// Resolves every target; keeps the members of addresses still there (with their
    /// connections and health), adds new ones, drops the rest. A target whose lookup
    /// fails keeps the addresses it had: a DNS blip must not empty the pool.
    async fn refresh(&self) {
        let mut resolved: Vec<Option<Vec<SocketAddr>>> = Vec::new();
        for target in self.list.targets() {
            match target.resolve().await {
                Ok(addresses) => resolved.push(Some(addresses)),
                Err(e) => {
                    tracing::warn!(endpoint = %target.shown(), error = %e, "could not resolve");
                    resolved.push(None);
                }
            }
        }
        let mut state = self.state.lock().expect("pool poisoned");
        let old = std::mem::take(&mut state.members);
        let mut members = Vec::new();
        for (index, (target, addresses)) in self.list.targets().iter().zip(resolved).enumerate() {
            let Some(addresses) = addresses else {
                members.extend(old.iter().filter(|m| m.target == index).cloned());
                continue;
            };
            for address in addresses {
                let kept = old
                    .iter()
                    .find(|m| m.target == index && m.address == address);
                members.push(match kept {
                    Some(member) => member.clone(),
                    None => Member::new(index, target, address),
                });
            }
        }
        state.members = members;
        state.resolved_at = Some(Instant::now());
    }
}

impl Member {
    fn new(target_index: usize, target: &Target, address: SocketAddr) -> Self {
        let shown: Arc<str> = match target.literal() {
            Some(_) => target.shown().clone(),
            None => format!("{} ({address})", target.shown()).into(),
        };
        let endpoint = liveness(target.endpoint().clone());
        let conn = Conn::open(&endpoint, address, 0);
        Self {
            target: target_index,
            address,
            shown,
            conn: Arc::new(Mutex::new(conn)),
            health: Arc::default(),
        }
    }

    fn cooling_at(&self, now: Instant) -> bool {
        let health = self.health.lock().expect("health poisoned");
        health.cool_until.is_some_and(|until| until > now)
    }

    fn recovered(&self) {
        *self.health.lock().expect("health poisoned") = Health::default();
    }

    /// Cools the address off; `condemn` also replaces its connection, so the next
    /// attempt there is on a fresh one (an h2 connection to a frozen server never
    /// breaks by itself).
    fn failed(&self, condemn: bool) {
        {
            let mut health = self.health.lock().expect("health poisoned");
            let cool = COOL_OFF_BASE
                .saturating_mul(2u32.saturating_pow(health.failures.min(16)))
                .min(COOL_OFF_CAP);
            health.failures = health.failures.saturating_add(1);
            health.cool_until = Some(Instant::now() + cool);
        }
        if condemn {
            let mut conn = self.conn.lock().expect("conn poisoned");
            let endpoint = conn.endpoint.clone();
            *conn = Conn::open(&endpoint, self.address, conn.generation + 1);
        }
    }
}

/// Short h2 keepalive while calls are open: the frozen-replica detector.
fn liveness(endpoint: Endpoint) -> Endpoint {
    endpoint
        .http2_keep_alive_interval(LIVENESS_INTERVAL)
        .keep_alive_timeout(LIVENESS_TIMEOUT)
}

impl Conn {
    fn open(endpoint: &Endpoint, address: SocketAddr, generation: u64) -> Self {
        let heard = Arc::new(AtomicBool::new(false));
        let channel = endpoint.connect_with_connector_lazy(Dial::new(address, heard.clone()));
        Self {
            generation,
            channel,
            heard,
            endpoint: endpoint.clone(),
        }
    }
}

/// One attempt on `member`'s connection, bounded by the handshake timeout while the
/// connection has heard nothing (and by its liveness pings once it has).
async fn attempt(member: &Member, request: http::Request<Body>) -> Outcome {
    let conn = member.conn.lock().expect("conn poisoned").clone();
    let mut channel = conn.channel.clone();
    let call = async move {
        std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
        channel.call(request).await
    };
    tokio::pin!(call);
    let handshake = tokio::time::sleep(HANDSHAKE_TIMEOUT);
    tokio::pin!(handshake);
    let mut handshake_checked = false;
    loop {
        tokio::select! {
            done = &mut call => return match done {
                Ok(response) => Outcome::Answered(response.map(Body::new)),
                Err(e) if is_connect(&e) => Outcome::NotSent(Box::new(e)),
                Err(e) => Outcome::Failed(Box::new(e)),
            },
            () = &mut handshake, if !handshake_checked => {
                handshake_checked = true;
                if !conn.heard.load(Ordering::SeqCst) {
                    return Outcome::NotSent(Box::new(tonic::Status::unavailable(format!(
                        "no answer from {}: it sent nothing within {} ms",
                        member.shown,
                        HANDSHAKE_TIMEOUT.as_millis()
                    ))));
                }
            }
        }
    }
}

/// A connect that failed (refused, timed out, no route): nothing was sent.
fn is_connect(error: &tonic::transport::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

fn rebuild(parts: &http::request::Parts, body: Bytes) -> http::Request<Body> {
    let mut request = http::Request::new(Body::new(http_body_util::Full::new(body)));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    request
}

/// TCP to one resolved address with a bounded connect, marking when the server first
/// speaks. The URI (its name) is left to tonic for `:authority` and TLS.
#[derive(Clone)]
pub struct Dial {
    address: SocketAddr,
    heard: Arc<AtomicBool>,
    connect_timeout: Duration,
}

impl Dial {
    pub fn new(address: SocketAddr, heard: Arc<AtomicBool>) -> Self {
        Self {
            address,
            heard,
            connect_timeout: CONNECT_TIMEOUT,
        }
    }

    pub fn with_connect_timeout(self, connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            ..self
        }
    }
}

impl Service<Uri> for Dial {
    type Response = hyper_util::rt::TokioIo<Heard>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<Self::Response>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let Dial {
            address,
            heard,
            connect_timeout,
        } = self.clone();
        Box::pin(async move {
            let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(address))
                .await
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connect to {address} timed out after {connect_timeout:?}"),
                    )
                })??;
            stream.set_nodelay(true)?;
            // A new connection has heard nothing yet.
            heard.store(false, Ordering::SeqCst);
            Ok(hyper_util::rt::TokioIo::new(Heard {
                inner: stream,
                heard,
            }))
        })
    }
}

/// A TCP stream that records the first byte read from it.
pub struct Heard {
    inner: TcpStream,
    heard: Arc<AtomicBool>,
}

impl AsyncRead for Heard {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.heard.store(true, Ordering::SeqCst);
        }
        polled
    }
}

impl AsyncWrite for Heard {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

    /// A real health server on a local port.
    async fn live() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    /// A port nothing listens on: connects are refused.
    async fn dead() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    }

    #[tokio::test]
    async fn calls_move_off_a_refused_and_a_silent_address_and_every_call_succeeds() {
        let (refused, live) = (dead().await, live().await);
        // The kernel completes connects into its backlog; nothing ever answers.
        let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent = frozen.local_addr().unwrap();
        let list = EndpointList::parse_with_tls(
            &format!("http://{refused},http://{silent},http://{live}"),
            None,
        )
        .unwrap();
        let mut client = HealthClient::new(Balanced::lazy(list));
        // Three calls start at each address once (round robin): each gets its answer.
        for _ in 0..6 {
            let answer = client
                .check(HealthCheckRequest::default())
                .await
                .expect("the call moved on to the live address");
            assert_eq!(answer.into_inner().status(), ServingStatus::Serving);
        }
        drop(frozen);
    }

    #[tokio::test]
    async fn an_address_that_failed_is_tried_again_once_it_listens() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let list = EndpointList::parse_with_tls(&format!("http://127.0.0.1:{port}"), None).unwrap();
        let mut client = HealthClient::new(Balanced::lazy(list));
        client
            .check(HealthCheckRequest::default())
            .await
            .expect_err("nothing listens yet");
        // The replica comes back on the same port: the address was cooled off, not dropped.
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let (_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        client
            .check(HealthCheckRequest::default())
            .await
            .expect("the restarted replica answers");
    }
}
