//! Wake-ups for long polls and watches when a run changes.
//!
//! Every waiter subscribes to the one key it waits on (a run id, or [`RECONCILER_WORK`]) before
//! it reads, so a change between its read and its wait is not lost. A change made in
//! this process wakes that key's subscribers at once, and no one else: an idle
//! watcher costs nothing, however many changes other runs see. On Postgres, the other
//! replicas' changes do too, through `LISTEN/NOTIFY` on [`CHANNEL`]
//! ([`runplane_db::notify`]), so a watcher on replica B sees an append on replica A
//! within a notification's latency. LISTEN/NOTIFY and not a call between replicas,
//! because the replicas do not know each other and already share the database.
//!
//! Nothing depends on a notification arriving. A listener that lost its connection
//! wakes every waiter once it is back, and a publish that failed is sent again (see
//! [`runplane_db::notify`]). And every [`RECHECK`] one query per replica reads
//! the [`Version`] of every run a watcher is following and wakes the watchers whose
//! last read is out of date (the safety net, not the path): its cost does not grow with
//! the number of watchers. Long polls need no re-check: they answer at their deadline
//! (at most `max_poll_wait`) and read again when called again.

use std::future::Future;
use std::time::Duration;

use runplane_db::notify::{Relay, RelayTasks};
use runplane_grpc::notifier::Notifier;
use runplane_telemetry::metrics;
use sea_orm::sqlx;

use crate::domain::state::RunState;

/// How often the replica re-reads the runs being watched, without a wake-up.
pub const RECHECK: Duration = Duration::from_secs(30);

/// Most runs one re-check query reads; more go in the next.
const RECHECK_BATCH: usize = 1000;

/// The Postgres channel of run changes; a payload is `<replica>:<run id>`.
pub const CHANNEL: &str = "runplane_run_changes";

/// Not a run id: what is notified when the reconciler has something to act on (a run
/// was created, had a message queued, or ended); WaitForRuns waits on it.
pub const RECONCILER_WORK: &str = "reconciler-work";

/// What a watcher last read of a run: its last event and its last update. Both only
/// grow, so a run whose stored version differs has changed since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    pub last_sequence: i64,
    pub updated_at_us: i64,
}

#[derive(Debug, Clone)]
pub struct Changes {
    waiters: Notifier<Version>,
    /// Publishes the runs changed here to the other replicas (Postgres only).
    relay: Option<Relay>,
}

pub type Subscription = runplane_grpc::notifier::Subscription<Version>;

/// The run-change relay's tasks ([`RelayTasks`]).
pub const RELAY_TASKS: RelayTasks = RelayTasks {
    publish: "run-store.relay.publish",
    listen: "run-store.relay.listen",
};

impl Default for Changes {
    fn default() -> Self {
        Self::new()
    }
}

impl Changes {
    /// Wake-ups within this process only (SQLite: `runplane dev`, one process).
    pub fn new() -> Self {
        Self {
            waiters: Notifier::new(),
            relay: None,
        }
    }

    /// Wake-ups across every replica on the Postgres database `pool` belongs to. The
    /// publisher and the listener are declared tasks of `tasks` ([`RELAY_TASKS`]); both
    /// stop when the server closes.
    pub fn across_replicas(tasks: &runplane_grpc::Tasks, pool: sqlx::PgPool) -> Self {
        let waiters = Notifier::new();
        Self {
            relay: Some(Relay::start(
                tasks,
                RELAY_TASKS,
                pool,
                CHANNEL,
                waiters.clone(),
            )),
            waiters,
        }
    }

    /// Every [`RECHECK`], reads the versions of the watched runs with `read` and wakes
    /// the watchers whose last read is older. Returns when the server closes.
    pub async fn recheck<F, Fut, E>(&self, read: F)
    where
        F: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = Result<Vec<(String, Version)>, E>>,
        E: std::fmt::Display,
    {
        self.waiters.recheck(RECHECK, RECHECK_BATCH, read).await;
    }

    /// The server is shutting down: every waiter returns now and does not wait again, so
    /// long polls answer and watches end instead of holding the shutdown up.
    pub fn close(&self) {
        self.waiters.close();
    }

