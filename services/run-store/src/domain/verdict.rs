//! A run's verdict: how it ended and why, as the run store records it.
//!
//! The request's verdict becomes this type at the gRPC boundary (`convert`), and the
//! recorded one becomes the proto again there, for answers and for the receipt.

use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::entity::prelude::*;

use super::state::RunState;

/// How a run ended, as its verdict says: stored as its name (`succeeded`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EnumIter, DeriveActiveEnum)]
#[sea_orm(rs_type = "String", db_type = "Text")]
pub enum VerdictOutcome {
    #[sea_orm(string_value = "succeeded")]
    Succeeded,
    #[sea_orm(string_value = "failed")]
    Failed,
    #[sea_orm(string_value = "cancelled")]
    Cancelled,
}

impl VerdictOutcome {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// The terminal state this outcome puts a run in.
    pub fn run_state(self) -> RunState {
        match self {
            Self::Succeeded => RunState::Succeeded,
            Self::Failed => RunState::Failed,
            Self::Cancelled => RunState::Cancelled,
        }
    }
}

impl std::fmt::Display for VerdictOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not a verdict outcome's stored name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a verdict outcome: {0:?}")]
pub struct UnknownVerdictOutcome(pub String);

impl std::str::FromStr for VerdictOutcome {
    type Err = UnknownVerdictOutcome;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        <Self as sea_orm::Iterable>::iter()
            .find(|outcome| outcome.as_str() == name)
            .ok_or_else(|| UnknownVerdictOutcome(name.to_owned()))
    }
}

impl From<VerdictOutcome> for runstore_pb::VerdictOutcome {
    fn from(outcome: VerdictOutcome) -> Self {
        match outcome {
            VerdictOutcome::Succeeded => Self::Succeeded,
            VerdictOutcome::Failed => Self::Failed,
            VerdictOutcome::Cancelled => Self::Cancelled,
        }
    }
}

impl TryFrom<runstore_pb::VerdictOutcome> for VerdictOutcome {
    /// `VERDICT_OUTCOME_UNSPECIFIED`, which no run ends with.
    type Error = runstore_pb::VerdictOutcome;

    fn try_from(outcome: runstore_pb::VerdictOutcome) -> Result<Self, Self::Error> {
        Ok(match outcome {
            runstore_pb::VerdictOutcome::Succeeded => Self::Succeeded,
            runstore_pb::VerdictOutcome::Failed => Self::Failed,
            runstore_pb::VerdictOutcome::Cancelled => Self::Cancelled,
            runstore_pb::VerdictOutcome::Unspecified => return Err(outcome),
        })
    }
}

/// What a run ended with: its outcome, a snake_case reason, and the exit status when a
/// process gave one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub outcome: VerdictOutcome,
    pub reason: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub message: String,
}

impl Verdict {
    /// A verdict without an exit status: one the run store records itself (a cancel, a
    /// failure a service reports, a deadline).
    pub fn new(
        outcome: VerdictOutcome,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            outcome,
            reason: reason.into(),
            exit_code: None,
            signal: None,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every outcome's stored name parses back to it and maps to the proto value of the
    /// same name, and to the run state of that name; unspecified is no outcome.
    #[test]
    fn names_and_proto_values_round_trip() {
        for outcome in <VerdictOutcome as sea_orm::Iterable>::iter() {
            assert_eq!(outcome.as_str().parse(), Ok(outcome));
            assert_eq!(outcome.run_state().as_str(), outcome.as_str());
            let wire = runstore_pb::VerdictOutcome::from(outcome);
            assert_eq!(
                wire.as_str_name(),
                format!("VERDICT_OUTCOME_{}", outcome.as_str().to_uppercase())
            );
            assert_eq!(VerdictOutcome::try_from(wire), Ok(outcome));
        }
        assert!("unspecified".parse::<VerdictOutcome>().is_err());
        assert!(VerdictOutcome::try_from(runstore_pb::VerdictOutcome::Unspecified).is_err());
    }
}
