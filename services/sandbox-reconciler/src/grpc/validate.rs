//! The reconciler's checks of client input, before anything is read or written. Pure,
//! so the fuzz tests call them directly (`tests/fuzz.rs`).

use runplane_ids::{IdError, Name, SandboxId};
use runplane_proto::reconciler::v1 as reconciler_pb;

use crate::domain::status::SandboxStatus;
use crate::error::ReconcilerError;
use crate::store::nodes::Observation;

/// A list's page size: 0 means 100, at most 500.
pub(super) fn page_size(requested: u32) -> Result<u32, ReconcilerError> {
    runplane_grpc::page_size(requested, 100).map_err(|reason| ReconcilerError::InvalidField {
        field: "page_size",
        reason: reason.into(),
    })
}

/// PublishSandboxState's checks of its request, before the node's epoch is read or
/// anything is written: the node's epoch and the observation to publish. Pure, so it is
/// fuzzed (`tests/fuzz.rs`).
pub fn check_publication(
    req: &reconciler_pb::PublishSandboxStateRequest,
) -> Result<(i64, Observation<'_>), ReconcilerError> {
    node_name("node_id", &req.node_id)?;
    sandbox_id(&req.sandbox_id)?;
    let epoch = int64("epoch", req.epoch)?;
    let status = match req.status() {
        reconciler_pb::SandboxStatus::Started => SandboxStatus::Started,
        reconciler_pb::SandboxStatus::Suspended => SandboxStatus::Suspended,
        reconciler_pb::SandboxStatus::Restoring => SandboxStatus::Restoring,
        reconciler_pb::SandboxStatus::Exited => SandboxStatus::Exited,
        reconciler_pb::SandboxStatus::Lost => SandboxStatus::Lost,
        // The acknowledgement of a DESTROY assignment: the process is stopped.
        reconciler_pb::SandboxStatus::Deleted => SandboxStatus::Deleted,
        _ => {
            return Err(ReconcilerError::InvalidField {
                field: "status",
                reason: "must be started, suspended, restoring, exited, lost or deleted".into(),
            });
        }
    };
    Ok((
        epoch,
        Observation {
            sandbox_id: &req.sandbox_id,
            generation: int64("execution_generation", req.execution_generation)?,
            // Newer-than is all a sequence is compared for: past i64::MAX it stays newest.
            seq: req.observation_seq.min(i64::MAX as u64) as i64,
            status,
            placed: req.placed,
            exit_code: req.exit_code,
        },
    ))
}

/// A node id: a [`Name`].
pub(super) fn node_name(field: &'static str, value: &str) -> Result<(), ReconcilerError> {
    Name::parse(value)
        .map(|_| ())
        .map_err(|e| invalid(field, e))
}

/// Longest `reason` of DestroySandbox and RequestWake, as their protos document.
pub(super) const MAX_REASON_BYTES: usize = 256;

/// Refuses a client string longer than its documented bound.
pub(super) fn at_most(field: &'static str, value: &str, max: usize) -> Result<(), ReconcilerError> {
    if value.len() > max {
        return Err(ReconcilerError::InvalidField {
            field,
            reason: format!("at most {max} bytes"),
        });
    }
    Ok(())
}

/// A client's unsigned number as the signed column it is compared with: one past
/// `i64::MAX` would wrap to a negative value, so it is refused instead.
pub(super) fn int64(field: &'static str, value: u64) -> Result<i64, ReconcilerError> {
    i64::try_from(value).map_err(|_| ReconcilerError::InvalidField {
        field,
        reason: format!("must be at most {}", i64::MAX),
    })
}

/// As [`int64`], for 32-bit columns.
pub(super) fn int32(field: &'static str, value: u32) -> Result<i32, ReconcilerError> {
    i32::try_from(value).map_err(|_| ReconcilerError::InvalidField {
        field,
        reason: format!("must be at most {}", i32::MAX),
    })
}

/// A [`SandboxId`], in the field `sandbox_id`.
pub(super) fn sandbox_id(id: &str) -> Result<(), ReconcilerError> {
    SandboxId::parse(id)
        .map(|_| ())
        .map_err(|e| invalid("sandbox_id", e))
}

fn invalid(field: &'static str, e: IdError) -> ReconcilerError {
    ReconcilerError::InvalidField {
        field,
        reason: e.to_string(),
    }
}
