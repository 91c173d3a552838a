//! What a driver is given of a sandbox: its spec, apart from the row that persists it.

use crate::store::entities::sandbox;

/// Which sandbox, which execution of it, how its process is found again and how it is
/// contained. The reconciler makes one from its row; a node agent, which has no
/// database, from its assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSpec {
    pub id: String,
    pub run_id: String,
    /// The execution this spec is of; a later one supersedes it.
    pub execution_generation: i64,
    /// What the driver needs to find the sandbox again (a pid for `process`); empty
    /// before it was started.
    pub driver_handle: String,
    /// `none`: its agent has no network. Empty: the deployment's.
    pub network: String,
    /// The node it is placed on; `None` when unplaced.
    pub active_node_id: Option<String>,
    /// How long it may sit idle before its node suspends it; zero: never.
    pub idle_timeout_ms: i64,
}

impl From<&sandbox::Model> for SandboxSpec {
    fn from(row: &sandbox::Model) -> Self {
        Self {
            id: row.id.clone(),
            run_id: row.run_id.clone(),
            execution_generation: row.execution_generation,
            driver_handle: row.driver_handle.clone(),
            network: row.network.clone(),
            active_node_id: row.active_node_id.clone(),
            idle_timeout_ms: row.idle_timeout_ms,
        }
    }
}
