//! The addresses a client may reach and the connection it uses now.
//!
//! A stalled attempt must be retried on a *new* connection: an h2 connection to a hung
//! replica stays "healthy" (nothing resets it), so retrying on it waits on the same
//! replica again. On a failure that condemns the connection (an attempt past its
//! deadline, a connect that failed, a server silent since the connection opened) the
//! retry layer calls [`Upstream::replace`], which moves to the next address (behind one
//! balancer address: a fresh connection, which the balancer may place elsewhere).
//!
//! The addresses come from the shared endpoint-list parser
//! ([`runplane_grpc::endpoints`]): a URI whose host is a name is resolved at every
//! connect, and each new connection takes the name's next address (from a random first
//! one, so a fleet spreads over a headless Service's pods), so replacing a connection
//! to a frozen pod reaches another pod rather than the same first address again.
//!
//! Each connection records whether the server ever sent a byte. An h2 server sends its
//! SETTINGS before it reads a request, so a connection that heard nothing proves that
//! nothing sent on it reached a handler.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use runplane_grpc::balance::{Dial, Heard};
use runplane_grpc::client::ClientError;
use runplane_grpc::endpoints::{EndpointList, Target};
use runplane_grpc::trace_context::{ClientTrace, ClientTraceLayer};
use tonic::transport::{Channel, Uri};
use tower_layer::Layer as _;

/// One connection's channel, with trace context.
pub(crate) type ConnChannel = ClientTrace<Channel>;

/// The connection an attempt goes out on.
#[derive(Clone)]
pub(crate) struct Conn {
    pub generation: u64,
    pub channel: ConnChannel,
    /// The server has sent at least one byte on the current connection.
    pub heard: Arc<AtomicBool>,
    pub address: Arc<str>,
}

/// Every address of one upstream, and the connection in use.
#[derive(Clone)]
pub struct Upstream {
    endpoints: EndpointList,
    connect_timeout: Duration,
    state: Arc<Mutex<State>>,
    replaced: Arc<AtomicU64>,
    /// Which address of a name the next connection takes.
    turn: Arc<AtomicUsize>,
}

struct State {
    index: usize,
    conn: Conn,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("addresses", &self.endpoints.shown())
            .finish()
    }
}

impl Upstream {
    /// `endpoints` is an endpoint list ([`runplane_grpc::endpoints`]); its first entry
    /// is used first.
    pub fn new(endpoints: &str, connect_timeout: Duration) -> Result<Self, ClientError> {
        Self::starting_at(endpoints, connect_timeout, |_| 0)
    }

    /// [`Upstream::new`] starting at a random entry, so many short-lived clients (the
    /// CLI) spread over the replicas instead of all landing on the first.
    pub fn spread(endpoints: &str, connect_timeout: Duration) -> Result<Self, ClientError> {
        Self::starting_at(endpoints, connect_timeout, |n| rand::random_range(0..n))
    }

    fn starting_at(
        endpoints: &str,
        connect_timeout: Duration,
        first: impl FnOnce(usize) -> usize,
    ) -> Result<Self, ClientError> {
        let endpoints = EndpointList::parse(endpoints)?;
        let index = first(endpoints.targets().len());
        let turn = Arc::new(AtomicUsize::new(rand::random_range(0..1024)));
        let conn = open(&endpoints.targets()[index], 0, connect_timeout, &turn);
        Ok(Self {
            endpoints,
            connect_timeout,
            state: Arc::new(Mutex::new(State { index, conn })),
            replaced: Arc::default(),
            turn,
        })
    }

    pub(crate) fn current(&self) -> Conn {
        self.state.lock().expect("upstream poisoned").conn.clone()
    }

    /// Condemns the connection of `generation`: the next attempt goes out on a fresh
    /// connection to the next address. A no-op when another attempt already replaced it.
    pub(crate) fn replace(&self, generation: u64) {
        let mut state = self.state.lock().expect("upstream poisoned");
        if state.conn.generation != generation {
            return;
        }
        let targets = self.endpoints.targets();
        state.index = (state.index + 1) % targets.len();
        state.conn = open(
            &targets[state.index],
            generation + 1,
            self.connect_timeout,
            &self.turn,
        );
        self.replaced.fetch_add(1, Ordering::Relaxed);
        tracing::info!(address = %state.conn.address, "moving to a new connection");
    }

    /// How many times a connection was condemned and replaced.
    pub fn replacements(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }
}

fn open(
    target: &Target,
    generation: u64,
    connect_timeout: Duration,
    turn: &Arc<AtomicUsize>,
) -> Conn {
    let heard = Arc::new(AtomicBool::new(false));
    let channel = target.endpoint().connect_with_connector_lazy(Connector {
        target: target.clone(),
        heard: heard.clone(),
        connect_timeout,
        turn: turn.clone(),
    });
    Conn {
        generation,
        channel: ClientTraceLayer.layer(channel),
        heard,
        address: target.shown().clone(),
    }
}

/// Resolves the target and dials one of its addresses, taking turns.
#[derive(Clone)]
struct Connector {
    target: Target,
    heard: Arc<AtomicBool>,
    connect_timeout: Duration,
    turn: Arc<AtomicUsize>,
}

impl tower_service::Service<Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<Heard>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<Self::Response>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let address: SocketAddr = match this.target.literal() {
                Some(address) => address,
                None => {
                    let addresses = this.target.resolve().await?;
                    addresses[this.turn.fetch_add(1, Ordering::Relaxed) % addresses.len()]
                }
            };
            Dial::new(address, this.heard)
                .with_connect_timeout(this.connect_timeout)
                .call(uri)
                .await
        })
    }
}
