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

/// `sandboxes.limits` of a sandbox whose run's profile sets limits of its own:
/// `cpus=2;memory_mib=64;pids=512;disk_mib=10240`. Empty is the deployment's.
pub fn encode_limits(limits: &runplane_config::SandboxLimits) -> String {
    format!(
        "cpus={};memory_mib={};pids={};disk_mib={}",
        limits.cpus, limits.memory_mib, limits.pids, limits.disk_mib
    )
}

/// The limits [`encode_limits`] wrote; `None` for empty (the deployment's) or for text
/// it did not write.
pub fn decode_limits(text: &str) -> Option<runplane_config::SandboxLimits> {
    let mut limits = runplane_config::SandboxLimits::default();
    let mut seen = 0;
    for pair in text.split(';') {
        let (key, value) = pair.split_once('=')?;
        match key {
            "cpus" => limits.cpus = value.parse().ok()?,
            "memory_mib" => limits.memory_mib = value.parse().ok()?,
            "pids" => limits.pids = value.parse().ok()?,
            "disk_mib" => limits.disk_mib = value.parse().ok()?,
            _ => return None,
        }
        seen += 1;
    }
    (seen == 4).then_some(limits)
}

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

#[cfg(test)]
mod limits_tests {
    use super::*;

    #[test]
    fn limits_round_trip_and_anything_else_is_the_deployments() {
        let limits = runplane_config::SandboxLimits {
            cpus: 0.5,
            memory_mib: 64,
            pids: 32,
            disk_mib: 100,
        };
        assert_eq!(decode_limits(&encode_limits(&limits)), Some(limits));
        for other in [
            "",
            "cpus=1",
            "cpus=x;memory_mib=1;pids=1;disk_mib=1",
            "gpu=1",
        ] {
            assert_eq!(decode_limits(other), None, "{other}");
        }
    }
}