    pub fn is_closing(&self) -> bool {
        self.waiters.is_closing()
    }

    /// Wakes whoever waits on `run_id`, in this process at once and on the other
    /// replicas at the next publish.
    pub fn notify(&self, run_id: &str) {
        self.waiters.notify(run_id);
        if let Some(relay) = &self.relay {
            relay.publish(run_id);
        }
    }

    /// A run was created: the reconciler dispatches it.
    pub fn created(&self) {
        self.notify(RECONCILER_WORK);
    }

    /// A steering or control message was queued for `run_id`: its long polls answer, and
    /// the reconciler wakes its sandbox if that is suspended (the message waits for a
    /// runner that is frozen otherwise).
    pub fn queued(&self, run_id: &str) {
        self.notify(run_id);
        self.notify(RECONCILER_WORK);
    }

    /// `run_id` became terminal in `state`: counted, its watchers woken, and the
    /// reconciler destroys its sandboxes (suspended ones included) and fills its slot.
    pub fn ended(&self, run_id: &str, state: RunState) {
        metrics::runs_finished().add(1, &[metrics::attr("state", state.as_str())]);
        self.notify(run_id);
        self.notify(RECONCILER_WORK);
    }

    /// `run_id`'s attempt ended and the next is due: its watchers see it, and the
    /// reconciler deletes the old sandbox and, after the backoff, dispatches the next.
    pub fn attempt_ended(&self, run_id: &str) {
        self.notify(run_id);
        self.notify(RECONCILER_WORK);
    }

    /// `run_id` was paused or resumed: its watchers see it, and the reconciler suspends or
    /// restores its sandbox.
    pub fn paused(&self, run_id: &str) {
        self.notify(run_id);
        self.notify(RECONCILER_WORK);
    }

    /// A call that ends `run_id` found it already ended: a replay, whose first attempt may
    /// have committed and then been dropped (a client deadline, a closed connection)
    /// before it woke anyone. Wakes as [`Changes::ended`] does, without counting it again;
    /// a wake with nothing new costs a watcher one read.
    pub fn ended_again(&self, run_id: &str) {
        self.notify(run_id);
        self.notify(RECONCILER_WORK);
    }

    /// Subscribes to `key` (a run id or [`RECONCILER_WORK`]). Subscribe before reading, so a
    /// change between the read and the wait is not lost.
    pub fn subscribe(&self, key: &str) -> Subscription {
        self.waiters.subscribe(key)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::time::Instant;

    use super::*;

    const V1: Version = Version {
        last_sequence: 1,
        updated_at_us: 10,
    };
    const V2: Version = Version {
        last_sequence: 2,
        updated_at_us: 10,
    };

    /// A change whose notification was lost (here: never sent) still wakes the watcher
    /// whose last read is older, at the re-check and not before; an up-to-date watcher
    /// sleeps on, and the re-check reads every watched run in one call.
    #[tokio::test(start_paused = true)]
    async fn the_recheck_wakes_only_watchers_whose_read_is_stale() {
        let changes = Changes::new();
        let mut stale = changes.subscribe("run-stale");
        stale.seen(V1);
        let mut current = changes.subscribe("run-current");
        current.seen(V2);
        let reads = Arc::new(Mutex::new(Vec::new()));
        tokio::spawn({
            let (changes, reads) = (changes.clone(), reads.clone());
            async move {
                changes
                    .recheck(|runs: Vec<String>| {
                        reads.lock().unwrap().push(runs.len());
                        let stored = runs.into_iter().map(|r| (r, V2)).collect();
                        async move { Ok::<_, String>(stored) }
                    })
                    .await;
            }
        });
        let before = Instant::now() + RECHECK - Duration::from_secs(1);
        assert!(!stale.changed(before).await, "woken before the re-check");
        let after = Instant::now() + Duration::from_secs(2);
        assert!(
            stale.changed(after).await,
            "the re-check did not wake a stale watcher"
        );
        assert!(!current.changed(Instant::now()).await);
        assert_eq!(*reads.lock().unwrap(), vec![2]);
        changes.close();
    }
}
