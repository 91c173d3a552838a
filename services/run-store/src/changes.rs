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
    closing: tokio::sync::watch::Sender<bool>,
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
            closing: tokio::sync::watch::channel(false).0,
        }
    }

    /// The server is shutting down: every waiter returns now and does not wait again, so
    /// long polls answer and watches end instead of holding the shutdown up.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    pub fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    /// Wakes whoever waits on `run_id` in this process.
    pub fn notify(&self, run_id: &str) {
        let _ = self.tx.send(run_id.to_owned());
    }

    /// Subscribe before reading, so a change between the read and the wait is not lost.
    pub fn subscribe(&self) -> Subscription {
        Subscription {
            rx: self.tx.subscribe(),
            closing: self.closing.subscribe(),
        }
    }
}

#[derive(Debug)]
pub struct Subscription {
    rx: broadcast::Receiver<String>,
    closing: tokio::sync::watch::Receiver<bool>,
}

impl Subscription {
    /// Returns when `run_id` changed here, at the next re-check, or at `deadline`.
    pub async fn wait_for(&mut self, run_id: &str, deadline: Instant) {
        if *self.closing.borrow() {
            return;
        }
        let until = deadline.min(Instant::now() + RECHECK);
        let closing = &mut self.closing;
        let rx = &mut self.rx;
        let _ = tokio::time::timeout_at(until, async {
            tokio::select! {
                _ = closing.wait_for(|c| *c) => {}
                () = next_change(rx, run_id) => {}
            }
        })
        .await;
    }
}

async fn next_change(rx: &mut broadcast::Receiver<String>, run_id: &str) {
    loop {
        match rx.recv().await {
            Ok(changed) if changed == run_id => return,
            Ok(_) => {}
            // Lagged: something may have been missed; re-read now.
            Err(broadcast::error::RecvError::Lagged(_)) => return,
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}
