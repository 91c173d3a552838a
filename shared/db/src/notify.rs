//! In-process notification ([`runplane_grpc::notifier`]) carried across replicas through
//! Postgres `LISTEN/NOTIFY`.
//!
//! Each replica publishes the keys it changed on one channel (coalesced into one
//! `pg_notify` statement per burst, off the request path, retried a second later when it
//! fails) and listens on it, waking its own waiters for the other replicas' keys. A
//! payload is `<replica>:<key>`; a replica skips its own echoes. NOTIFY is delivered at
//! commit to every listener, and the replicas already share the database, so they need
//! not know each other. A listener that lost its connection wakes every waiter once it
//! is back, since notifications sent meanwhile are gone. Both are declared tasks of the
//! service that runs the relay ([`RelayTasks`]); they stop when the waiters are closed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use runplane_grpc::notifier::Notifier;
use runplane_grpc::{OnCancel, OnPanic, Task, Tasks};
use sea_orm::sqlx;
use tokio::sync::Notify;

/// Most keys one `pg_notify` statement carries; more go in the next.
const PUBLISH_BATCH: usize = 500;

/// This replica's side of a channel: what it changed and has not published yet.
#[derive(Debug, Clone)]
pub struct Relay {
    outgoing: Arc<Outgoing>,
}

#[derive(Debug, Default)]
struct Outgoing {
    keys: Mutex<HashSet<String>>,
    kick: Notify,
}

/// The names of a relay's two declared tasks, given by the service that runs it.
#[derive(Debug, Clone, Copy)]
pub struct RelayTasks {
    /// Publishes this replica's keys (`<service>.relay.publish`).
    pub publish: &'static str,
    /// Listens for the other replicas' keys (`<service>.relay.listen`).
    pub listen: &'static str,
}

impl RelayTasks {
    /// Both are aborted at shutdown: a notification is not durable, and a replica that
    /// starts again re-reads everything. A panic is logged and the task restarts after
    /// the pause ([`runplane_grpc::OnPanic::Restart`]): a relay that died in silence would
    /// leave this replica's waiters deaf to the others until the next re-check. A
    /// restarted listener wakes every waiter, since what was sent meanwhile is gone.
    fn task(name: &'static str) -> Task {
        Task {
            name,
            on_cancel: OnCancel::Abort,
            on_panic: OnPanic::Restart,
        }
    }
}

impl Relay {
    /// Publishes to and listens on `channel` for `waiters`, as two declared tasks of
    /// `tasks` named by `names`.
    pub fn start<V>(
        tasks: &Tasks,
        names: RelayTasks,
        pool: sqlx::PgPool,
        channel: &'static str,
        waiters: Notifier<V>,
    ) -> Self
    where
        V: Clone + Send + Sync + 'static,
    {
        let outgoing = Arc::new(Outgoing::default());
        let replica = uuid::Uuid::new_v4().simple().to_string();
        tasks.spawn(RelayTasks::task(names.publish), {
            let (pool, outgoing, replica, waiters) = (
                pool.clone(),
                outgoing.clone(),
                replica.clone(),
                waiters.clone(),
            );
            move |_| {
                publish(
                    pool.clone(),
                    channel,
                    outgoing.clone(),
                    replica.clone(),
                    waiters.clone(),
                )
            }
        });
        tasks.spawn(RelayTasks::task(names.listen), move |_| {
            listen(pool.clone(), channel, replica.clone(), waiters.clone())
        });
        Self { outgoing }
    }

    /// Tells the other replicas that `key` changed, at the next publish.
    pub fn publish(&self, key: &str) {
        self.outgoing
            .keys
            .lock()
            .expect("outgoing keys")
            .insert(key.to_owned());
        self.outgoing.kick.notify_one();
    }
}

async fn publish<V: Clone>(
    pool: sqlx::PgPool,
    channel: &'static str,
    out: Arc<Outgoing>,
    replica: String,
    waiters: Notifier<V>,
) {
    loop {
        tokio::select! {
            () = waiters.closed() => return,
            () = out.kick.notified() => {}
        }
        let keys: Vec<String> = std::mem::take(&mut *out.keys.lock().expect("outgoing keys"))
            .into_iter()
            .collect();
        for batch in keys.chunks(PUBLISH_BATCH) {
            let payloads: Vec<String> = batch.iter().map(|k| format!("{replica}:{k}")).collect();
            // A NOTIFY takes a transaction id, so its commit would wait for a WAL flush
            // like any write: it need not (nothing depends on a notification arriving,
            // and NOTIFY is not durable anyway), so this transaction commits
            // asynchronously. One statement, one round trip.
            let sent = sqlx::query(
                "SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, p) \
                 FROM unnest($2::text[]) AS p",
            )
            .bind(channel)
            .bind(&payloads)
            .execute(&pool)
            .await;
            if let Err(e) = sent {
                tracing::debug!(error = %e, channel, keys = batch.len(), "changes not published; retrying in 1 s");
                out.keys
                    .lock()
                    .expect("outgoing keys")
                    .extend(batch.iter().cloned());
                out.kick.notify_one();
                tokio::select! {
                    () = waiters.closed() => return,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                break;
            }
        }
    }
}

/// Relays the other replicas' keys to this process's waiters.
async fn listen<V: Clone>(
    pool: sqlx::PgPool,
    channel: &'static str,
    replica: String,
    waiters: Notifier<V>,
) {
    let own = format!("{replica}:");
    'connect: loop {
        let mut listener = loop {
            let attempt = async {
                let mut l = sqlx::postgres::PgListener::connect_with(&pool).await?;
                l.listen(channel).await?;
                Ok::<_, sqlx::Error>(l)
            };
            tokio::select! {
                () = waiters.closed() => return,
                l = attempt => match l {
                    Ok(l) => break l,
                    Err(e) => {
                        tracing::debug!(error = %e, channel, "cannot listen for changes; retrying in 1 s");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                },
            }
        };
        // Whatever was sent while nobody listened is gone: everyone re-reads.
        waiters.notify_all();
        loop {
            let next = tokio::select! {
                () = waiters.closed() => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => {
                    if let Some(key) = n.payload().split_once(':').map(|(_, k)| k)
                        && !n.payload().starts_with(&own)
                    {
                        waiters.notify(key);
                    }
                }
                // The connection dropped; try_recv reconnects on the next call, and the
                // gap may have lost notifications.
                Ok(None) => waiters.notify_all(),
                Err(e) => {
                    tracing::debug!(error = %e, channel, "listening for changes failed; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue 'connect;
                }
            }
        }
    }
}
