//! Wake-ups for long polls and watches when a run changes.
//!
//! Changes made in this process wake waiters at once. Another replica's changes are
//! picked up by the waiter's own re-check, at most [`RECHECK`] later: a missed wake-up
//! costs latency, never correctness, because waiters always re-read the database.

use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;

/// How often a waiter re-reads even without a wake-up.
pub const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Changes {
    tx: broadcast::Sender<String>,
}

impl Default for Changes {
    fn default() -> Self {
        Self::new()
    }
}

impl Changes {
    pub fn new() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
        }
    }

    /// Wakes whoever waits on `run_id` in this process.
    pub fn notify(&self, run_id: &str) {
        let _ = self.tx.send(run_id.to_owned());
    }

    /// Subscribe before reading, so a change between the read and the wait is not lost.
    pub fn subscribe(&self) -> Subscription {
        Subscription {
            rx: self.tx.subscribe(),
        }
    }
}

#[derive(Debug)]
pub struct Subscription {
    rx: broadcast::Receiver<String>,
}

impl Subscription {
    /// Returns when `run_id` changed here, at the next re-check, or at `deadline`.
    pub async fn wait_for(&mut self, run_id: &str, deadline: Instant) {
        let until = deadline.min(Instant::now() + RECHECK);
        let _ = tokio::time::timeout_at(until, async {
            loop {
                match self.rx.recv().await {
                    Ok(changed) if changed == run_id => return,
                    Ok(_) => {}
                    // Lagged: something may have been missed; re-read now.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await;
                    }
                }
            }
        })
        .await;
    }
}
