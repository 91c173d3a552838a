//! Wake-ups for long polls and watches when a run changes.
//!
//! Changes made in this process wake waiters at once, through a broadcast. On Postgres,
//! the other replicas' changes do too: every replica publishes the runs it changed with
//! `pg_notify` on [`CHANNEL`] (batched, off the request path) and listens on it, so a
//! watcher on replica B sees an append on replica A within a notification's latency.
//! LISTEN/NOTIFY and not a call between replicas, because the replicas do not know each
//! other and already share the database, and NOTIFY is delivered at commit to every
//! listener.
//!
//! Nothing depends on a notification arriving: waiters always re-read the database when
//! woken, and re-read anyway every [`RECHECK`] (the safety net, not the path). A listener
//! that lost its connection wakes every waiter once it is back, since notifications sent
//! meanwhile are gone.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sea_orm::sqlx;
use tokio::sync::{Notify, broadcast};
use tokio::time::Instant;

/// How often a waiter re-reads even without a wake-up.
pub const RECHECK: Duration = Duration::from_secs(30);

/// The Postgres channel of run changes; a payload is `<replica>:<run id>`.
pub const CHANNEL: &str = "runplane_run_changes";

/// What waiters are sent to wake them all (a listener reconnected).
const EVERY_RUN: &str = "*";

/// Not a run id: what is notified when a run is created (WaitForRuns waits on it).
pub const NEW_RUN: &str = "new-run";

#[derive(Debug, Clone)]
pub struct Changes {
    tx: broadcast::Sender<String>,
    closing: tokio::sync::watch::Sender<bool>,
    /// Runs changed here and not yet published to the other replicas (Postgres only).
    outgoing: Option<Arc<Outgoing>>,
}

#[derive(Debug, Default)]
struct Outgoing {
    runs: Mutex<HashSet<String>>,
    kick: Notify,
}

impl Default for Changes {
    fn default() -> Self {
        Self::new()
    }
}

impl Changes {
    /// Wake-ups within this process only (SQLite: `runplane dev`, one process).
    pub fn new() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
            closing: tokio::sync::watch::channel(false).0,
            outgoing: None,
        }
    }

    /// Wake-ups across every replica on the Postgres database `pool` belongs to. Spawns
    /// the publisher and the listener; both stop when the server closes.
    pub fn across_replicas(pool: sqlx::PgPool) -> Self {
        let mut changes = Self::new();
        let outgoing = Arc::new(Outgoing::default());
        changes.outgoing = Some(outgoing.clone());
        let replica = uuid::Uuid::new_v4().simple().to_string();
        tokio::spawn(publish(
            pool.clone(),
            outgoing,
            replica.clone(),
            changes.closing.subscribe(),
        ));
        tokio::spawn(listen(
            pool,
            replica,
            changes.tx.clone(),
            changes.closing.subscribe(),
        ));
        changes
    }

    /// The server is shutting down: every waiter returns now and does not wait again, so
    /// long polls answer and watches end instead of holding the shutdown up.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    pub fn is_closing(&self) -> bool {
        *self.closing.borrow()
    }

    /// Wakes whoever waits on `run_id`, in this process at once and on the other
    /// replicas at the next publish.
    pub fn notify(&self, run_id: &str) {
        let _ = self.tx.send(run_id.to_owned());
        if let Some(out) = &self.outgoing {
            out.runs
                .lock()
                .expect("outgoing changes")
                .insert(run_id.to_owned());
            out.kick.notify_one();
        }
    }

    /// Subscribe before reading, so a change between the read and the wait is not lost.
    pub fn subscribe(&self) -> Subscription {
        Subscription {
            rx: self.tx.subscribe(),
            closing: self.closing.subscribe(),
        }
    }
}

/// Most runs one `pg_notify` statement carries; more go in the next.
const PUBLISH_BATCH: usize = 500;

/// Publishes the runs changed here, coalesced: one statement for every run changed
/// since the last one. A failed publish is logged and dropped (the re-check covers it).
async fn publish(
    pool: sqlx::PgPool,
    out: Arc<Outgoing>,
    replica: String,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            () = closed(&mut closing) => return,
            () = out.kick.notified() => {}
        }
        let runs: Vec<String> = std::mem::take(&mut *out.runs.lock().expect("outgoing changes"))
            .into_iter()
            .collect();
        for batch in runs.chunks(PUBLISH_BATCH) {
            let payloads: Vec<String> = batch.iter().map(|r| format!("{replica}:{r}")).collect();
            let sent = sqlx::query("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p")
                .bind(CHANNEL)
                .bind(&payloads)
                .execute(&pool)
                .await;
            if let Err(e) = sent {
                tracing::debug!(error = %e, runs = batch.len(), "run changes not published; other replicas re-check");
            }
        }
    }
}

/// Relays the other replicas' changes to this process's waiters.
async fn listen(
    pool: sqlx::PgPool,
    replica: String,
    tx: broadcast::Sender<String>,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let own = format!("{replica}:");
    'connect: loop {
        let mut listener = loop {
            let attempt = async {
                let mut l = sqlx::postgres::PgListener::connect_with(&pool).await?;
                l.listen(CHANNEL).await?;
                Ok::<_, sqlx::Error>(l)
            };
            tokio::select! {
                () = closed(&mut closing) => return,
                l = attempt => match l {
                    Ok(l) => break l,
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot listen for run changes; retrying in 1 s");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                },
            }
        };
        // Whatever was sent while nobody listened is gone: everyone re-reads.
        let _ = tx.send(EVERY_RUN.to_owned());
        loop {
            let next = tokio::select! {
                () = closed(&mut closing) => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => {
                    if let Some(run) = n.payload().split_once(':').map(|(_, r)| r)
                        && !n.payload().starts_with(&own)
                    {
                        let _ = tx.send(run.to_owned());
                    }
                }
                // The connection dropped; try_recv reconnects on the next call, and the
                // gap may have lost notifications.
                Ok(None) => {
                    let _ = tx.send(EVERY_RUN.to_owned());
                }
                Err(e) => {
                    tracing::debug!(error = %e, "listening for run changes failed; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue 'connect;
                }
            }
        }
    }
}

/// Returns once the server closes (the watch's borrow is not held across awaits).
async fn closed(closing: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

#[derive(Debug)]
pub struct Subscription {
    rx: broadcast::Receiver<String>,
    closing: tokio::sync::watch::Receiver<bool>,
}

impl Subscription {
    /// Returns when `run_id` changed (here or on another replica), at the next re-check,
    /// or at `deadline`.
    pub async fn wait_for(&mut self, run_id: &str, deadline: Instant) {
        self.wait_for_new(run_id, deadline.min(Instant::now() + RECHECK))
            .await;
    }

    /// Returns true when `key` is notified (here or on another replica, or a lost view
    /// of them made it possible), false at `deadline` or when the server closes.
    pub async fn wait_for_new(&mut self, key: &str, deadline: Instant) -> bool {
        if *self.closing.borrow() {
            return false;
        }
        let closing = &mut self.closing;
        let rx = &mut self.rx;
        tokio::time::timeout_at(deadline, async {
            tokio::select! {
                _ = closing.wait_for(|c| *c) => false,
                () = next_change(rx, key) => true,
            }
        })
        .await
        .unwrap_or(false)
    }
}

async fn next_change(rx: &mut broadcast::Receiver<String>, run_id: &str) {
    loop {
        match rx.recv().await {
            Ok(changed) if changed == run_id || changed == EVERY_RUN => return,
            Ok(_) => {}
            // Lagged: something may have been missed; re-read now.
            Err(broadcast::error::RecvError::Lagged(_)) => return,
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}
