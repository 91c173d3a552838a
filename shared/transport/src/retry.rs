//! The retrying layer and service: per call, attempts until one succeeds, the failure
//! is final, or the method's policy and budget say stop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use http_body_util::BodyExt;
use runplane_proto::{MethodPolicy, OutageBudget, ReplaySafety};
use runplane_telemetry::metrics;
use tokio::time::Instant;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::attempt::{self, Attempt, BoxError, rebuild};
use crate::classify::{Failure, Pushback};
use crate::config::RetryConfig;
use crate::deadline;
use crate::throttle::Throttle;
use crate::upstream::Upstream;
use crate::watch::StreamConnection;

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

/// The layer. Build one per upstream: the throttle is per upstream.
#[derive(Debug, Clone)]
pub struct RetryLayer {
    state: Arc<LayerState>,
}

/// What the services of one layer share: its policy, throttle and counters.
#[derive(Debug)]
struct LayerState {
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
            state: Arc::new(LayerState {
                throttle: Throttle::new(config.throttle_max_tokens, config.throttle_token_ratio),
                config,
                table,
                stats: Arc::default(),
            }),
        }
    }

    pub fn stats(&self) -> Arc<RetryStats> {
        self.state.stats.clone()
    }

    pub fn config(&self) -> &RetryConfig {
        &self.state.config
    }
}

impl Layer<Upstream> for RetryLayer {
    type Service = Retry;

    fn layer(&self, upstream: Upstream) -> Retry {
        Retry {
            upstream,
            state: self.state.clone(),
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
    state: Arc<LayerState>,
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
        let state = self.state.clone();
        Box::pin(async move { state.call(upstream, request).await })
    }
}

impl LayerState {
    async fn call(
        &self,
        upstream: Upstream,
        request: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let path = request.uri().path().to_owned();
        let policy = lookup_policy(self.table, &path).unwrap_or(&UNKNOWN);
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
            let attempt = attempt::bounded(
                &self.config,
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
}

fn lookup_policy<'a>(table: &'a [MethodPolicy], path: &str) -> Option<&'a MethodPolicy> {
    table
        .binary_search_by(|p| p.path.cmp(path))
        .ok()
        .map(|i| &table[i])
}
