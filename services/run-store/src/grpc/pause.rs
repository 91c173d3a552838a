//! PauseRun and ResumeRun: an operator's pause of a live run, recorded here and carried
//! out by the sandbox reconciler, which asks which runs are paused.

use runplane_ids::OrgScope;
use runplane_proto::runstore::v1 as runstore_pb;
use tracing::Instrument as _;

use super::service_state::ServiceState;
use crate::convert;
use crate::domain::ids::digest_hex;
use crate::domain::validate;
use crate::error::RunStoreError;
use crate::store::Paused;

/// Which of the two calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Toggle {
    Pause,
    Resume,
}

/// Pauses or resumes `run_id` for a caller in `scope`: checked, then one keyed
/// transaction; a change wakes the run's watchers and the reconciler.
pub(super) async fn toggle(
    state: &ServiceState,
    scope: &OrgScope,
    run_id: &str,
    idempotency_key: &str,
    toggle: Toggle,
) -> Result<runstore_pb::Run, RunStoreError> {
    validate::client_key("idempotency_key", idempotency_key)?;
    let run = state.visible_run(scope, run_id).await?;
    // A pause is part of the run's story: it joins the run's trace.
    let span = match toggle {
        Toggle::Pause => tracing::info_span!("run.pause", run_id = %run.id),
        Toggle::Resume => tracing::info_span!("run.resume", run_id = %run.id),
    };
    runplane_grpc::trace_context::continue_trace(&span, &run.traceparent);
    // The body has nothing but the run: the digest says which call the key was for.
    let digest = digest_hex(format!("{toggle:?}|{run_id}").as_bytes());
    let Paused { run, changed } = match toggle {
        Toggle::Pause => {
            let rule = state.settings.pauses.of(&run.profile);
            state
                .store
                .pause_run(run_id, idempotency_key, &digest, rule)
                .instrument(span.clone())
                .await?
        }
        Toggle::Resume => {
            state
                .store
                .resume_run(run_id, idempotency_key, &digest)
                .instrument(span.clone())
                .await?
        }
    };
    if changed {
        span.in_scope(|| {
            tracing::info!(toggle = ?toggle, "run {}", match toggle {
                Toggle::Pause => "paused",
                Toggle::Resume => "resumed",
            })
        });
    }
    // Woken on a replay too: its first attempt may have committed and then been dropped
    // before it woke anyone; a wake with nothing new costs one read.
    state.changes.paused(run_id);
    Ok(convert::run(&run))
}
