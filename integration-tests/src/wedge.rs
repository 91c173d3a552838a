//! A TCP proxy for gRPC whose open connections can be wedged: they stop forwarding, both
//! ways, without closing, and keep answering the client's HTTP/2 PINGs. That is a replica
//! whose connection is alive (so an h2 keepalive is satisfied) but whose streams are
//! stuck, which only a stream heartbeat tells from a quiet stream. Connections opened
//! after the wedge are forwarded as before, to the backends in turn.
//!
//! The proxy reads whole HTTP/2 frames (after the client's 24-byte preface, each is a
//! 9-byte header and its payload), so it stops between frames and can write a PING ACK
//! of its own without corrupting the connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

const PREFACE_LEN: usize = 24;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_PING: u8 = 0x6;
const FLAG_ACK: u8 = 0x1;

/// The proxy; its listener and every connection's tasks stop when it is dropped.
pub struct WedgeProxy {
    addr: SocketAddr,
    state: Arc<ProxyState>,
}

/// What the proxy's listener and connections share: where they forward and what they counted.
struct ProxyState {
    backends: Vec<String>,
    next_backend: AtomicUsize,
    /// Connections numbered below this are wedged.
    wedged_below: AtomicU64,
    accepted: AtomicU64,
    /// Pings the proxy answered itself on wedged connections.
    pings_answered: AtomicU64,
    /// HEADERS frames forwarded from a server: each response's headers (and trailers).
    headers_forwarded: AtomicU64,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl WedgeProxy {
    /// Listens on a free local port and forwards each connection to the next of
    /// `backends` (`host:port`).
    pub async fn start(backends: &[String]) -> Self {
        assert!(!backends.is_empty(), "a proxy needs a backend");
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(ProxyState {
            backends: backends.to_vec(),
            next_backend: AtomicUsize::new(0),
            wedged_below: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            pings_answered: AtomicU64::new(0),
            headers_forwarded: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
        });
        let accept = {
            let state = state.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let id = state.accepted.fetch_add(1, Ordering::SeqCst);
                    let i = state.next_backend.fetch_add(1, Ordering::SeqCst);
                    let backend = state.backends[i % state.backends.len()].clone();
                    let task = tokio::spawn(connection(state.clone(), id, client, backend));
                    state.tasks.lock().unwrap().push(task.abort_handle());
                }
            })
        };
        state.tasks.lock().unwrap().push(accept.abort_handle());
        Self { addr, state }
    }

    /// `http://ADDR`, for clients.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every connection open now stops forwarding at its next frame boundary, both ways,
    /// and is never closed by the proxy; it answers the client's PINGs from now on.
    pub fn wedge_open_connections(&self) {
        let accepted = self.state.accepted.load(Ordering::SeqCst);
        self.state.wedged_below.store(accepted, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// PINGs the proxy answered itself on wedged connections.
    pub fn pings_answered(&self) -> u64 {
        self.state.pings_answered.load(Ordering::SeqCst)
    }

    /// HEADERS frames forwarded from the servers: a server stream's response headers
    /// come as soon as it is open, so this says a watch is open before anything is on it.
    pub fn headers_forwarded(&self) -> u64 {
        self.state.headers_forwarded.load(Ordering::SeqCst)
    }
}

impl Drop for WedgeProxy {
    fn drop(&mut self) {
        for task in self.state.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

async fn connection(state: Arc<ProxyState>, id: u64, client: TcpStream, backend: String) {
    let Ok(server) = TcpStream::connect(&backend).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
    let wedged = {
        let state = state.clone();
        move || id < state.wedged_below.load(Ordering::SeqCst)
    };
    let up = upstream(
        state.clone(),
        client_read,
        server_write,
        client_write.clone(),
        wedged.clone(),
    );
    let down = downstream(state.clone(), server_read, client_write, wedged);
    // Either direction ending (a close) ends the connection; a wedged one never ends.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Reads one frame: its 9-byte header and payload.
async fn frame(from: &mut OwnedReadHalf) -> Option<Vec<u8>> {
    let mut header = [0u8; 9];
    from.read_exact(&mut header).await.ok()?;
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut frame = header.to_vec();
    frame.resize(9 + len, 0);
    from.read_exact(&mut frame[9..]).await.ok()?;
    Some(frame)
}

/// Client to server: the preface, then frames; once wedged, the client's PINGs are
/// answered here and everything else is dropped.
async fn upstream(
    state: Arc<ProxyState>,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    wedged: impl Fn() -> bool,
) {
    let mut preface = [0u8; PREFACE_LEN];
    if from.read_exact(&mut preface).await.is_err() || to.write_all(&preface).await.is_err() {
        return;
    }
    while let Some(mut frame) = frame(&mut from).await {
        if !wedged() {
            if to.write_all(&frame).await.is_err() {
                return;
            }
            continue;
        }
        if frame[3] == FRAME_PING && frame[4] & FLAG_ACK == 0 {
            frame[4] |= FLAG_ACK;
            if client.lock().await.write_all(&frame).await.is_err() {
                return;
            }
            state.pings_answered.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Server to client, whole frames; once wedged, nothing more is read or forwarded.
async fn downstream(
    state: Arc<ProxyState>,
    mut from: OwnedReadHalf,
    client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    wedged: impl Fn() -> bool,
) {
    while let Some(frame) = frame(&mut from).await {
        if wedged() {
            // Hold both sockets open, forwarding nothing, until the proxy is dropped.
            std::future::pending::<()>().await;
        }
        if client.lock().await.write_all(&frame).await.is_err() {
            return;
        }
        if frame[3] == FRAME_HEADERS {
            state.headers_forwarded.fetch_add(1, Ordering::SeqCst);
        }
    }
}
