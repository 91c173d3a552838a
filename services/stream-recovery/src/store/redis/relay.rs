//! The relay of changes between replicas: every change a store makes to a run is
//! published on one channel, and every replica's subscriber wakes its own followers.

use std::sync::Arc;
use std::time::Duration;

use runplane_grpc::notifier::Notifier;

use super::connection::{RedisStore, client};

/// Relays the runs published on `channel` (by every replica's scripts and changes) to
/// this process's followers. Subscribes on one server (in a cluster any node hears every
/// node's PUBLISH), moving to the next seed when it fails; after a reconnect everyone is
/// woken, since what was published meanwhile is gone.
pub(super) async fn relay_changes(
    servers: Vec<String>,
    ca: Option<Arc<[u8]>>,
    channel: String,
    notifier: Notifier,
) {
    use futures::StreamExt;
    for server in servers.iter().cycle() {
        let subscribed = async {
            let mut pubsub = client(server, ca.as_deref())?.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(mut pubsub) => {
                notifier.notify_all();
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    if let Ok(run) = message.get_payload::<String>() {
                        notifier.notify(&run);
                    }
                }
                tracing::debug!(server = %runplane_config::redact_url(server), "stream changes subscription ended; resubscribing");
            }
            Err(e) => {
                tracing::debug!(server = %runplane_config::redact_url(server), error = %e, "cannot subscribe to stream changes; trying the next server in 1 s");
            }
        }
        notifier.notify_all();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

impl RedisStore {
    /// Wakes this process's followers of `run` at once and tells the other replicas. A
    /// publish that fails is only logged: their tails still re-read on their heartbeat.
    pub(super) async fn changed(&self, run: &str) {
        self.notifier.notify(run);
        let mut conn = self.conn.clone();
        let published: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(self.channel())
            .arg(run)
            .query_async(&mut conn)
            .await;
        if let Err(e) = published {
            tracing::debug!(run_id = run, error = %e, "stream change not published");
        }
    }
}
