//! The bounds the run store enforces on what runners send.
//!
//! A leaf: `config` fills them from runplane's configuration and `validate` checks
//! requests against them, so neither imports the other.

use std::time::Duration;

/// Bounds the run store enforces; Hello hands them to the runner.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_batch_events: u32,
    pub max_batch_bytes: u32,
    /// Text (and structured data) of one event.
    pub max_event_text_bytes: u32,
    /// Acknowledgements in one poll; more is refused whole.
    pub max_ack_ids: u32,
    pub max_poll_wait: Duration,
    pub max_failure_tail_bytes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_batch_events: 1000,
            max_batch_bytes: 1 << 20,
            max_event_text_bytes: 16 << 10,
            max_ack_ids: 32,
            max_poll_wait: Duration::from_secs(30),
            max_failure_tail_bytes: 8 << 10,
        }
    }
}
