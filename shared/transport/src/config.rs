//! The retry policy's numbers and the backoff schedules drawn from them.

use std::time::Duration;

use runplane_proto::OutageBudget;

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

    pub(crate) fn budget(&self, class: OutageBudget) -> Duration {
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
