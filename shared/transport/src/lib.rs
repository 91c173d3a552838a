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

mod classify;
mod deadline;
mod upstream;
mod watch;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use runplane_proto::{MethodPolicy, OutageBudget, ReplaySafety};
use runplane_telemetry::metrics;
use tokio::time::Instant;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

pub use classify::{Failure, Pushback};
pub use upstream::Upstream;
use upstream::{Conn, ConnChannel};
pub use watch::{StreamConnection, Watch, WatchError};

/// Errors the layer returns: the inner channel's, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How backoff delays are drawn from the exponential ceiling `min(cap, base * 2^n)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in `[0, ceiling]`. runplane's choice: for a given longest wait, a uniform
    /// spread gives a server that just came back the lowest peak (arrivals spread over the
    /// whole window, not bunched in its upper half) and the shortest mean resume lag
    /// (a third of the cap rather than nearly two fifths of it).
    Full,
    /// Uniform in `[ceiling/2, ceiling]`: the seed's policy, kept for comparison.
    Equal,
}

/// The retry policy's numbers; the per-method part comes from the proto options.
#[derive(Debug, Clone)]
pub struct RetryConfig {
    pub base: Duration,
    pub cap: Duration,
    pub jitter: Jitter,
    /// Outage budget of ordinary methods.
    pub ordinary_budget: Duration,
    /// Outage budget of terminal methods (results).
    pub terminal_budget: Duration,
    /// Most `RESOURCE_EXHAUSTED` answers without pushback retried in one call.
    pub rate_limit_retries: u32,
    /// How long after its first `RESOURCE_EXHAUSTED` with pushback a call keeps being
    /// paced by the server (retried when the pushback says) before it gives up; `None`
    /// counts those against `rate_limit_retries` too (the seed's policy).
    pub rate_limit_window: Option<Duration>,
    /// Longest sleep before retrying a `RESOURCE_EXHAUSTED`, whatever the pushback says.
    pub rate_limit_max_sleep: Duration,
    /// Backoff after a connect that was refused, failed or never heard back: it cost
    /// the server nothing, so it is short (full jitter, exponential from the base).
    pub connect_base: Duration,
    pub connect_cap: Duration,
    /// Whether such a connect gets that short schedule at all; off, it backs off like
    /// any other failure (the seed's policy had no connect schedule).
    pub short_connect_schedule: bool,
    /// Retry throttle: bucket size and what a success puts back.
    pub throttle_max_tokens: f64,
    pub throttle_token_ratio: f64,
    /// Deadline of one attempt of an ordinary unary call (sent as `grpc-timeout`), and
    /// how long any attempt may wait for its response headers.
    pub attempt_timeout: Duration,
    /// A long poll's attempt deadline is its request's wait plus this.
    pub long_poll_margin: Duration,
    /// How long a TCP connect may take.
    pub connect_timeout: Duration,
    /// How long a connection may stay silent (not one byte, not even the server's
    /// SETTINGS) before an attempt on it counts as never sent.
    pub handshake_timeout: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            // Measured with `cargo bench -p runplane-runner --bench outage`: a 1 s base keeps
            // the attempts a thousand runners make during a 10 s outage at the seed's level,
            // and a 6 s cap bounds how long a runner waits after the port reopens.
            base: Duration::from_secs(1),
            cap: Duration::from_secs(6),
            jitter: Jitter::Full,
            ordinary_budget: Duration::from_secs(OutageBudget::Ordinary.seconds()),
            terminal_budget: Duration::from_secs(OutageBudget::Terminal.seconds()),
            rate_limit_retries: 10,
            rate_limit_window: Some(Duration::from_secs(120)),
            rate_limit_max_sleep: Duration::from_secs(30),
            connect_base: Duration::from_millis(100),
            connect_cap: Duration::from_secs(1),
            short_connect_schedule: true,
            throttle_max_tokens: 10.0,
            throttle_token_ratio: 0.1,
            attempt_timeout: Duration::from_secs(10),
            long_poll_margin: Duration::from_secs(5),
            connect_timeout: runplane_grpc::client::CONNECT_TIMEOUT,
            handshake_timeout: Duration::from_secs(3),
        }
    }
}

