//! Plumbing every runplane gRPC server and client goes through.
//!
//! - [`server::ServiceSet`] and [`server::serve`]: health per service (NOT_SERVING while
//!   shutting down), reflection v1 and v1alpha, a request span per call joined to the
//!   caller's W3C trace context, graceful shutdown with a deadline.
//! - [`auth`]: who is calling; each method admits the callers its proto names.
//! - [`guard`]: a call without a well-formed bearer, or a message over its service's
//!   decoding limit, is refused before any handler reads the body.
//! - [`shed`]: past its concurrency limit a call waits a short, bounded time for a slot
//!   in arrival order, then is answered `RESOURCE_EXHAUSTED` with pushback.
//! - [`client`]: channels that inject the current trace context into every request.
//! - [`endpoints`] and [`balance`]: endpoint lists (replicas, names with several
//!   addresses) and the channel that spreads calls over them and moves off failures.
//! - [`heartbeat`]: how often watch streams send heartbeats, and how long a client waits.
//! - [`wake`]: keyed wake-ups, so a long poll or a watch wakes for its own key only.
//! - [`tasks`]: background work, declared: named, with what cancellation and a panic
//!   mean, awaited within the shutdown grace.
//! - [`tls`]: rustls TLS and mutual TLS of servers and `https://` channels, from `[tls]`.
//! - [`error`]: `tonic::Status` with `google.rpc.ErrorInfo` carrying a stable reason.
//! - [`shutdown_signal`]: SIGTERM or SIGINT.

pub mod auth;
pub mod balance;
pub mod client;
pub mod endpoints;
pub mod error;
pub mod guard;
pub mod heartbeat;
mod method;
pub mod notifier;
pub mod server;
pub mod shed;
pub mod tasks;
pub mod tls;
pub mod trace_context;

pub use error::{ErrorReason, ServiceError, error_info, into_status, status_with_reason};
pub use server::{ServerLimits, ServiceSet, Stopped, serve, serve_with_tls};
pub use tasks::{Cancelled, OnCancel, OnPanic, Task, Tasks};

/// A `std::time::Duration` as the protobuf `Duration` the contract carries.
pub fn proto_duration(d: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs().min(i64::MAX as u64) as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// A list's page size: 0 means `default`, otherwise 1 to 500. The error is the reason
/// for an INVALID_ARGUMENT on `page_size`.
pub fn page_size(requested: u32, default: u32) -> Result<u32, &'static str> {
    match requested {
        0 => Ok(default),
        n @ 1..=500 => Ok(n),
        _ => Err("must be 0 to 500"),
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C), whichever comes first.
///
/// The handlers are installed when this is called, not when the future is first polled,
/// so call it before announcing readiness: a signal that arrives in between is caught
/// instead of killing the process.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        let mut terminate = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        async move {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
                _ = terminate.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!(signal = "ctrl-c", "shutting down");
        }
    }
}
