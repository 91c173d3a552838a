//! What every handler shares: the coordinator's state, the checks of who calls, and the
//! run store calls that planning and the sweep both make.

use std::sync::Arc;

use rand::RngCore;
use runplane_clock::SharedClock;
use runplane_grpc::client::Bearer;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::{Code, Request, Status};

use crate::domain::policy::{BufferLimits, MAX_ATTEMPTS, RESET_AFTER};
use crate::error::RecoveryError;
use crate::store::{BudgetState, RecoveryStore, StoreError};

/// The run store, called with the service token.
pub type RunStoreClient =
    RunServiceClient<InterceptedService<runplane_grpc::client::TracedChannel, Bearer>>;

/// The coordinator's state, shared by every handler and the scheduled sweep.
pub struct CoordinatorState {
    pub store: Arc<dyn RecoveryStore>,
    pub clock: SharedClock,
    pub run_store: RunStoreClient,
    pub limits: BufferLimits,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
}

impl std::fmt::Debug for CoordinatorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorState").finish_non_exhaustive()
    }
}

pub(super) fn store_error(e: StoreError) -> Status {
    RecoveryError::Store(e).into()
}

pub(super) fn upstream(status: &Status) -> Status {
    RecoveryError::Upstream(status.clone()).into()
}

/// A stored millisecond time as a protobuf `Timestamp`.
pub(super) fn timestamp(ms: i64) -> prost_types::Timestamp {
    runplane_clock::to_timestamp(runplane_clock::ms_to_us(ms))
}

pub(super) fn new_token() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "ct_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

pub(super) fn budget_of(b: &BudgetState) -> recovery_pb::RecoveryBudget {
    recovery_pb::RecoveryBudget {
        attempts: b.attempts,
        max_attempts: MAX_ATTEMPTS,
        claimed_at: b.claimed_ms.map(timestamp),
        not_before: b.not_before_ms.filter(|_| b.attempts > 0).map(timestamp),
        reset_after: Some(runplane_grpc::proto_duration(RESET_AFTER)),
        exhausted: b.exhausted,
    }
}

fn unauthenticated() -> Status {
    RecoveryError::Unauthenticated.into()
}

impl CoordinatorState {
    pub(super) fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The operator or a service, as the server's authentication layer found.
    pub(super) fn operator<T>(&self, request: &Request<T>) -> Result<(), Status> {
        match runplane_grpc::auth::caller(request) {
            Some(c) if c.org_scope() == Some(runplane_ids::OrgScope::Any) => Ok(()),
            _ => Err(unauthenticated()),
        }
    }

    /// The runner's key, checked by the run store by its hash: the key never leaves here.
    pub(super) async fn runner<T>(
        &self,
        request: &Request<T>,
        run_id: &str,
    ) -> Result<String, Status> {
        Ok(self.runner_key(request, run_id).await?.org_id)
    }

    /// As [`CoordinatorState::runner`], with what the run store says of the key (its
    /// org and the attempt it was issued for).
    pub(super) async fn runner_key<T>(
        &self,
        request: &Request<T>,
        run_id: &str,
    ) -> Result<runstore_pb::CheckRunKeyResponse, Status> {
        let key = runplane_grpc::auth::caller(request)
            .and_then(runplane_grpc::auth::Caller::presented)
            .ok_or_else(unauthenticated)?;
        let check = self
            .run_store
            .clone()
            .check_run_key(runstore_pb::CheckRunKeyRequest {
                run_id: run_id.to_owned(),
                key_sha256: key.sha256().to_vec(),
            })
            .await;
        match check {
            Ok(answer) => Ok(answer.into_inner()),
            // The run store's refusal (invalid, revoked, other run, terminal) stands as is
            // (see `RecoveryError::Upstream`).
            Err(status) => Err(upstream(&status)),
        }
    }

    /// The run's state, from the run store.
    pub(super) async fn run(&self, run_id: &str) -> Result<runstore_pb::Run, Status> {
        match self
            .run_store
            .clone()
            .get_run(runstore_pb::GetRunRequest {
                run_id: run_id.to_owned(),
            })
            .await
        {
            Ok(answer) => Ok(answer.into_inner().run.unwrap_or_default()),
            Err(status) if status.code() == Code::NotFound => Err(status),
            Err(status) => Err(upstream(&status)),
        }
    }

    /// Sends an exhausted run's one abort, then ends the run through the run store's
    /// terminal path. The abort goes first so a runner that polls as the run ends still
    /// finds it (a terminal run's poll serves pending aborts); the other order left a
    /// window in which the runner saw the run end with no abort to apply. Both calls are
    /// keyed, so repeating them (a later claim, the sweep) changes nothing and the runner
    /// never gets a second abort.
    pub(super) async fn end_exhausted(&self, run_id: &str) -> Result<(), Status> {
        self.run_store
            .clone()
            .enqueue_control(runstore_pb::EnqueueControlRequest {
                run_id: run_id.to_owned(),
                idempotency_key: format!("{run_id}:abort"),
                control: Some(runstore_pb::enqueue_control_request::Control::Abort(
                    runstore_pb::AbortPayload {
                        reason: "stream_recovery_exhausted".into(),
                    },
                )),
            })
            .await
            .map_err(|s| upstream(&s))?;
        let failed = self
            .run_store
            .clone()
            .fail_run(runstore_pb::FailRunRequest {
                run_id: run_id.to_owned(),
                reason: "stream_recovery_exhausted".into(),
                message: format!(
                    "the run's stream was taken over {MAX_ATTEMPTS} times and kept failing"
                ),
                idempotency_key: format!("{run_id}:recovery-exhausted"),
                if_sandbox_generation: None,
                if_sandbox_id: String::new(),
            })
            .await
            .map_err(|s| upstream(&s))?;
        let outcome = failed.into_inner().outcome();
        if outcome == runstore_pb::FailRunOutcome::MadeTerminal {
            runplane_telemetry::metrics::recovery_exhaustions().add(1, &[]);
        }
        tracing::warn!(run_id, ?outcome, "stream recovery exhausted; run ended");
        Ok(())
    }
}
