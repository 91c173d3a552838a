//! How the runner learns that its run must stop, from whichever call finds out first.
//!
//! A run can end away from its runner: an operator's cancel, a deadline, the loss grace,
//! stream recovery giving up, a backend error. The steering poll (its answer's run
//! state, or an `abort`), an append refused with `RUN_TERMINAL` and the like each say so
//! here; the runner then stops the agent (SIGTERM to its process group, a grace, SIGKILL)
//! and sends nothing more for a run that already ended. The first cause wins: an abort
//! followed by the run turning terminal stops the agent once.

use std::sync::Arc;

use tokio::sync::watch;

/// Why the runner stops its agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The run is terminal in the run store; its verdict is already recorded.
    Terminal,
    /// A service aborted the run (`abort` steering message) with this reason; the run
    /// may not be terminal yet, so the runner records the abort as its verdict.
    Abort(String),
}

/// A stop signal shared by the runner's tasks.
#[derive(Debug, Clone)]
pub struct Ending {
    tx: Arc<watch::Sender<Option<Stop>>>,
}

impl Default for Ending {
    fn default() -> Self {
        Self::new()
    }
}

impl Ending {
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::channel(None).0),
        }
    }

    /// The run is terminal. Returns whether this call decided the stop.
    pub fn terminal(&self) -> bool {
        self.set(Stop::Terminal)
    }

    /// A service aborted the run. Returns whether this call decided the stop.
    pub fn abort(&self, reason: &str) -> bool {
        self.set(Stop::Abort(reason.to_owned()))
    }

    fn set(&self, stop: Stop) -> bool {
        self.tx.send_if_modified(|current| {
            if current.is_some() {
                return false;
            }
            *current = Some(stop);
            true
        })
    }

    /// The stop, once decided.
    pub fn get(&self) -> Option<Stop> {
        self.tx.borrow().clone()
    }

    /// Waits until a stop is decided.
    pub async fn wait(&self) -> Stop {
        let mut rx = self.tx.subscribe();
        loop {
            if let Some(stop) = rx.borrow_and_update().clone() {
                return stop;
            }
            // The sender lives as long as `self`, so this never ends early.
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_stop_wins() {
        let ending = Ending::new();
        assert_eq!(ending.get(), None);
        assert!(ending.abort("stream_recovery_exhausted"));
        assert!(!ending.terminal());
        assert_eq!(
            ending.wait().await,
            Stop::Abort("stream_recovery_exhausted".into())
        );
    }

    #[tokio::test]
    async fn a_waiter_wakes_when_the_run_ends() {
        let ending = Ending::new();
        let waiter = tokio::spawn({
            let ending = ending.clone();
            async move { ending.wait().await }
        });
        tokio::task::yield_now().await;
        ending.terminal();
        assert_eq!(waiter.await.unwrap(), Stop::Terminal);
    }
}
