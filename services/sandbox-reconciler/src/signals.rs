//! Node notification: signals that hand work to node agents at once instead of at their
//! next poll (a sandbox *wake*, the restore of a suspended sandbox, is another thing).
//!
//! A node agent long-polls ListAssignedSandboxes; it answers when the node's assignments
//! change. Whatever may change them ends in a reconcile round (dispatch, wake assignment,
//! destroy intents), so every round signals the node long polls, here at once and on
//! the other reconciler replicas through Postgres `LISTEN/NOTIFY`
//! ([`runplane_db::notify`]): a long poll re-reads and answers only if its revision
//! moved. A request that queues work for a node (a reattach's wake) asks for a round
//! now rather than at the next interval. The interval's round stays the safety net, so
//! nothing depends on a signal arriving.

use std::sync::Arc;

use runplane_db::notify::{Relay, RelayTasks};
use runplane_grpc::notifier::{Notifier, Subscription};
use sea_orm::DatabaseConnection;
use tokio::sync::Notify;

/// The Postgres channel reconciler replicas signal assignment changes on.
pub const CHANNEL: &str = "runplane_node_assignments";

/// The node-notification relay's tasks ([`RelayTasks`]).
const RELAY_TASKS: RelayTasks = RelayTasks {
    publish: "sandbox-reconciler.relay.publish",
    listen: "sandbox-reconciler.relay.listen",
};

/// The one key node long polls wait on: a round may change any node's assignments.
const ASSIGNMENTS: &str = "assignments";

#[derive(Debug, Clone)]
pub struct Signals {
    nodes: Notifier,
    relay: Option<Relay>,
    round: Arc<Notify>,
}

impl Signals {
    /// Across every replica on `db` when it is Postgres (the relay's tasks declared in
    /// `tasks`), within this process otherwise.
    pub fn new(tasks: &runplane_grpc::Tasks, db: &DatabaseConnection) -> Self {
        let nodes = Notifier::new();
        let relay = (db.get_database_backend() == sea_orm::DbBackend::Postgres).then(|| {
            Relay::start(
                tasks,
                RELAY_TASKS,
                db.get_postgres_connection_pool().clone(),
                CHANNEL,
                nodes.clone(),
            )
        });
        Self {
            nodes,
            relay,
            round: Arc::default(),
        }
    }

    /// Node assignments may have changed: every node long poll re-reads.
    pub fn assignments_changed(&self) {
        self.nodes.notify(ASSIGNMENTS);
        if let Some(relay) = &self.relay {
            relay.publish(ASSIGNMENTS);
        }
    }

    /// Subscribe before reading the assignments, so a change in between is not lost.
    pub fn watch_assignments(&self) -> Subscription {
        self.nodes.subscribe(ASSIGNMENTS)
    }

    /// Work for a node was queued: run a round now.
    pub fn want_round(&self) {
        self.round.notify_one();
    }

    /// Returns when a round was asked for (a request made since the last one counts).
    pub async fn round_wanted(&self) {
        self.round.notified().await;
    }
}
