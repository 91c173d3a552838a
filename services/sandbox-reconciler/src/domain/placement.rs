//! Where a sandbox is placed. One rule, used by every read of placement: the direct
//! route identity counts only while `active_node_id` is set. A node that suspends a
//! sandbox for idleness publishes it unplaced (clears `active_node_id`) and leaves its
//! route identity naming the node; reading that identity anyway would route a
//! reattach to a node where the sandbox no longer runs.

use std::time::Duration;

use crate::domain::status::SandboxStatus;
use crate::store::entities::{route_identity, sandbox};

/// Where the reconciler runs sandboxes itself (single-machine mode and `runplane dev`):
/// every sandbox is direct, placed on this node.
pub const LOCAL_NODE: &str = "local";

/// A node silent for longer than this is presumed gone, and so are its sandboxes (the
/// loss grace still applies).
pub const NODE_SILENCE: Duration = Duration::from_secs(10);

/// Statuses after which a sandbox never runs again.
pub const ENDED: [SandboxStatus; 3] = SandboxStatus::ENDED;

/// The node serving `sandbox`, if it is placed.
pub fn serving_node(
    sandbox: &sandbox::Model,
    route: Option<&route_identity::Model>,
) -> Option<String> {
    let active = sandbox.active_node_id.as_ref()?;
    match (sandbox.substrate.as_str(), route) {
        ("direct", Some(route)) => Some(route.current_node_id.clone()),
        _ => Some(active.clone()),
    }
}

/// The `network` of a new sandbox of a run on `profile`: `none` when the profile takes
/// the network away, empty (the deployment's) otherwise.
pub fn network_of(offline_profiles: &std::collections::BTreeSet<String>, profile: &str) -> String {
    if offline_profiles.contains(profile) {
        "none".to_owned()
    } else {
        String::new()
    }
}

pub fn is_ended(sandbox: &sandbox::Model) -> bool {
    sandbox.status.is_ended()
}
