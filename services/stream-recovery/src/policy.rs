//! The numbers of stream recovery (seed 001), in one place.
//!
//! - The first takeover of a run is immediate: a deploy or crash should cost nothing.
//! - Later takeovers wait `not_before`: 1 s doubling to a 60 s cap, plus up to as much
//!   again of jitter so that tabs and pods polling the same run do not claim in step;
//!   five takeovers spend about 30 s of backoff in total.
//! - After 5 takeovers the next claim ends the run (`stream_recovery_exhausted`): a run
//!   whose controllers keep dying is a bug, not an outage, and must not loop forever.
//! - A takeover more than 5 minutes after the previous one starts a fresh budget: an
//!   occasional restart over a long run is not a crash loop.

use std::time::Duration;

pub const MAX_ATTEMPTS: u32 = 5;
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
pub const BACKOFF_CAP: Duration = Duration::from_secs(60);
pub const RESET_AFTER: Duration = Duration::from_secs(5 * 60);
/// How often the scheduled orphan sweep examines a batch, and how many runs at most.
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);
pub const SWEEP_BATCH: usize = 100;
/// Lease time to live when the caller asks for none.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// Bounds of one run's replay buffer.
#[derive(Debug, Clone, Copy)]
pub struct BufferLimits {
    /// Frames kept; older ones are trimmed (a late reader gets a `replay_gap`).
    pub max_frames: u64,
    /// Bytes one stream may append over its life.
    pub stream_bytes: u64,
    /// Bytes one org's streams may append in one clock hour.
    pub org_hour_bytes: u64,
    /// How long an idle buffer is kept.
    pub ttl: Duration,
}

impl Default for BufferLimits {
    fn default() -> Self {
        Self {
            max_frames: 10_000,
            stream_bytes: 64 << 20,
            org_hour_bytes: 1 << 30,
            ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// The wait before the takeover after `attempts` takeovers: `d = min(cap, base·2^(n-1))`,
/// plus jitter in `[0, d)`, never past the cap. `jitter` is a draw from `[0, 1)`.
pub fn backoff_ms(attempts: u32, jitter: f64) -> i64 {
    let base = BACKOFF_BASE.as_millis() as f64;
    let cap = BACKOFF_CAP.as_millis() as f64;
    let d = (base * 2f64.powi(attempts.saturating_sub(1).min(30) as i32)).min(cap);
    (d + d * jitter.clamp(0.0, 1.0)).min(cap) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gaps_grow_and_stop_at_the_cap() {
        assert_eq!(backoff_ms(1, 0.0), 1000);
        assert_eq!(backoff_ms(1, 0.999), 1999);
        assert_eq!(backoff_ms(2, 0.0), 2000);
        assert_eq!(backoff_ms(5, 0.0), 16_000);
        assert_eq!(backoff_ms(8, 0.5), 60_000);
    }
}
