//! Time as logic sees it. Logic never calls `SystemTime::now()` or `Instant::now()`; it
//! takes a [`Clock`], so tests can move time by hand and tokio tests can pause it.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock and monotonic time.
pub trait Clock: Debug + Send + Sync + 'static {
    /// Wall-clock time, for timestamps that are stored or shown. It may jump.
    fn now(&self) -> DateTime<Utc>;
    /// Monotonic time since the clock's fixed origin, for windows, deadlines and
    /// backoffs. It never goes backwards.
    fn monotonic(&self) -> Duration;
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
#[derive(Debug, Clone)]
pub struct ManualClock {
    state: Arc<Mutex<ManualState>>,
}

#[derive(Debug)]
struct ManualState {
    wall: DateTime<Utc>,
    monotonic: Duration,
}

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

    #[tokio::test(start_paused = true)]
    async fn system_clock_monotonic_follows_paused_tokio_time() {
        let clock = SystemClock::new();
        let before = clock.monotonic();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.monotonic() - before, Duration::from_secs(90));
    }
}
