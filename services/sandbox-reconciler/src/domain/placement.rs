//! Where a sandbox is placed. One rule, used by every read of placement: the direct
//! route identity counts only while `active_node_id` is set. A node that suspends a
//! sandbox for idleness publishes it unplaced (clears `active_node_id`) and leaves its
//! route identity naming the node; reading that identity anyway would route a
//! reattach to a node where the sandbox no longer runs.

use std::time::Duration;

use crate::domain::sandbox::{NO_NETWORK, RouteIdentity, SandboxPlacement, Substrate};
use crate::domain::status::SandboxStatus;

/// Where the reconciler runs sandboxes itself (single-machine mode and `runplane dev`):
/// every sandbox is direct, placed on this node.
pub const LOCAL_NODE: &str = "local";

/// A node silent for longer than this is presumed gone, and so are its sandboxes (the
/// loss grace still applies).
pub const NODE_SILENCE: Duration = Duration::from_secs(10);

/// Statuses after which a sandbox never runs again.
pub const ENDED: [SandboxStatus; 3] = SandboxStatus::ENDED;

/// The node serving `sandbox`, if it is placed.
pub fn serving_node(sandbox: &SandboxPlacement, route: Option<RouteIdentity>) -> Option<String> {
    let active = sandbox.active_node_id?;
    match (sandbox.substrate, route) {
        (Substrate::Direct, Some(route)) => Some(route.current_node_id.to_owned()),
        _ => Some(active.to_owned()),
    }
}

/// What each profile's sandboxes get that differs from the deployment's: no network,
/// limits of their own, an image of their own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProfileSandboxes {
    /// Profiles whose sandboxes get no network (`network = "none"`).
    pub offline: std::collections::BTreeSet<String>,
    /// Profiles with limits of their own, over the deployment's.
    pub limits: std::collections::BTreeMap<String, runplane_config::SandboxLimits>,
    /// Profiles with an image of their own, for the container driver.
    pub images: std::collections::BTreeMap<String, String>,
}

impl ProfileSandboxes {
    pub fn from_config(config: &runplane_config::Config) -> Self {
        Self {
            offline: config.credential_health.offline_profiles(),
            limits: config
                .credential_health
                .profile_limits(&config.sandbox_reconciler.limits),
            images: config.credential_health.profile_images(),
        }
    }

    /// The `network` of a new sandbox of a run on `profile`: `none` when the profile
    /// takes the network away, empty (the deployment's) otherwise.
    pub fn network_of(&self, profile: &str) -> String {
        if self.offline.contains(profile) {
            NO_NETWORK.to_owned()
        } else {
            String::new()
        }
    }

    /// The `image` of a new sandbox of a run on `profile`: the profile's own; empty for
    /// the deployment's.
    pub fn image_of(&self, profile: &str) -> String {
        self.images.get(profile).cloned().unwrap_or_default()
    }

    /// The `limits` of a new sandbox of a run on `profile`: the profile's own, written
    /// as [`crate::domain::sandbox::encode_limits`] does; empty for the deployment's.
    pub fn limits_of(&self, profile: &str) -> String {
        self.limits
            .get(profile)
            .map(crate::domain::sandbox::encode_limits)
            .unwrap_or_default()
    }
}

/// A ready node's room as dispatch counts it: its capacity, and what of it is free
/// (capacity less the sandboxes placed on it, never below zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRoom {
    pub node_id: String,
    pub capacity: i64,
    pub free: i64,
}

impl NodeRoom {
    pub fn new(node_id: String, capacity: i32, placed: i64) -> Self {
        let capacity = i64::from(capacity);
        Self {
            node_id,
            capacity,
            free: (capacity - placed).max(0),
        }
    }
}

/// Where this round's runs may go, and how many slots it claims for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchPlan {
    /// No node is ready and local sandboxes are off, or every ready node is full: claim
    /// nothing, and runs wait QUEUED.
    Wait,
    /// No node is ready: runs start on this host, at most `claim_per_round` of them.
    Local { max_runs: u32 },
    /// Runs go to the ready nodes, as many as they have room for.
    Nodes { max_runs: u32 },
}

/// The plan for a round that sees `rooms` (one per ready node). Slots are claimed only
/// where a sandbox can be placed, so a run is never claimed into a round that cannot
/// place it.
pub fn plan_dispatch(
    rooms: &[NodeRoom],
    local_sandboxes: bool,
    claim_per_round: u32,
) -> DispatchPlan {
    if rooms.is_empty() {
        return if local_sandboxes {
            DispatchPlan::Local {
                max_runs: claim_per_round,
            }
        } else {
            DispatchPlan::Wait
        };
    }
    let free: i64 = rooms.iter().map(|room| room.free).sum();
    if free > 0 {
        DispatchPlan::Nodes {
            max_runs: u32::try_from(free).unwrap_or(u32::MAX),
        }
    } else {
        DispatchPlan::Wait
    }
}

/// The node a run goes to: the one with the most free room, the smaller id on a tie (so
/// replicas that see the same rooms choose alike); `None` when every node is full.
pub fn choose_node(rooms: &[NodeRoom]) -> Option<usize> {
    rooms
        .iter()
        .enumerate()
        .filter(|(_, room)| room.free > 0)
        .max_by(|(_, a), (_, b)| a.free.cmp(&b.free).then_with(|| b.node_id.cmp(&a.node_id)))
        .map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rooms(free: &[(&str, i32, i64)]) -> Vec<NodeRoom> {
        free.iter()
            .map(|(id, capacity, placed)| NodeRoom::new((*id).to_owned(), *capacity, *placed))
            .collect()
    }

    #[test]
    fn a_node_over_its_capacity_has_no_room_not_negative_room() {
        assert_eq!(NodeRoom::new("a".into(), 2, 5).free, 0);
        assert_eq!(NodeRoom::new("a".into(), 4, 1).free, 3);
    }

    #[test]
    fn without_ready_nodes_runs_start_here_only_where_local_sandboxes_are_allowed() {
        assert_eq!(
            plan_dispatch(&[], true, 100),
            DispatchPlan::Local { max_runs: 100 }
        );
        assert_eq!(plan_dispatch(&[], false, 100), DispatchPlan::Wait);
    }

    #[test]
    fn ready_nodes_take_as_many_runs_as_they_have_room_for_and_full_ones_none() {
        let some = rooms(&[("a", 4, 1), ("b", 2, 2), ("c", 1, 0)]);
        assert_eq!(
            plan_dispatch(&some, true, 100),
            DispatchPlan::Nodes { max_runs: 4 }
        );
        // Full nodes do not send runs here, even where local sandboxes are allowed.
        let full = rooms(&[("a", 1, 1), ("b", 2, 3)]);
        assert_eq!(plan_dispatch(&full, true, 100), DispatchPlan::Wait);
    }

    #[test]
    fn the_node_with_the_most_room_is_chosen_and_a_tie_goes_to_the_smaller_id() {
        let some = rooms(&[("b", 4, 1), ("a", 4, 1), ("c", 2, 0)]);
        assert_eq!(
            choose_node(&some).map(|i| some[i].node_id.as_str()),
            Some("a")
        );
        let mut fewer = rooms(&[("b", 4, 0), ("a", 4, 3)]);
        assert_eq!(
            choose_node(&fewer).map(|i| fewer[i].node_id.as_str()),
            Some("b")
        );
        for room in &mut fewer {
            room.free = 0;
        }
        assert_eq!(choose_node(&fewer), None);
    }
}
