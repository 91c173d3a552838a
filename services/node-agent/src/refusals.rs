//! ClaimLaunch refusals the node agent remembers, so an assignment listed on every poll
//! is neither claimed nor warned about on every poll.

use std::collections::HashMap;
use std::time::Duration;

use runplane_proto::reconciler::v1 as reconciler_pb;
use tokio::time::Instant;

/// A sandbox generation whose launch the reconciler refused.
struct Refusal {
    /// The answer will not change: never claimed again.
    terminal: bool,
    failures: u32,
    retry_at: Instant,
}

/// ClaimLaunch refusals, by sandbox generation, so a RUN assignment that is listed on
/// every poll is not claimed (and warned about) on every poll. A refusal that says
/// something about the sandbox (FAILED_PRECONDITION: ended, superseded, claimed;
/// PERMISSION_DENIED: not this node's; NOT_FOUND; INVALID_ARGUMENT) is terminal for that
/// assignment; anything else (the reconciler or run store unavailable) is retried after
/// a backoff, 1 s doubling to 30 s. Each is logged once. An assignment that is no longer
/// listed is forgotten.
#[derive(Default)]
pub(crate) struct LaunchRefusals {
    refused: HashMap<(String, u64), Refusal>,
}

impl LaunchRefusals {
    const BACKOFF_CAP: Duration = Duration::from_secs(30);

    pub(crate) fn may_claim(&self, launch: &(String, u64)) -> bool {
        self.refused
            .get(launch)
            .is_none_or(|r| !r.terminal && Instant::now() >= r.retry_at)
    }

    pub(crate) fn record(&mut self, launch: (String, u64), status: &tonic::Status) {
        let terminal = matches!(
            status.code(),
            tonic::Code::FailedPrecondition
                | tonic::Code::PermissionDenied
                | tonic::Code::NotFound
                | tonic::Code::InvalidArgument
        );
        let reason = runplane_grpc::error_info(status)
            .map(|i| i.reason)
            .unwrap_or_default();
        let sandbox_id = launch.0.clone();
        let entry = self.refused.entry(launch).or_insert(Refusal {
            terminal,
            failures: 0,
            retry_at: Instant::now(),
        });
        entry.terminal = terminal;
        entry.failures += 1;
        let wait = Duration::from_secs(1)
            .saturating_mul(1 << (entry.failures - 1).min(5))
            .min(Self::BACKOFF_CAP);
        entry.retry_at = Instant::now() + wait;
        if entry.failures == 1 {
            if terminal {
                tracing::warn!(%sandbox_id, code = ?status.code(), %reason, "launch not claimed; not asked again for this generation");
            } else {
                tracing::warn!(%sandbox_id, code = ?status.code(), %reason, "launch not claimed; retrying with backoff");
            }
        } else {
            tracing::debug!(%sandbox_id, code = ?status.code(), %reason, failures = entry.failures, "launch not claimed again");
        }
    }

    /// Forgets refusals of assignments no longer listed.
    pub(crate) fn keep_listed(&mut self, assignments: &[reconciler_pb::Assignment]) {
        let listed: std::collections::HashSet<(&str, u64)> = assignments
            .iter()
            .map(|a| (a.sandbox_id.as_str(), a.execution_generation))
            .collect();
        self.refused
            .retain(|(id, generation), _| listed.contains(&(id.as_str(), *generation)));
    }
}