impl RetryConfig {
    /// The seed's policy (500 ms base, 10 s cap, equal jitter, one schedule for every
    /// failure and no retry throttle), for comparisons.
    pub fn seed() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(10),
            jitter: Jitter::Equal,
            short_connect_schedule: false,
            rate_limit_window: None,
            // A bucket that never drains.
            throttle_max_tokens: 1e12,
            ..Self::default()
        }
    }

    fn budget(&self, class: OutageBudget) -> Duration {
        match class {
            OutageBudget::Ordinary => self.ordinary_budget,
            OutageBudget::Terminal => self.terminal_budget,
        }
    }

    /// The delay before retry number `retry` (0-based) after a failed connect: full
    /// jitter under `min(connect_cap, connect_base * 2^retry)`.
    pub fn connect_backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .connect_base
            .saturating_mul(2u32.saturating_pow(retry.min(30)))
            .min(self.connect_cap);
        Duration::from_millis(rand::random_range(0..=ceiling.as_millis() as u64))
    }

    /// The delay before retry number `retry` (0-based).
    pub fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(2u32.saturating_pow(retry.min(30)))
            .min(self.cap);
        let ceiling_ms = ceiling.as_millis() as u64;
        let floor_ms = match self.jitter {
            Jitter::Full => 0,
            Jitter::Equal => ceiling_ms / 2,
        };
        Duration::from_millis(rand::random_range(floor_ms..=ceiling_ms))
    }
}

/// Retries by classification, for metrics and tests.
#[derive(Debug, Default)]
pub struct RetryStats {
    pub proven_not_sent: AtomicU64,
    pub maybe_processed: AtomicU64,
    pub rate_limited: AtomicU64,
    /// Retries the drained throttle suppressed.
    pub throttled: AtomicU64,
    /// Calls that ended in a failure after retrying (budget spent or not replay-safe).
    pub gave_up: AtomicU64,
    /// Every attempt sent, first ones included.
    pub attempts: AtomicU64,
    /// The delays chosen before retries, oldest first (the first 1,024).
    pub delays: Mutex<Vec<Duration>>,
}

impl RetryStats {
    pub fn retries(&self) -> u64 {
        self.proven_not_sent.load(Ordering::Relaxed)
            + self.maybe_processed.load(Ordering::Relaxed)
            + self.rate_limited.load(Ordering::Relaxed)
    }
}

/// gRPC's retry throttling: failures answered by a live server take a token, successes
/// give back a fraction; below half the bucket, retries stop amplifying.
#[derive(Debug)]
struct Throttle {
    tokens: Mutex<f64>,
    max: f64,
    ratio: f64,
}

impl Throttle {
    fn failure(&self) {
        let mut t = self.tokens.lock().expect("throttle poisoned");
        *t = (*t - 1.0).max(0.0);
    }

    fn success(&self) {
        let mut t = self.tokens.lock().expect("throttle poisoned");
        *t = (*t + self.ratio).min(self.max);
    }

    fn drained(&self) -> bool {
        *self.tokens.lock().expect("throttle poisoned") <= self.max / 2.0
    }
}

/// The layer. Build one per upstream: the throttle is per upstream.
#[derive(Debug, Clone)]
pub struct RetryLayer {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    config: RetryConfig,
    table: &'static [MethodPolicy],
    throttle: Throttle,
    stats: Arc<RetryStats>,
}

impl RetryLayer {
    /// runplane's policy table with `config`'s numbers.
    pub fn new(config: RetryConfig) -> Self {
        Self::with_table(config, runplane_proto::METHOD_POLICIES)
    }

    /// Another (sorted) policy table; tests use one with an unsafe method.
    pub fn with_table(config: RetryConfig, table: &'static [MethodPolicy]) -> Self {
        Self {
            shared: Arc::new(Shared {
                throttle: Throttle {
                    tokens: Mutex::new(config.throttle_max_tokens),
                    max: config.throttle_max_tokens,
                    ratio: config.throttle_token_ratio,
                },
                config,
                table,
                stats: Arc::default(),
            }),
        }
    }

    pub fn stats(&self) -> Arc<RetryStats> {
        self.shared.stats.clone()
    }

    pub fn config(&self) -> &RetryConfig {
        &self.shared.config
    }
}

impl Layer<Upstream> for RetryLayer {
    type Service = Retry;

    fn layer(&self, upstream: Upstream) -> Retry {
        Retry {
            upstream,
            shared: self.shared.clone(),
        }
    }
}

