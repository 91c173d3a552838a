//! The addresses a client may reach and the connection it uses now.
//!
//! A stalled attempt must be retried on a *new* connection: an h2 connection to a hung
//! replica stays "healthy" (nothing resets it), so retrying on it waits on the same
//! replica again. On a failure that condemns the connection (an attempt past its
//! deadline, a connect that failed, a server silent since the connection opened) the
//! retry layer calls [`Upstream::replace`], which moves to the next address (behind one
//! balancer address: a fresh connection, which the balancer may place elsewhere).
//!
//! Each connection records whether the server ever sent a byte. An h2 server sends its
//! SETTINGS before it reads a request, so a connection that heard nothing proves that
//! nothing sent on it reached a handler.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use hyper_util::rt::TokioIo;
use runplane_grpc::client::{ClientError, TracedChannel};
use runplane_grpc::trace_context::ClientTraceLayer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::{Endpoint, Uri};
use tower_layer::Layer as _;

/// The connection an attempt goes out on.
#[derive(Clone)]
pub(crate) struct Conn {
    pub generation: u64,
    pub channel: TracedChannel,
    /// The server has sent at least one byte on the current connection.
    pub heard: Arc<AtomicBool>,
    pub address: Arc<str>,
}

/// Every address of one upstream, and the connection in use.
#[derive(Clone)]
pub struct Upstream {
    endpoints: Arc<[(Arc<str>, Endpoint)]>,
    connect_timeout: Duration,
    state: Arc<Mutex<State>>,
    replaced: Arc<AtomicU64>,
}

struct State {
    index: usize,
    conn: Conn,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addresses: Vec<&str> = self.endpoints.iter().map(|(a, _)| &**a).collect();
        f.debug_struct("Upstream")
            .field("addresses", &addresses)
            .finish()
    }
}

impl Upstream {
    /// `endpoints` is one URI or several separated by commas; the first is used first.
    pub fn new(endpoints: &str, connect_timeout: Duration) -> Result<Self, ClientError> {
        let tls = runplane_grpc::tls::client();
        let endpoints: Vec<(Arc<str>, Endpoint)> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|uri| {
                runplane_grpc::client::endpoint_settings(uri, tls.as_ref())
                    .map(|e| (Arc::<str>::from(uri), e))
            })
            .collect::<Result<_, _>>()?;
        if endpoints.is_empty() {
            return Err(ClientError::InvalidEndpoint {
                endpoint: String::new(),
                reason: "no endpoint given".into(),
            });
        }
        let conn = open(&endpoints[0], 0, connect_timeout);
        Ok(Self {
            endpoints: endpoints.into(),
            connect_timeout,
            state: Arc::new(Mutex::new(State { index: 0, conn })),
            replaced: Arc::default(),
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
        state.index = (state.index + 1) % self.endpoints.len();
        state.conn = open(
            &self.endpoints[state.index],
            generation + 1,
            self.connect_timeout,
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
    (address, endpoint): &(Arc<str>, Endpoint),
    generation: u64,
    connect_timeout: Duration,
) -> Conn {
    let heard = Arc::new(AtomicBool::new(false));
    let channel = endpoint.connect_with_connector_lazy(Connector {
        heard: heard.clone(),
        connect_timeout,
    });
    Conn {
        generation,
        channel: ClientTraceLayer.layer(channel),
        heard,
        address: address.clone(),
    }
}

/// TCP with a bounded connect, marking when the server first speaks.
#[derive(Clone)]
struct Connector {
    heard: Arc<AtomicBool>,
    connect_timeout: Duration,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Heard>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<TokioIo<Heard>>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let heard = self.heard.clone();
        let connect_timeout = self.connect_timeout;
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
                Some("https") => 443,
                _ => 80,
            });
            let stream = tokio::time::timeout(connect_timeout, TcpStream::connect((host, port)))
                .await
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connect timed out after {connect_timeout:?}"),
                    )
                })??;
            stream.set_nodelay(true)?;
            // A new connection has heard nothing yet.
            heard.store(false, Ordering::SeqCst);
            Ok(TokioIo::new(Heard {
                inner: stream,
                heard,
            }))
        })
    }
}

/// A TCP stream that records the first byte read from it.
pub(crate) struct Heard {
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
