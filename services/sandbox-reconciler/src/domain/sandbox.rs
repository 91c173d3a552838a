//! What the reconciler's decisions read of a sandbox and of its route identity: values
//! apart from the rows that persist them (`store::entities` makes them from rows), so the
//! domain never reads a row.

use crate::domain::status::SandboxStatus;

/// The substrate a sandbox runs on, as `sandboxes.substrate` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Substrate {
    /// Processes on one node agent's host, which only that host can suspend and restore.
    Direct,
    /// Pods, whose sandboxes any node can restore (no driver creates them yet).
    Kubernetes,
    /// A name this version does not know.
    Other,
}

impl Substrate {
    /// `sandboxes.substrate` of a direct sandbox.
    pub const DIRECT: &'static str = "direct";
    /// `sandboxes.substrate` of a Kubernetes sandbox.
    pub const KUBERNETES: &'static str = "kubernetes";

    /// The substrate a stored name says.
    pub fn named(name: &str) -> Self {
        match name {
            Self::DIRECT => Self::Direct,
            Self::KUBERNETES => Self::Kubernetes,
            _ => Self::Other,
        }
    }
}

/// `sandboxes.network` of a sandbox whose agent has no network (its run's profile says
/// `network = "none"`); empty is the deployment's network.
pub const NO_NETWORK: &str = "none";

/// What placement and wakes read of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxPlacement<'a> {
    pub id: &'a str,
    pub substrate: Substrate,
    /// The node it is placed on; `None` when unplaced.
    pub active_node_id: Option<&'a str>,
    pub execution_generation: i64,
    /// What a node or probe last reported; `None` before anything was.
    pub observed: Option<SandboxStatus>,
}

/// A direct sandbox's route identity: the node that ran an execution of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteIdentity<'a> {
    pub sandbox_id: &'a str,
    pub execution_generation: i64,
    pub current_node_id: &'a str,
}
