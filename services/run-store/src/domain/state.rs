//! Run states as stored, and which are terminal.

use runplane_proto::runstore::v1::{RunState, VerdictOutcome};

pub const QUEUED: &str = "queued";
pub const STARTING: &str = "starting";
pub const RUNNING: &str = "running";
pub const SUCCEEDED: &str = "succeeded";
pub const FAILED: &str = "failed";
pub const CANCELLED: &str = "cancelled";
pub const BACKEND_ERROR: &str = "backend_error";

/// States a run can still leave on its own.
pub const LIVE: [&str; 3] = [QUEUED, STARTING, RUNNING];

pub fn is_terminal(state: &str) -> bool {
    !LIVE.contains(&state)
}

pub fn to_proto(state: &str) -> RunState {
    match state {
        QUEUED => RunState::Queued,
        STARTING => RunState::Starting,
        RUNNING => RunState::Running,
        SUCCEEDED => RunState::Succeeded,
        FAILED => RunState::Failed,
        CANCELLED => RunState::Cancelled,
        BACKEND_ERROR => RunState::BackendError,
        _ => RunState::Unspecified,
    }
}

pub fn from_proto(state: RunState) -> Option<&'static str> {
    Some(match state {
        RunState::Queued => QUEUED,
        RunState::Starting => STARTING,
        RunState::Running => RUNNING,
        RunState::Succeeded => SUCCEEDED,
        RunState::Failed => FAILED,
        RunState::Cancelled => CANCELLED,
        RunState::BackendError => BACKEND_ERROR,
        RunState::Unspecified => return None,
    })
}

/// The terminal state a verdict outcome puts a run in.
pub fn for_outcome(outcome: VerdictOutcome) -> Option<&'static str> {
    Some(match outcome {
        VerdictOutcome::Succeeded => SUCCEEDED,
        VerdictOutcome::Failed => FAILED,
        VerdictOutcome::Cancelled => CANCELLED,
        VerdictOutcome::Unspecified => return None,
    })
}

pub fn outcome_name(outcome: VerdictOutcome) -> &'static str {
    match outcome {
        VerdictOutcome::Succeeded => "succeeded",
        VerdictOutcome::Failed => "failed",
        VerdictOutcome::Cancelled => "cancelled",
        VerdictOutcome::Unspecified => "unspecified",
    }
}

pub fn outcome_from_name(name: &str) -> VerdictOutcome {
    match name {
        "succeeded" => VerdictOutcome::Succeeded,
        "failed" => VerdictOutcome::Failed,
        "cancelled" => VerdictOutcome::Cancelled,
        _ => VerdictOutcome::Unspecified,
    }
}
