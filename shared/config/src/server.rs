//! `[server]`: the gRPC server every service runs on.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

use serde::Deserialize;

use crate::checks::{between, in_range};
use crate::error::ConfigError;

/// Default address the services listen on.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address the gRPC server listens on.
    pub listen: String,
    /// How long in-flight calls get to finish after SIGTERM/SIGINT.
    pub shutdown_grace_seconds: u64,
    /// HTTP/2 streams one connection may have open at once; a well-behaved client
    /// queues past it, a stream opened anyway is refused (REFUSED_STREAM).
    pub max_concurrent_streams: u32,
    /// Streams of one connection the server may reset for the client's errors
    /// (refused, malformed) before it closes the connection with ENHANCE_YOUR_CALM:
    /// the reset-flood guard (RUSTSEC-2024-0003).
    pub max_local_error_reset_streams: u32,
    /// An HTTP/2 PING after this many idle seconds on a connection; 0 for none.
    pub keepalive_interval_seconds: u64,
    /// A connection whose PING is unanswered this many seconds is closed.
    pub keepalive_timeout_seconds: u64,
    /// A connection older than this many seconds is sent GOAWAY, so clients behind an L4
    /// balancer spread out again; 0 for no limit.
    pub max_connection_age_seconds: u64,
    /// How long calls on an aged-out connection get to finish before it is closed.
    pub max_connection_age_grace_seconds: u64,
    /// The largest request message a service decodes, in bytes; a larger one is refused
    /// (INVALID_ARGUMENT, MESSAGE_TOO_LARGE) before its handler runs.
    pub max_decoding_message_bytes: u32,
    /// Per-service overrides of `max_decoding_message_bytes`, by full service name
    /// (e.g. `"runplane.runstore.v1.RunnerService" = 2097152`).
    pub max_decoding_message_bytes_by_service: BTreeMap<String, u32>,
    /// Ordinary calls (not long polls or streams) one service handles at once; past it a
    /// call waits up to `overload_queue_ms` for a slot, then is refused with
    /// RESOURCE_EXHAUSTED (RATE_LIMITED) and pushback. 0 for no limit.
    pub max_concurrent_requests: u32,
    /// Per-service overrides of `max_concurrent_requests`, by full service name.
    pub max_concurrent_requests_by_service: BTreeMap<String, u32>,
    /// The pushback a shed call is told to wait, in milliseconds.
    pub overload_pushback_ms: u64,
    /// How long a call over the limit waits for a slot, in arrival order, before it is
    /// shed, in milliseconds: a burst is served in order instead of refused and retried
    /// at random. 0 sheds at once.
    pub overload_queue_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN.to_owned(),
            shutdown_grace_seconds: 10,
            max_concurrent_streams: 256,
            max_local_error_reset_streams: 1024,
            keepalive_interval_seconds: 30,
            keepalive_timeout_seconds: 10,
            max_connection_age_seconds: 0,
            max_connection_age_grace_seconds: 60,
            max_decoding_message_bytes: 4 * 1024 * 1024,
            max_decoding_message_bytes_by_service: Default::default(),
            max_concurrent_requests: 512,
            max_concurrent_requests_by_service: Default::default(),
            overload_pushback_ms: 250,
            overload_queue_ms: 100,
        }
    }
}

/// Where other services and runners reach a service by default: this process's own
/// listen address, for a single-process deployment.
pub(crate) fn default_endpoint() -> String {
    format!("http://{DEFAULT_LISTEN}")
}

impl ServerConfig {
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            ConfigError::invalid(
                "server.listen",
                format!(
                    "`{}` is not a socket address such as 127.0.0.1:7070",
                    self.listen
                ),
            )
        })
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_seconds)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        in_range(
            "server.shutdown_grace_seconds",
            self.shutdown_grace_seconds,
            1..=600,
        )?;
        self.validate_limits()
    }

    /// The connection, message and load limits.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        if self.max_concurrent_streams == 0 {
            return Err(ConfigError::invalid(
                "server.max_concurrent_streams",
                "must be at least 1",
            ));
        }
        if self.max_local_error_reset_streams == 0 {
            return Err(ConfigError::invalid(
                "server.max_local_error_reset_streams",
                "must be at least 1",
            ));
        }
        if self.keepalive_interval_seconds > 0 && self.keepalive_timeout_seconds == 0 {
            return Err(ConfigError::invalid(
                "server.keepalive_timeout_seconds",
                "must be at least 1 when keepalive_interval_seconds is set",
            ));
        }
        const MESSAGE_BYTES: RangeInclusive<u32> = 1024..=(64 * 1024 * 1024);
        in_range(
            "server.max_decoding_message_bytes",
            self.max_decoding_message_bytes,
            MESSAGE_BYTES,
        )?;
        for (service, bytes) in &self.max_decoding_message_bytes_by_service {
            if !MESSAGE_BYTES.contains(bytes) {
                return Err(ConfigError::invalid(
                    "server.max_decoding_message_bytes_by_service",
                    format!("{service}: {}", between(&MESSAGE_BYTES)),
                ));
            }
        }
        in_range(
            "server.overload_pushback_ms",
            self.overload_pushback_ms,
            1..=60_000,
        )?;
        in_range(
            "server.overload_queue_ms",
            self.overload_queue_ms,
            0..=10_000,
        )?;
        Ok(())
    }
}
