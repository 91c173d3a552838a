//! Heartbeats of watch streams (WatchRun, WatchNotices, Tail).
//!
//! A watch can be silent for hours while nothing happens, so silence alone says nothing:
//! a stream stuck behind a wedged replica or a proxy that stopped forwarding looks the
//! same as a quiet run. The server therefore sends a heartbeat (carrying the stream's
//! cursor and its clock) whenever it has had nothing else to send for an interval the
//! client chose, and the client treats a stream silent for [`ALLOWANCE_FACTOR`]
//! intervals as dead: it re-opens it from its cursor on a new connection.

use std::time::Duration;

use tokio::time::Instant;

/// The interval when the request asks for none.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
/// The shortest interval a request may ask for.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The longest interval a request may ask for.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// How many intervals a client waits, hearing nothing, before it gives a stream up.
pub const ALLOWANCE_FACTOR: u32 = 3;

/// A watch request's `heartbeat_interval`: unset or zero means [`DEFAULT_INTERVAL`],
/// otherwise [`MIN_INTERVAL`] to [`MAX_INTERVAL`]. The error is the reason for an
/// INVALID_ARGUMENT on `heartbeat_interval`.
pub fn interval(requested: Option<&prost_types::Duration>) -> Result<Duration, &'static str> {
    const BOUNDS: &str = "must be unset, zero, or 1 s to 60 s";
    let Some(d) = requested else {
        return Ok(DEFAULT_INTERVAL);
    };
    if d.seconds < 0 || d.nanos < 0 || d.nanos > 999_999_999 {
        return Err(BOUNDS);
    }
    let d = Duration::new(d.seconds as u64, d.nanos as u32);
    match d {
        Duration::ZERO => Ok(DEFAULT_INTERVAL),
        d if (MIN_INTERVAL..=MAX_INTERVAL).contains(&d) => Ok(d),
        _ => Err(BOUNDS),
    }
}

/// How long a client may hear nothing on a stream that sends heartbeats every `interval`.
pub fn allowance(interval: Duration) -> Duration {
    interval.saturating_mul(ALLOWANCE_FACTOR)
}

/// When a server stream owes its client a heartbeat: `interval` after the last item sent.
/// Shared by reference with the closure that sends (`&self` throughout).
#[derive(Debug)]
pub struct Due {
    interval: Duration,
    last_sent: std::sync::Mutex<Instant>,
}

impl Due {
    /// A stream that just opened (its opening counts as sent).
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last_sent: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// An item (of any kind) went out now.
    pub fn sent(&self) {
        *self.last_sent.lock().expect("heartbeat clock poisoned") = Instant::now();
    }

    /// When the next heartbeat is due if nothing else is sent.
    pub fn at(&self) -> Instant {
        *self.last_sent.lock().expect("heartbeat clock poisoned") + self.interval
    }

    /// Nothing went out for an interval.
    pub fn is_due(&self) -> bool {
        Instant::now() >= self.at()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(seconds: i64, nanos: i32) -> prost_types::Duration {
        prost_types::Duration { seconds, nanos }
    }

    #[test]
    fn intervals_are_defaulted_and_bounded() {
        assert_eq!(interval(None), Ok(DEFAULT_INTERVAL));
        assert_eq!(interval(Some(&d(0, 0))), Ok(DEFAULT_INTERVAL));
        assert_eq!(interval(Some(&d(1, 0))), Ok(Duration::from_secs(1)));
        assert_eq!(interval(Some(&d(60, 0))), Ok(Duration::from_secs(60)));
        assert_eq!(
            interval(Some(&d(2, 500_000_000))),
            Ok(Duration::from_millis(2500))
        );
        for bad in [
            d(0, 999_999_999),
            d(60, 1),
            d(-1, 0),
            d(1, -1),
            d(i64::MAX, 0),
        ] {
            assert!(interval(Some(&bad)).is_err(), "{bad:?}");
        }
        assert_eq!(allowance(Duration::from_secs(5)), Duration::from_secs(15));
    }
}
