//! The numbers of stream recovery, in one place.
//!
//! - The first takeover of a run is immediate: a deploy or crash should cost nothing.
//! - Later takeovers wait `not_before`: 1 s doubling to a 60 s cap, plus up to as much
//!   again of jitter so that tabs and pods polling the same run do not claim in step;
//!   five takeovers spend about 30 s of backoff in total. With 5 attempts the longest
//!   wait actually taken is 8–16 s (before the fifth takeover; the claim after it ends
//!   the run without waiting): a 60 s cap is kept as the formula's bound, but
//!   it binds only from the seventh attempt, so under `MAX_ATTEMPTS` it is never reached.
//!   [`backoff_ms`] is the one formula: the memory store calls it and the Redis claim
//!   script is handed its values (see `store/redis/claims.rs`).
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
/// How long a run's state lives untouched: its meta after the last grant, renewal or
/// claim, a buffer after its last append (the default of [`BufferLimits::ttl`]), a
/// restart budget after its last claim, the index of runs after its last entry. A run
/// idle that long is settled by then or never will be.
pub const STATE_TTL: Duration = Duration::from_secs(24 * 3600);
/// A lease key outlives its lease this many times over: a late renewal by the holder is
/// still fenced by the token, and the key is garbage collected eventually.
pub const LEASE_GC_FACTOR: i64 = 4;

/// Bounds of one run's replay buffer.
#[derive(Debug, Clone, Copy)]
pub struct BufferLimits {
    /// Frames kept; older ones are trimmed (a late reader gets a `replay_gap`).
    pub max_frames: u64,
    /// Bytes one stream may append over its life.
    pub stream_bytes: u64,
    /// Bytes one org's streams may append in one clock hour.
    pub org_hour_bytes: u64,
    /// Bytes one org's streams may hold in the buffers at once. A frame is kept at most
    /// `ttl` after it was appended, so what an org holds is at most what it appended in
    /// the hours that overlap the last `ttl`; its hourly counters over those hours
    /// ([`BufferLimits::window_hours`]) are what this bound is checked against.
    pub org_buffer_bytes: u64,
    /// How long an idle buffer is kept, and the longest a frame is kept.
    pub ttl: Duration,
}

impl BufferLimits {
    /// The clock hours whose appends a buffer may still hold: those that overlap the last
    /// `ttl`, the current one included.
    pub fn window_hours(&self) -> i64 {
        (self.ttl.as_millis() as u64).div_ceil(3_600_000) as i64 + 1
    }

    /// How long an org's hourly counter is kept: through the window that starts with
    /// its hour, and an hour more.
    pub fn org_counter_ttl_ms(&self) -> i64 {
        (self.window_hours() + 1) * 3_600_000
    }
}

impl Default for BufferLimits {
    fn default() -> Self {
        Self {
            max_frames: 10_000,
            stream_bytes: 64 << 20,
            org_hour_bytes: 1 << 30,
            org_buffer_bytes: 4 << 30,
            ttl: STATE_TTL,
        }
    }
}

/// The wait before the takeover after `attempts` takeovers: `d = min(cap, base·2^(n-1))`,
/// plus jitter in `[0, d)`, never past the cap. `jitter` is a draw from `[0, 1)`. The one
/// backoff formula: both stores use it.
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

    #[test]
    fn under_five_attempts_the_longest_wait_is_under_sixteen_seconds() {
        // The wait set by the fifth takeover is never served: the next claim exhausts.
        let longest = backoff_ms(MAX_ATTEMPTS - 1, 0.999_999);
        assert!((15_000..16_000).contains(&longest), "{longest}");
        let total: i64 = (1..MAX_ATTEMPTS).map(|n| backoff_ms(n, 0.5)).sum();
        assert_eq!(total, 22_500, "about 30 s of backoff at most");
        assert!(longest < BACKOFF_CAP.as_millis() as i64);
    }
}
