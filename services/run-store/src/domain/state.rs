//! A run's state: stored as its name (`queued`, …), sent as the proto enum.

use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::entity::prelude::*;

/// Where a run is in its life. A run leaves the live states only once, through
/// `finish_locked`; a succeeded or failed run may still become `backend_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EnumIter, DeriveActiveEnum)]
#[sea_orm(rs_type = "String", db_type = "Text")]
pub enum RunState {
    /// Waiting for a slot on its credential.
    #[sea_orm(string_value = "queued")]
    Queued,
    /// Given a slot (or a key); no runner has said hello yet.
    #[sea_orm(string_value = "starting")]
    Starting,
    #[sea_orm(string_value = "running")]
    Running,
    #[sea_orm(string_value = "succeeded")]
    Succeeded,
    #[sea_orm(string_value = "failed")]
    Failed,
    #[sea_orm(string_value = "cancelled")]
    Cancelled,
    /// Died of a backend error (the durable outcome credential health reported).
    #[sea_orm(string_value = "backend_error")]
    BackendError,
}

impl RunState {
    /// States a run can still leave on its own.
    pub const LIVE: [Self; 3] = [Self::Queued, Self::Starting, Self::Running];

    /// States of a run that holds a slot on its credential.
    pub const ACTIVE: [Self; 2] = [Self::Starting, Self::Running];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::BackendError => "backend_error",
        }
    }

    pub fn is_terminal(self) -> bool {
        !Self::LIVE.contains(&self)
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not a run state's stored name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a run state: {0:?}")]
pub struct UnknownRunState(pub String);

impl std::str::FromStr for RunState {
    type Err = UnknownRunState;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        <Self as sea_orm::Iterable>::iter()
            .find(|state| state.as_str() == name)
            .ok_or_else(|| UnknownRunState(name.to_owned()))
    }
}

impl From<RunState> for runstore_pb::RunState {
    fn from(state: RunState) -> Self {
        match state {
            RunState::Queued => Self::Queued,
            RunState::Starting => Self::Starting,
            RunState::Running => Self::Running,
            RunState::Succeeded => Self::Succeeded,
            RunState::Failed => Self::Failed,
            RunState::Cancelled => Self::Cancelled,
            RunState::BackendError => Self::BackendError,
        }
    }
}

impl TryFrom<runstore_pb::RunState> for RunState {
    /// `RUN_STATE_UNSPECIFIED`, which is never stored.
    type Error = runstore_pb::RunState;

    fn try_from(state: runstore_pb::RunState) -> Result<Self, Self::Error> {
        Ok(match state {
            runstore_pb::RunState::Queued => Self::Queued,
            runstore_pb::RunState::Starting => Self::Starting,
            runstore_pb::RunState::Running => Self::Running,
            runstore_pb::RunState::Succeeded => Self::Succeeded,
            runstore_pb::RunState::Failed => Self::Failed,
            runstore_pb::RunState::Cancelled => Self::Cancelled,
            runstore_pb::RunState::BackendError => Self::BackendError,
            runstore_pb::RunState::Unspecified => return Err(state),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every state's stored name parses back to it and maps to the proto value of the
    /// same name; the proto's unspecified value is no state.
    #[test]
    fn names_and_proto_values_round_trip() {
        for state in <RunState as sea_orm::Iterable>::iter() {
            assert_eq!(state.as_str().parse(), Ok(state));
            let wire = runstore_pb::RunState::from(state);
            assert_eq!(
                wire.as_str_name(),
                format!("RUN_STATE_{}", state.as_str().to_uppercase())
            );
            assert_eq!(RunState::try_from(wire), Ok(state));
        }
        assert!("".parse::<RunState>().is_err());
        assert!(RunState::try_from(runstore_pb::RunState::Unspecified).is_err());
    }
}
