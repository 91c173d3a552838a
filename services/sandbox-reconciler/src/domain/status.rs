//! A sandbox's status: stored as its name (`started`, …), sent as the proto enum.

use runplane_proto::reconciler::v1 as reconciler_pb;
use sea_orm::entity::prelude::*;

/// Where a sandbox is in its life. `status` is what the reconciler holds true;
/// `observed_status` is what a node or probe last reported, which for an exit or a loss
/// is only an observation until the loss grace confirms it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EnumIter, DeriveActiveEnum)]
#[sea_orm(rs_type = "String", db_type = "Text")]
pub enum SandboxStatus {
    /// Being created; not running yet.
    #[sea_orm(string_value = "creating")]
    Creating,
    #[sea_orm(string_value = "started")]
    Started,
    /// Suspended (SIGSTOP on direct); a wake restores it.
    #[sea_orm(string_value = "suspended")]
    Suspended,
    /// A wake is restoring it.
    #[sea_orm(string_value = "restoring")]
    Restoring,
    /// Its process exited.
    #[sea_orm(string_value = "exited")]
    Exited,
    /// Its driver cannot find it.
    #[sea_orm(string_value = "lost")]
    Lost,
    /// Destroyed; final. As an observation: its process is known to be stopped.
    #[sea_orm(string_value = "deleted")]
    Deleted,
}

impl SandboxStatus {
    /// Statuses a sandbox can still leave on its own; only these are probed, stamped or
    /// failed.
    pub const LIVE: [Self; 4] = [
        Self::Creating,
        Self::Started,
        Self::Suspended,
        Self::Restoring,
    ];

    /// Statuses of a sandbox that runs, or is about to, on the node it is placed on:
    /// what a node's capacity is weighed against (a suspended one is parked there).
    pub const PLACED: [Self; 3] = [Self::Creating, Self::Started, Self::Restoring];

    /// Statuses after which a sandbox never runs again.
    pub const ENDED: [Self; 3] = [Self::Exited, Self::Lost, Self::Deleted];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Started => "started",
            Self::Suspended => "suspended",
            Self::Restoring => "restoring",
            Self::Exited => "exited",
            Self::Lost => "lost",
            Self::Deleted => "deleted",
        }
    }

    pub fn is_live(self) -> bool {
        Self::LIVE.contains(&self)
    }

    pub fn is_ended(self) -> bool {
        Self::ENDED.contains(&self)
    }
}

impl std::fmt::Display for SandboxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not a sandbox status's stored name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a sandbox status: {0:?}")]
pub struct UnknownStatus(pub String);

impl std::str::FromStr for SandboxStatus {
    type Err = UnknownStatus;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        <Self as sea_orm::Iterable>::iter()
            .find(|status| status.as_str() == name)
            .ok_or_else(|| UnknownStatus(name.to_owned()))
    }
}

impl PartialEq<&str> for SandboxStatus {
    fn eq(&self, name: &&str) -> bool {
        self.as_str() == *name
    }
}

impl From<SandboxStatus> for reconciler_pb::SandboxStatus {
    fn from(status: SandboxStatus) -> Self {
        match status {
            SandboxStatus::Creating => Self::Creating,
            SandboxStatus::Started => Self::Started,
            SandboxStatus::Suspended => Self::Suspended,
            SandboxStatus::Restoring => Self::Restoring,
            SandboxStatus::Exited => Self::Exited,
            SandboxStatus::Lost => Self::Lost,
            SandboxStatus::Deleted => Self::Deleted,
        }
    }
}

impl TryFrom<reconciler_pb::SandboxStatus> for SandboxStatus {
    /// `SANDBOX_STATUS_UNSPECIFIED`, which is never stored.
    type Error = reconciler_pb::SandboxStatus;

    fn try_from(status: reconciler_pb::SandboxStatus) -> Result<Self, Self::Error> {
        Ok(match status {
            reconciler_pb::SandboxStatus::Creating => Self::Creating,
            reconciler_pb::SandboxStatus::Started => Self::Started,
            reconciler_pb::SandboxStatus::Suspended => Self::Suspended,
            reconciler_pb::SandboxStatus::Restoring => Self::Restoring,
            reconciler_pb::SandboxStatus::Exited => Self::Exited,
            reconciler_pb::SandboxStatus::Lost => Self::Lost,
            reconciler_pb::SandboxStatus::Deleted => Self::Deleted,
            reconciler_pb::SandboxStatus::Unspecified => return Err(status),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every status's stored name parses back to it and maps to the proto value of the
    /// same name; the proto's unspecified value is no status.
    #[test]
    fn names_and_proto_values_round_trip() {
        for status in <SandboxStatus as sea_orm::Iterable>::iter() {
            assert_eq!(status.as_str().parse(), Ok(status));
            let wire = reconciler_pb::SandboxStatus::from(status);
            assert_eq!(
                wire.as_str_name(),
                format!("SANDBOX_STATUS_{}", status.as_str().to_uppercase())
            );
            assert_eq!(SandboxStatus::try_from(wire), Ok(status));
        }
        assert!("".parse::<SandboxStatus>().is_err());
        assert!(SandboxStatus::try_from(reconciler_pb::SandboxStatus::Unspecified).is_err());
    }
}
