//! Who restores a suspended sandbox, and how a failed restore backs off.
//!
//! A wake goes to the node that holds the sandbox: the node its route identity names at
//! the sandbox's execution generation (or, while placed, the node it is placed on). The
//! node agents' process driver suspends by SIGSTOP and restores by SIGCONT to processes
//! only their own host can see, so no other node can restore a direct sandbox. While the
//! holder is silent the wake waits for it; a holder gone past the loss grace ends the
//! sandbox as lost instead (the reconcile tick probes an unplaced sandbox through its
//! holder's heartbeat). Only a substrate whose sandboxes any node can restore (not
//! `direct`) has its wakes handed to whichever ready node is least used.

use std::time::Duration;

use crate::domain::sandbox::{RouteIdentity, SandboxPlacement, Substrate};
use crate::domain::status::SandboxStatus;

/// Where a pending wake may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeTarget<'a> {
    /// Only this node can restore it; the wake waits while the node is not ready.
    Holder(&'a str),
    /// Any ready node can restore it.
    AnyNode,
    /// No node holds this execution: nothing can restore it.
    Nobody,
}

/// The node holding `sandbox`'s current execution: the node it is placed on, else (idle
/// suspended, unplaced) the one its route identity names at the sandbox's generation. A
/// route identity of another generation names a node that ran an older execution and
/// holds nothing of this one.
pub fn holder<'a>(
    sandbox: &SandboxPlacement<'a>,
    route: Option<RouteIdentity<'a>>,
) -> Option<&'a str> {
    sandbox.active_node_id.or_else(|| {
        route
            .filter(|r| {
                r.sandbox_id == sandbox.id && r.execution_generation == sandbox.execution_generation
            })
            .map(|r| r.current_node_id)
    })
}

pub fn wake_target<'a>(
    sandbox: &SandboxPlacement<'a>,
    route: Option<RouteIdentity<'a>>,
) -> WakeTarget<'a> {
    if sandbox.substrate != Substrate::Direct {
        return WakeTarget::AnyNode;
    }
    holder(sandbox, route).map_or(WakeTarget::Nobody, WakeTarget::Holder)
}

/// Observed statuses with which an unplaced sandbox's holder said its process is gone
/// (a restore found it exited or missing): nothing is left to restore, and the loss
/// grace ends it.
pub const GONE: [SandboxStatus; 2] = [SandboxStatus::Exited, SandboxStatus::Lost];

/// Whether `sandbox`'s holder reported it gone while it was suspended.
pub fn gone_on_holder(sandbox: &SandboxPlacement) -> bool {
    sandbox.active_node_id.is_none() && sandbox.observed.is_some_and(|seen| GONE.contains(&seen))
}

/// The longest a failed restore waits before the next attempt, and what a new wake
/// waits after the previous one failed for good.
pub const RESTORE_BACKOFF_CAP: Duration = Duration::from_secs(30);

/// How long after its `failed`-th failed attempt (1, 2, …) a wake waits before it is
/// handed out again: 1 s doubling, at most [`RESTORE_BACKOFF_CAP`].
pub fn restore_backoff(failed: i32) -> Duration {
    let doublings = failed.saturating_sub(1).clamp(0, 16) as u32;
    Duration::from_secs(1)
        .saturating_mul(1 << doublings)
        .min(RESTORE_BACKOFF_CAP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_to_its_cap() {
        let waits: Vec<u64> = (1..=7).map(|n| restore_backoff(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(restore_backoff(i32::MAX), RESTORE_BACKOFF_CAP);
        assert_eq!(restore_backoff(0), Duration::from_secs(1));
    }
}
