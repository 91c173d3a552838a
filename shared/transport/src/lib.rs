//! The runner's retrying transport: one tower layer every runner client goes through.
//!
//! The layer looks the policy up from the generated table by the request's method path
//! ([`runplane_proto::METHOD_POLICIES`]); no call site can pass or override one. Then:
//!
//! - A failure that proves the request never reached a handler (connection refused, name
//!   resolution failure, no route, connect timeout: anything tonic's connector reports;
//!   an HTTP/2 stream refused, or past a GOAWAY's last stream id) is retried for every
//!   method.
//! - A failure after the request may have been processed (reset, broken pipe, timeouts
//!   after send, `UNAVAILABLE`/`INTERNAL`/`UNKNOWN`, a response body cut short) is retried
//!   only for replay-safe methods; an unsafe method gets exactly one attempt.
//! - Backoff is exponential with full jitter (see [`Jitter`]) under the method's outage
//!   budget (3 min ordinary, 5 min terminal), spent in full, with one retry always granted
//!   so one stalled attempt cannot eat the budget. Server pushback
//!   (`grpc-retry-pushback-ms`, `google.rpc.RetryInfo`) is honoured but never below the
//!   backoff, except on `RESOURCE_EXHAUSTED`: there a positive pushback is the delay,
//!   plus up to half of it again as jitter (a shedding server paces its clients).
//!   A pushback that cannot be read (negative, garbled) stops retrying (gRFC A6).
//! - Backoff follows what the failure proves: a connect that was refused, failed or
//!   never heard back cost the server nothing and is retried on a short schedule
//!   (100 ms base, 1 s cap, full jitter); a failure after sending keeps the longer one.
//! - `RESOURCE_EXHAUSTED` is rate limiting, bounded outside the outage budget, each
//!   sleep capped at [`RetryConfig::rate_limit_max_sleep`]. One with a positive
//!   pushback is a server pacing its clients under load: it is retried for up to
//!   [`RetryConfig::rate_limit_window`] after the first, however many times (a count
//!   would give up while the server is still only pacing, as a fleet does in a refusal
//!   storm). One without pushback has a counter, [`RetryConfig::rate_limit_retries`].
//! - A token bucket per upstream (gRPC's retry throttling) notices a live server that
//!   keeps answering with failures; while it is drained, those retries are suppressed
//!   instead of amplifying the overload. A `RESOURCE_EXHAUSTED` with pushback is the
//!   server pacing its clients, not failing, and takes no token.
//! - Every attempt has a deadline from its method's class (the `deadline` module); a connection
//!   that never heard the server within [`RetryConfig::handshake_timeout`] fails the
//!   attempt as never sent. An attempt past its deadline counts as a reset (replayed only
//!   when replay-safe), and a stalled or failed connection is replaced by a fresh one to
//!   the next address ([`Upstream`]), so a wedged replica cannot trap a client.
//!
//! Unary responses are read whole before they are handed on, so a body cut mid-way is
//! seen (and retried) here rather than surfacing later in the codec. Server-streaming
//! responses are handed on as they come; only failures before their headers are retried.
//! Each carries the connection it came on ([`StreamConnection`]), so a reader that finds
//! it silent past its heartbeat ([`Watch`]) condemns that connection and re-opens on a
//! fresh one.

mod attempt;
pub mod classify;
mod config;
mod deadline;
mod retry;
mod throttle;
mod upstream;
mod watch;

use tower_layer::Layer;

pub use attempt::BoxError;
pub use classify::{Failure, Pushback};
pub use config::{Jitter, RetryConfig};
pub use retry::{Retry, RetryLayer, RetryStats};
pub use upstream::Upstream;
pub use watch::{StreamConnection, Watch, WatchError};

/// A channel every runner client uses: W3C trace context, then this layer's retries,
/// over fresh connections when one is condemned.
pub type RunnerChannel = Retry;

/// A lazily connecting channel to `endpoint` through `layer`. `endpoint` is one URI or
/// several separated by commas (replicas: an attempt that stalls or cannot connect moves
/// on to the next). Reuse one layer per upstream so its clients share the retry throttle.
pub fn connect_lazy(
    endpoint: &str,
    layer: &RetryLayer,
) -> Result<RunnerChannel, runplane_grpc::client::ClientError> {
    Ok(layer.layer(Upstream::new(endpoint, layer.config().connect_timeout)?))
}

/// [`connect_lazy`] starting at a random entry of `endpoint` ([`Upstream::spread`]),
/// for short-lived clients such as the CLI, so their calls spread over the replicas.
pub fn connect_lazy_spread(
    endpoint: &str,
    layer: &RetryLayer,
) -> Result<RunnerChannel, runplane_grpc::client::ClientError> {
    Ok(layer.layer(Upstream::spread(endpoint, layer.config().connect_timeout)?))
}
