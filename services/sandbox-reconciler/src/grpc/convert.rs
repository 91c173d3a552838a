//! The wire forms of the reconciler's rows.

use runplane_proto::reconciler::v1 as reconciler_pb;
use sha2::{Digest, Sha256};

use crate::domain::sandbox::{NO_NETWORK, Substrate};
use crate::store::Placement;
use crate::store::entities::{node, sandbox, wake};
use crate::store::nodes::Assigned;

pub(super) fn node_of(n: &node::Model) -> reconciler_pb::Node {
    reconciler_pb::Node {
        id: n.id.clone(),
        endpoint: n.endpoint.clone(),
        capacity: n.capacity as u32,
        used: n.used as u32,
        labels: Default::default(),
        epoch: n.epoch as u64,
        state: reconciler_pb::NodeState::Ready as i32,
        registered_at: Some(runplane_clock::to_timestamp(n.registered_at_us)),
        last_heartbeat_at: Some(runplane_clock::to_timestamp(n.last_heartbeat_us)),
    }
}

pub(super) fn assignment_of(a: &Assigned) -> reconciler_pb::Assignment {
    let (row, intent, wake) = match a {
        Assigned::Run(row) => (row, reconciler_pb::AssignmentIntent::Run, None),
        Assigned::Restore(row, wake) => (row, reconciler_pb::AssignmentIntent::Restore, Some(wake)),
        Assigned::Destroy(row) => (row, reconciler_pb::AssignmentIntent::Destroy, None),
        Assigned::Suspend(row) => (row, reconciler_pb::AssignmentIntent::Suspend, None),
    };
    reconciler_pb::Assignment {
        sandbox_id: row.id.clone(),
        run_id: row.run_id.clone(),
        intent: intent as i32,
        execution_generation: row.execution_generation as u64,
        wake_id: wake.map(|w| w.id.clone()).unwrap_or_default(),
        wake_attempt: wake.map(|w| w.attempts as u32).unwrap_or_default(),
        idle_timeout: Some(prost_types::Duration {
            seconds: row.idle_timeout_ms / 1000,
            nanos: ((row.idle_timeout_ms % 1000) * 1_000_000) as i32,
        }),
        no_network: row.network == NO_NETWORK,
        limits: crate::domain::sandbox::decode_limits(&row.limits).map(|l| {
            reconciler_pb::SandboxLimits {
                cpus: l.cpus,
                memory_mib: l.memory_mib,
                pids: l.pids,
                disk_mib: l.disk_mib,
            }
        }),
        image: row.image.clone(),
    }
}

/// A revision that changes whenever the assignment list does.
pub(super) fn revision(assignments: &[reconciler_pb::Assignment]) -> u64 {
    let mut h = Sha256::new();
    for a in assignments {
        h.update(a.sandbox_id.as_bytes());
        h.update(a.intent.to_be_bytes());
        h.update(a.execution_generation.to_be_bytes());
        h.update(a.wake_id.as_bytes());
        h.update(a.wake_attempt.to_be_bytes());
    }
    u64::from_be_bytes(h.finalize()[..8].try_into().expect("8 bytes")).max(1)
}

pub(super) fn wake_of(w: &wake::Model) -> reconciler_pb::Wake {
    reconciler_pb::Wake {
        id: w.id.clone(),
        sandbox_id: w.sandbox_id.clone(),
        state: match w.state.as_str() {
            "pending" => reconciler_pb::WakeState::Pending,
            "assigned" => reconciler_pb::WakeState::Assigned,
            "restored" => reconciler_pb::WakeState::Restored,
            "failed" => reconciler_pb::WakeState::Failed,
            _ => reconciler_pb::WakeState::Unspecified,
        } as i32,
        node_id: w.node_id.clone().unwrap_or_default(),
        attempts: w.attempts as u32,
        last_error: w.last_error.clone(),
        requested_at: Some(runplane_clock::to_timestamp(w.requested_at_us)),
        settled_at: w.settled_at_us.map(runplane_clock::to_timestamp),
    }
}

/// A sandbox as the API shows it: placement through the one placement rule.
pub fn sandbox_of(p: &Placement, pending_wake: Option<&wake::Model>) -> reconciler_pb::Sandbox {
    let s: &sandbox::Model = &p.sandbox;
    reconciler_pb::Sandbox {
        id: s.id.clone(),
        run_id: s.run_id.clone(),
        org_id: s.org_id.clone(),
        substrate: match Substrate::named(&s.substrate) {
            Substrate::Direct => reconciler_pb::Substrate::Direct,
            Substrate::Kubernetes => reconciler_pb::Substrate::Kubernetes,
            Substrate::Other => reconciler_pb::Substrate::Unspecified,
        } as i32,
        status: reconciler_pb::SandboxStatus::from(s.status) as i32,
        active_node_id: s.active_node_id.clone().unwrap_or_default(),
        route_identity: p.route.as_ref().map(|r| reconciler_pb::RouteIdentity {
            current_node_id: r.current_node_id.clone(),
            execution_generation: r.execution_generation as u64,
        }),
        execution_generation: s.execution_generation as u64,
        loss_observed_at: s.loss_observed_at_us.map(runplane_clock::to_timestamp),
        idle_timeout: Some(prost_types::Duration {
            seconds: s.idle_timeout_ms / 1000,
            nanos: ((s.idle_timeout_ms % 1000) * 1_000_000) as i32,
        }),
        exit_code: s.exit_code,
        pending_wake: pending_wake.map(wake_of),
        created_at: Some(runplane_clock::to_timestamp(s.created_at_us)),
        updated_at: Some(runplane_clock::to_timestamp(s.updated_at_us)),
    }
}

pub(super) fn node_credential_of(
    c: &crate::store::entities::node_credential::Model,
) -> reconciler_pb::NodeCredential {
    reconciler_pb::NodeCredential {
        id: c.id.clone(),
        node_id: c.node_id.clone(),
        created_at: Some(runplane_clock::to_timestamp(c.created_at_us)),
        revoked_at: c.revoked_at_us.map(runplane_clock::to_timestamp),
        max_capacity: c.max_capacity.clamp(0, i64::from(u32::MAX)) as u32,
    }
}
