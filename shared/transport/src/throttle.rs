//! The retry throttle of one upstream.

use std::sync::Mutex;

/// gRPC's retry throttling: failures answered by a live server take a token, successes
/// give back a fraction; below half the bucket, retries stop amplifying.
#[derive(Debug)]
pub(crate) struct Throttle {
    tokens: Mutex<f64>,
    max: f64,
    ratio: f64,
}

impl Throttle {
    /// A full bucket of `max` tokens; each success puts back `ratio` of one.
    pub(crate) fn new(max: f64, ratio: f64) -> Self {
        Self {
            tokens: Mutex::new(max),
            max,
            ratio,
        }
    }

    pub(crate) fn failure(&self) {
        let mut t = self.tokens.lock().expect("throttle poisoned");
        *t = (*t - 1.0).max(0.0);
    }

    pub(crate) fn success(&self) {
        let mut t = self.tokens.lock().expect("throttle poisoned");
        *t = (*t + self.ratio).min(self.max);
    }

    pub(crate) fn drained(&self) -> bool {
        *self.tokens.lock().expect("throttle poisoned") <= self.max / 2.0
    }
}
