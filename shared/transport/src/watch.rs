//! Watch streams (WatchRun, WatchNotices, Tail) that a silent connection cannot trap.
//!
//! A server stream's response headers are bounded like any attempt, but once it is open
//! the transport hands it on as it comes: a stream may rightly be quiet for hours. What
//! tells a quiet stream from a dead one is the server's heartbeat
//! ([`runplane_grpc::heartbeat`]): [`Watch`] reads a stream under the allowance of the
//! interval its request asked for, and a stream that sent nothing, not even a heartbeat,
//! for that long is dead. Its connection is condemned as a stalled unary attempt's is
//! ([`Upstream`]), so the caller's re-open from its cursor goes out on a fresh connection
//! to the next address, never back onto the wedged one. An h2 keepalive does not catch
//! this: a replica whose connection answers pings while its stream is stuck looks alive.

use std::sync::Arc;
use std::time::Duration;

use crate::upstream::Upstream;

/// The connection a server stream came on; the transport attaches it to the response's
/// extensions.
#[derive(Clone)]
pub struct StreamConnection {
    pub(crate) upstream: Upstream,
    pub(crate) generation: u64,
    pub(crate) address: Arc<str>,
}

impl std::fmt::Debug for StreamConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConnection")
            .field("address", &self.address)
            .field("generation", &self.generation)
            .finish()
    }
}

impl StreamConnection {
    /// The address the connection went to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The next call goes out on a fresh connection to the next address (a no-op when
    /// another call already replaced this connection).
    pub fn condemn(&self) {
        self.upstream.replace(self.generation);
    }
}

/// Why [`Watch::message`] gave a stream up.
#[derive(Debug)]
pub enum WatchError {
    /// Nothing, not even a heartbeat, within the allowance: the stream is dead and its
    /// connection condemned.
    Silent {
        address: Option<String>,
        allowance: Duration,
    },
    /// The stream ended with this status (a reset, a restart, a refusal).
    Status(tonic::Status),
}

impl std::fmt::Display for WatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WatchError::Silent { address, allowance } => {
                write!(f, "nothing, not even a heartbeat, for {allowance:?}")?;
                if let Some(a) = address {
                    write!(f, " from {a}")?;
                }
                Ok(())
            }
            WatchError::Status(s) => write!(f, "{:?}: {}", s.code(), s.message()),
        }
    }
}

impl std::error::Error for WatchError {}

/// A server stream read under its heartbeat allowance.
pub struct Watch<T> {
    stream: tonic::Streaming<T>,
    connection: Option<StreamConnection>,
    allowance: Duration,
}

impl<T> Watch<T> {
    /// `response` is the opened stream; `heartbeat` the `heartbeat_interval` its request
    /// asked for (what the server defaults to when it asked for none).
    pub fn new(response: tonic::Response<tonic::Streaming<T>>, heartbeat: Duration) -> Self {
        let connection = response.extensions().get::<StreamConnection>().cloned();
        Self {
            stream: response.into_inner(),
            connection,
            allowance: runplane_grpc::heartbeat::allowance(heartbeat),
        }
    }

    /// The connection the stream came on, when it came through the transport.
    pub fn connection(&self) -> Option<&StreamConnection> {
        self.connection.as_ref()
    }

    /// The next item, or `None` at the stream's end. Past the allowance with nothing
    /// heard, the stream's connection is condemned and this is [`WatchError::Silent`]:
    /// drop the stream and re-open it from the cursor.
    pub async fn message(&mut self) -> Result<Option<T>, WatchError> {
        match tokio::time::timeout(self.allowance, self.stream.message()).await {
            Ok(item) => item.map_err(WatchError::Status),
            Err(_) => {
                if let Some(c) = &self.connection {
                    tracing::warn!(
                        address = %c.address,
                        allowance_ms = self.allowance.as_millis() as u64,
                        "watch stream silent past its heartbeat allowance; condemning its connection"
                    );
                    c.condemn();
                }
                Err(WatchError::Silent {
                    address: self.connection.as_ref().map(|c| c.address.to_string()),
                    allowance: self.allowance,
                })
            }
        }
    }
}