/// Records how much outage budget a call that retried spent.
fn record_budget_spent(method: &impl std::fmt::Display, spent: Duration) {
    metrics::outage_budget_spent().record(
        spent.as_secs_f64(),
        &[metrics::attr("method", method.to_string())],
    );
}

/// The retrying service, over the connections of one upstream.
#[derive(Debug, Clone)]
pub struct Retry {
    upstream: Upstream,
    shared: Arc<Shared>,
}

impl Retry {
    /// The upstream this service sends to.
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }
}

/// A method the table does not know is treated as unsafe: only provably unsent
/// requests are sent again.
const UNKNOWN: MethodPolicy = MethodPolicy {
    path: "",
    replay_safety: ReplaySafety::Unsafe,
    key_field: None,
    outage_budget: OutageBudget::Ordinary,
    justification: "not in the policy table",
    client_streaming: false,
    server_streaming: false,
    long_poll_wait_field: None,
    callers: runplane_proto::Callers::of(&[]),
};

impl Service<http::Request<Body>> for Retry {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<http::Response<Body>, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is awaited per attempt inside the call, where failures are retried.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let upstream = self.upstream.clone();
        let shared = self.shared.clone();
        Box::pin(async move { shared.call(upstream, request).await })
    }
}

/// What one attempt came to.
enum Attempt {
    Done(http::Response<Body>),
    Failed {
        failure: Failure,
        /// The response to hand on if this failure is final (a gRPC status), or the error.
        last: Result<http::Response<Body>, BoxError>,
        pushback: Pushback,
        /// The connection is condemned: retry on a new one.
        reconnect: bool,
    },
}

impl Attempt {
    fn error(failure: Failure, status: tonic::Status) -> Self {
        Attempt::Failed {
            failure,
            last: Err(Box::new(status)),
            pushback: Pushback::None,
            reconnect: true,
        }
    }
}

