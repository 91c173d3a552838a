//! Plumbing every runplane gRPC server and client goes through.
//!
//! - [`server::ServiceSet`] and [`server::serve`]: health per service (NOT_SERVING while
//!   shutting down), reflection v1 and v1alpha, a request span per call joined to the
//!   caller's W3C trace context, graceful shutdown with a deadline.
//! - [`client`]: channels that inject the current trace context into every request.
//! - [`error`]: `tonic::Status` with `google.rpc.ErrorInfo` carrying a stable reason.
//! - [`shutdown_signal`]: SIGTERM or SIGINT.

pub mod client;
pub mod error;
pub mod server;
pub mod trace_context;

pub use error::{ErrorReason, error_info, status_with_reason};
pub use server::{ServiceSet, serve};

/// Resolves on SIGTERM or SIGINT (Ctrl-C), whichever comes first.
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("install SIGTERM handler");
        tokio::select! {
            _ = interrupt => tracing::info!(signal = "SIGINT", "shutting down"),
            _ = terminate.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
        tracing::info!(signal = "ctrl-c", "shutting down");
    }
}
