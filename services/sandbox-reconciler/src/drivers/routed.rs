//! The reconciler's view of every sandbox: local ones through the process driver, ones
//! on node agents through what those nodes publish and how recently they heartbeat.
//!
//! Restores: the node agents run the process driver, so a sandbox suspended on a node
//! is restored by that node or not at all (see [`crate::domain::wake`]); a holder silent
//! past [`NODE_SILENCE`] probes the sandbox lost, and the loss grace then ends it.

use std::time::Duration;

use futures::future::BoxFuture;

use super::{Driver, DriverError, Launch, ProcessDriver};
use crate::domain::loss::Probe;
use crate::reconcile::LOCAL_NODE;
use crate::store::Store;
use crate::store::entities::sandbox;

/// A node silent for longer than this is presumed gone, and so are its sandboxes (the
/// loss grace still applies).
pub const NODE_SILENCE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct RoutedDriver {
    local: ProcessDriver,
    store: Store,
}

impl RoutedDriver {
    pub fn new(local: ProcessDriver, store: Store) -> Self {
        Self { local, store }
    }

    fn is_local(sandbox: &sandbox::Model) -> bool {
        sandbox.active_node_id.as_deref() == Some(LOCAL_NODE)
    }
}

impl Driver for RoutedDriver {
    fn create(
        &self,
        sandbox: &sandbox::Model,
        launch: Launch,
    ) -> BoxFuture<'static, Result<String, DriverError>> {
        if Self::is_local(sandbox) {
            return self.local.create(sandbox, launch);
        }
        Box::pin(async {
            Err(DriverError::Start(
                "a node agent launches this sandbox".into(),
            ))
        })
    }

    fn status(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Probe> {
        if Self::is_local(sandbox) {
            return self.local.status(sandbox);
        }
        let store = self.store.clone();
        let row = sandbox.clone();
        Box::pin(async move {
            // Placed: its node. Suspended for idleness and unplaced: the node holding it
            // (its route identity), which is the only one that can restore it, so a
            // holder gone for good ends it through the loss grace like a placed one.
            let node_id = match store.holder_of(&row).await {
                Ok(Some(node_id)) => node_id,
                // No node holds a direct execution: nothing can ever restore it.
                Ok(None) if row.substrate == "direct" => return Probe::Lost,
                // Restorable by any node: it waits for a wake.
                Ok(None) => return Probe::Alive,
                // The database is what failed; that says nothing about the sandbox.
                Err(_) => return Probe::Alive,
            };
            match store.ready_nodes(store.silent_since()).await {
                Ok(nodes) if nodes.iter().any(|n| n.id == node_id) => {}
                Ok(_) => return Probe::Lost,
                // The database is what failed; that says nothing about the sandbox.
                Err(_) => return Probe::Alive,
            }
            match row.observed_status.as_str() {
                "exited" => Probe::Exited(row.exit_code),
                "lost" => Probe::Lost,
                _ => Probe::Alive,
            }
        })
    }

    fn suspend(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.suspend(sandbox)
    }

    fn resume(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.resume(sandbox)
    }

    fn destroy(&self, sandbox: &sandbox::Model) -> BoxFuture<'static, Result<(), DriverError>> {
        self.local.destroy(sandbox)
    }
}