impl Shared {
    async fn call(
        &self,
        upstream: Upstream,
        request: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let path = request.uri().path().to_owned();
        let policy = runplane_proto_policy_lookup(self.table, &path).unwrap_or(&UNKNOWN);
        let (parts, body) = request.into_parts();
        // Requests of the runner's methods are single messages; keep them to resend.
        let body = body
            .collect()
            .await
            .map_err(|e| Box::new(e) as BoxError)?
            .to_bytes();
        let deadline = deadline::of(&self.config, policy.call_class(), &parts.headers, &body);
        let budget = self.config.budget(policy.outage_budget);
        let started = Instant::now();
        let mut retries: u32 = 0;
        let mut rate_limited: u32 = 0;
        // When the server first paced this call with a pushback.
        let mut first_paced: Option<Instant> = None;

        loop {
            self.stats.attempts.fetch_add(1, Ordering::Relaxed);
            let conn = upstream.current();
            let attempt = self
                .bounded(
                    &conn,
                    rebuild(&parts, body.clone(), deadline),
                    policy,
                    deadline,
                )
                .await;
            let (failure, last, pushback, condemned) = match attempt {
                Attempt::Done(mut response) => {
                    if policy.server_streaming {
                        response.extensions_mut().insert(StreamConnection {
                            upstream: upstream.clone(),
                            generation: conn.generation,
                            address: conn.address.clone(),
                        });
                    }
                    self.throttle.success();
                    if retries + rate_limited > 0 {
                        record_budget_spent(&path, started.elapsed());
                    }
                    return Ok(response);
                }
                Attempt::Failed {
                    failure,
                    last,
                    pushback,
                    reconnect,
                } => {
                    if reconnect {
                        upstream.replace(conn.generation);
                    }
                    (failure, last, pushback, reconnect)
                }
            };

            let answered = last.is_ok();
            // A live server failing takes a token; one pacing us with pushback does not.
            if answered
                && (failure == Failure::MaybeProcessed
                    || (failure == Failure::RateLimited && !matches!(pushback, Pushback::After(_))))
            {
                self.throttle.failure();
            }
            let retryable = match failure {
                Failure::ProvenNotSent => true,
                Failure::MaybeProcessed => policy.replay_safety.is_replay_safe(),
                Failure::RateLimited => match (pushback, self.config.rate_limit_window) {
                    (Pushback::After(p), Some(window)) if !p.is_zero() => {
                        first_paced.get_or_insert_with(Instant::now).elapsed() < window
                    }
                    _ => rate_limited < self.config.rate_limit_retries,
                },
                Failure::Final => false,
            };
            // The budget is spent in full, but the first retry is always granted.
            let within_budget =
                failure == Failure::RateLimited || retries == 0 || started.elapsed() < budget;
            // gRFC A6: a pushback that cannot be read means "do not retry"; a drained
            // throttle suppresses retries of failures a live server answered.
            let stop = if !retryable || !within_budget {
                None
            } else if pushback == Pushback::Stop {
                Some("malformed pushback")
            } else if failure != Failure::ProvenNotSent && self.throttle.drained() {
                self.stats.throttled.fetch_add(1, Ordering::Relaxed);
                Some("retry throttle drained")
            } else {
                Some("")
            };
            if stop != Some("") {
                if retries + rate_limited > 0 {
                    record_budget_spent(&path, started.elapsed());
                }
                if failure != Failure::Final {
                    self.stats.gave_up.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        rpc.method = %path,
                        address = %conn.address,
                        attempts = retries + rate_limited + 1,
                        classification = failure.as_str(),
                        replay_safety = policy.replay_safety.as_str(),
                        reason = stop.unwrap_or("not retryable or budget spent"),
                        "giving up"
                    );
                }
                return last;
            }

            let backoff = if failure == Failure::RateLimited {
                match pushback {
                    // gRFC A6: a server pacing its clients names the delay; half of it
                    // again as jitter keeps the refused from coming back in one wave.
                    // A zero pushback proves nothing about the load: the backoff.
                    Pushback::After(p) if !p.is_zero() => {
                        p.mul_f64(1.0 + rand::random::<f64>() / 2.0)
                    }
                    _ => self.config.backoff(rate_limited),
                }
            } else if failure == Failure::ProvenNotSent
                && condemned
                && self.config.short_connect_schedule
            {
                // A refused or failed connect cost the server nothing: come back soon.
                self.config.connect_backoff(retries)
            } else {
                self.config.backoff(retries)
            };
            let mut delay = match pushback {
                Pushback::After(p) => p.max(backoff),
                _ => backoff,
            };
            if failure == Failure::RateLimited {
                delay = delay.min(self.config.rate_limit_max_sleep);
            } else {
                // Never sleep past the budget's end; the retry after it still happens.
                let left = budget.saturating_sub(started.elapsed());
                if retries > 0 || !left.is_zero() {
                    delay = delay.min(left.max(Duration::from_millis(1)));
                }
            }
            match failure {
                Failure::ProvenNotSent => &self.stats.proven_not_sent,
                Failure::MaybeProcessed => &self.stats.maybe_processed,
                Failure::RateLimited => &self.stats.rate_limited,
                Failure::Final => unreachable!("final failures return above"),
            }
            .fetch_add(1, Ordering::Relaxed);
            {
                let mut delays = self.stats.delays.lock().expect("stats poisoned");
                if delays.len() < 1024 {
                    delays.push(delay);
                }
            }
            metrics::transport_retries().add(
                1,
                &[
                    metrics::attr("method", path.to_string()),
                    metrics::attr("classification", failure.as_str()),
                ],
            );
            tracing::info!(
                rpc.method = %path,
                address = %conn.address,
                attempt = retries + rate_limited + 1,
                classification = failure.as_str(),
                delay_ms = delay.as_millis() as u64,
                "retry"
            );
            if failure == Failure::RateLimited {
                rate_limited += 1;
            } else {
                retries += 1;
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// One attempt under its deadline and the connection's handshake timeout.
    async fn bounded(
        &self,
        conn: &Conn,
        request: http::Request<Body>,
        policy: &MethodPolicy,
        deadline: Option<Duration>,
    ) -> Attempt {
        let started = Instant::now();
        // A stream has no deadline, but its response headers must come in time.
        let deadline_at = started + deadline.unwrap_or(self.config.attempt_timeout);
        let handshake_at = started + self.config.handshake_timeout;
        let attempt = self.attempt(conn.channel.clone(), request, policy);
        tokio::pin!(attempt);
        let past_deadline = || {
            // Past its deadline, an attempt is like a reset: it may have been processed,
            // unless the server never said a word.
            let failure = if conn.heard.load(Ordering::SeqCst) {
                Failure::MaybeProcessed
            } else {
                Failure::ProvenNotSent
            };
            Attempt::error(
                failure,
                tonic::Status::deadline_exceeded(format!(
                    "no answer from {} within the {} ms attempt deadline",
                    conn.address,
                    (deadline_at - started).as_millis()
                )),
            )
        };
        let mut handshake_checked = false;
        loop {
            tokio::select! {
                done = &mut attempt => return match done {
                    // tonic's channel enforces the `grpc-timeout` we send as well.
                    Attempt::Failed { last: Err(e), .. } if classify::is_timeout(&*e) => {
                        past_deadline()
                    }
                    done => done,
                },
                () = tokio::time::sleep_until(handshake_at), if !handshake_checked => {
                    handshake_checked = true;
                    if !conn.heard.load(Ordering::SeqCst) {
                        return Attempt::error(Failure::ProvenNotSent, tonic::Status::unavailable(format!(
                            "no answer from {}: it sent nothing within the {} ms handshake timeout",
                            conn.address,
                            self.config.handshake_timeout.as_millis()
                        )));
                    }
                }
                () = tokio::time::sleep_until(deadline_at) => return past_deadline(),
            }
        }
    }

    async fn attempt(
        &self,
        mut inner: ConnChannel,
        request: http::Request<Body>,
        policy: &MethodPolicy,
    ) -> Attempt {
        let ready = std::future::poll_fn(|cx| inner.poll_ready(cx))
            .await
            .map_err(BoxError::from);
        let response = match ready {
            Ok(()) => inner.call(request).await.map_err(BoxError::from),
            Err(e) => Err(e),
        };
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                let failure = classify::error(&*e);
                return Attempt::Failed {
                    failure,
                    // A connect that failed: try the next address.
                    reconnect: classify::is_connect(&*e),
                    last: Err(e),
                    pushback: Pushback::None,
                };
            }
        };
        // A status in the headers (trailers-only) is the whole answer.
        if let Some(status) = tonic::Status::from_header_map(response.headers()) {
            if status.code() == tonic::Code::Ok {
                return Attempt::Done(response);
            }
            let pushback = classify::pushback(response.headers(), &status);
            return Attempt::Failed {
                failure: classify::code(status.code()),
                last: Ok(response),
                pushback,
                reconnect: false,
            };
        }
        if policy.server_streaming {
            return Attempt::Done(response);
        }
        // Unary: read it whole so a cut body is seen here.
        let (parts, body) = response.into_parts();
        match body.collect().await {
            Err(e) => Attempt::Failed {
                failure: Failure::MaybeProcessed,
                last: Err(Box::new(e)),
                pushback: Pushback::None,
                reconnect: false,
            },
            Ok(collected) => {
                let trailers = collected.trailers().cloned();
                let data = collected.to_bytes();
                let status = trailers.as_ref().and_then(tonic::Status::from_header_map);
                let response =
                    http::Response::from_parts(parts, whole_body(data, trailers.clone()));
                match status {
                    Some(s) if s.code() != tonic::Code::Ok => Attempt::Failed {
                        failure: classify::code(s.code()),
                        pushback: trailers
                            .as_ref()
                            .map_or(Pushback::None, |t| classify::pushback(t, &s)),
                        last: Ok(response),
                        reconnect: false,
                    },
                    // No trailers at all: the stream ended without a status, cut short.
                    None => Attempt::Failed {
                        failure: Failure::MaybeProcessed,
                        last: Ok(response),
                        pushback: Pushback::None,
                        reconnect: false,
                    },
                    Some(_) => Attempt::Done(response),
                }
            }
        }
    }
}

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

fn rebuild(
    parts: &http::request::Parts,
    body: Bytes,
    deadline: Option<Duration>,
) -> http::Request<Body> {
    let mut request = http::Request::new(Body::new(http_body_util::Full::new(body)));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    if let Some(d) = deadline {
        request
            .headers_mut()
            .insert("grpc-timeout", deadline::header(d));
    }
    request
}

fn whole_body(data: Bytes, trailers: Option<http::HeaderMap>) -> Body {
    let mut frames = vec![Ok::<_, std::convert::Infallible>(http_body::Frame::data(
        data,
    ))];
    if let Some(t) = trailers {
        frames.push(Ok(http_body::Frame::trailers(t)));
    }
    Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )))
}

fn runplane_proto_policy_lookup<'a>(
    table: &'a [MethodPolicy],
    path: &str,
) -> Option<&'a MethodPolicy> {
    table
        .binary_search_by(|p| p.path.cmp(path))
        .ok()
        .map(|i| &table[i])
}
