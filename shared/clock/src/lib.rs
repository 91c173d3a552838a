//! Time as logic sees it. Logic never calls `SystemTime::now()` or `Instant::now()`; it
//! takes a [`Clock`], so tests can move time by hand and tokio tests can pause it.
//!
//! One vocabulary: a timestamp is an `i64` of microseconds since the Unix epoch, named
//! `..._us`; [`to_timestamp`] and [`from_timestamp`] are the one pair of conversions to
//! and from the protobuf `Timestamp`. The two stores that keep milliseconds say so in
//! every name (`..._ms`): the stream store, because Redis expiry (`PEXPIRE`, `PTTL`)
//! speaks milliseconds, and credential health's columns; they read [`Clock::now_ms`] and
//! cross into microseconds only through [`ms_to_us`].
//!
//! [`ManualClock`], which moves only when told to, is behind the `test-util` feature.

use std::fmt::Debug;
use std::sync::Arc;
#[cfg(any(test, feature = "test-util"))]
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock and monotonic time.
pub trait Clock: Debug + Send + Sync + 'static {
    /// Wall-clock time, for timestamps that are stored or shown. It may jump.
    fn now(&self) -> DateTime<Utc>;
    /// Monotonic time since the clock's fixed origin, for windows, deadlines and
    /// backoffs. It never goes backwards.
    fn monotonic(&self) -> Duration;

    /// Wall-clock microseconds since the Unix epoch.
    fn now_us(&self) -> i64 {
        self.now().timestamp_micros()
    }

    /// Wall-clock milliseconds since the Unix epoch, for the stores that keep them.
    fn now_ms(&self) -> i64 {
        self.now().timestamp_millis()
    }
}

/// Microseconds since the Unix epoch as a protobuf `Timestamp`.
pub fn to_timestamp(us: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: us.div_euclid(1_000_000),
        nanos: (us.rem_euclid(1_000_000) * 1000) as i32,
    }
}

/// A protobuf `Timestamp` as microseconds since the Unix epoch, saturating: a client's
/// far-off time neither overflows nor panics. `None` when its nanos are out of range.
pub fn from_timestamp(t: &prost_types::Timestamp) -> Option<i64> {
    (0..1_000_000_000).contains(&t.nanos).then(|| {
        t.seconds
            .saturating_mul(1_000_000)
            .saturating_add(i64::from(t.nanos / 1000))
    })
}

/// Milliseconds (of a store that keeps them) as microseconds.
pub fn ms_to_us(ms: i64) -> i64 {
    ms.saturating_mul(1000)
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The real clock. Its monotonic half reads tokio's clock, so a test with paused tokio
/// time sees it paused too.
#[derive(Debug, Clone)]
pub struct SystemClock {
    origin: tokio::time::Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }

    pub fn shared() -> SharedClock {
        Arc::new(Self::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }

    fn monotonic(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to. Clones share the same time.
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Clone)]
pub struct ManualClock {
    state: Arc<Mutex<ManualState>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug)]
struct ManualState {
    wall: DateTime<Utc>,
    monotonic: Duration,
}

#[cfg(any(test, feature = "test-util"))]
impl ManualClock {
    /// Starts at `wall` with monotonic time zero.
    pub fn new(wall: DateTime<Utc>) -> Self {
        Self {
            state: Arc::new(Mutex::new(ManualState {
                wall,
                monotonic: Duration::ZERO,
            })),
        }
    }

    /// Moves both wall and monotonic time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut s = self.state.lock().expect("manual clock poisoned");
        s.monotonic += by;
        s.wall += chrono::Duration::from_std(by).expect("advance fits chrono::Duration");
    }

    /// Sets wall time alone, as an NTP step would; monotonic time is unaffected.
    pub fn set_wall(&self, wall: DateTime<Utc>) {
        self.state.lock().expect("manual clock poisoned").wall = wall;
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        self.state.lock().expect("manual clock poisoned").wall
    }

    fn monotonic(&self) -> Duration {
        self.state.lock().expect("manual clock poisoned").monotonic
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced_and_clones_share_it() {
        let start = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let clock = ManualClock::new(start);
        let other = clock.clone();
        assert_eq!(clock.now(), start);
        assert_eq!(clock.monotonic(), Duration::ZERO);

        other.advance(Duration::from_secs(61));
        assert_eq!(clock.monotonic(), Duration::from_secs(61));
        assert_eq!(clock.now(), start + chrono::Duration::seconds(61));

        // A wall-clock step backwards leaves monotonic time alone.
        clock.set_wall(start);
        assert_eq!(clock.now(), start);
        assert_eq!(clock.monotonic(), Duration::from_secs(61));
    }

    #[test]
    fn timestamps_round_trip_in_microseconds_and_far_off_times_saturate() {
        for us in [
            0,
            1,
            999_999,
            1_000_000,
            1_700_000_000_123_456,
            -1,
            -1_500_000,
        ] {
            assert_eq!(from_timestamp(&to_timestamp(us)), Some(us), "{us}");
        }
        assert_eq!(
            to_timestamp(-1),
            prost_types::Timestamp {
                seconds: -1,
                nanos: 999_999_000
            }
        );
        let far = prost_types::Timestamp {
            seconds: i64::MAX,
            nanos: 999_999_999,
        };
        assert_eq!(from_timestamp(&far), Some(i64::MAX));
        let bad = prost_types::Timestamp {
            seconds: 1,
            nanos: 1_000_000_000,
        };
        assert_eq!(from_timestamp(&bad), None);
        assert_eq!(ms_to_us(1_700_000_000_123), 1_700_000_000_123_000);
        let clock = ManualClock::new(DateTime::from_timestamp(1_700_000_000, 5_000).unwrap());
        assert_eq!(clock.now_us(), 1_700_000_000_000_005);
        assert_eq!(clock.now_ms(), 1_700_000_000_000);
    }

    #[tokio::test(start_paused = true)]
    async fn system_clock_monotonic_follows_paused_tokio_time() {
        let clock = SystemClock::new();
        let before = clock.monotonic();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.monotonic() - before, Duration::from_secs(90));
    }
}
