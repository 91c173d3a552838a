//! Takeover planning: PlanRecovery claims a lost controller's lease within the run's
//! restart budget and hands it to the runner; GetRecoveryBudget reads budget and lease.

use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::{Request, Response, Status};

use super::state::{CoordinatorState, budget_of, new_token, store_error, timestamp, upstream};
use super::validate;
use crate::domain::policy::DEFAULT_LEASE_TTL;
use crate::error::RecoveryError;
use crate::store::{ClaimArgs, ClaimOutcome};

impl CoordinatorState {
    /// Plans a recovery and, when allowed, claims it: the run store's state is read
    /// first (a failure there spends nothing), the claim is one atomic store step, and
    /// the claim is handed to the runner as `resume_stream`.
    pub async fn plan(
        &self,
        run_id: &str,
        why: &str,
    ) -> Result<(recovery_pb::RecoveryDecision, Option<(String, u64)>), Status> {
        let run = self.run(run_id).await?;
        if run.state().is_terminal() {
            return Ok((recovery_pb::RecoveryDecision::RunTerminal, None));
        }
        // Only a lost controller is replaced: a run no runner has started has none, and
        // the claim script checks the same for a running run whose runner never acquired.
        if matches!(
            run.state(),
            runstore_pb::RunState::Queued | runstore_pb::RunState::Starting
        ) {
            return Ok((recovery_pb::RecoveryDecision::NoControllerYet, None));
        }
        let token = new_token();
        let now = self.now_ms();
        let outcome = self
            .store
            .claim(
                run_id,
                &ClaimArgs {
                    now_ms: now,
                    token: &token,
                    controller: "recovery",
                    lease_ttl_ms: DEFAULT_LEASE_TTL.as_millis() as i64,
                    jitter: rand::random::<f64>(),
                },
            )
            .await
            .map_err(store_error)?;
        let result = match &outcome {
            ClaimOutcome::NoControllerYet => "no_controller_yet",
            ClaimOutcome::LeaseHeld => "lease_held",
            ClaimOutcome::Wait { .. } => "wait",
            ClaimOutcome::Exhausted { .. } => "exhausted",
            ClaimOutcome::Claimed { .. } => "claimed",
        };
        runplane_telemetry::metrics::recovery_claims()
            .add(1, &[runplane_telemetry::metrics::attr("result", result)]);
        match outcome {
            ClaimOutcome::NoControllerYet => {
                Ok((recovery_pb::RecoveryDecision::NoControllerYet, None))
            }
            ClaimOutcome::LeaseHeld => Ok((recovery_pb::RecoveryDecision::LeaseHeld, None)),
            ClaimOutcome::Wait { not_before_ms } => Err(RecoveryError::NotBefore {
                not_before_ms,
                retry_after_ms: (not_before_ms - now).max(0),
            }
            .into()),
            ClaimOutcome::Exhausted { .. } => {
                self.end_exhausted(run_id).await?;
                Err(RecoveryError::Exhausted.into())
            }
            ClaimOutcome::Claimed {
                attempt,
                next_sequence,
                ..
            } => {
                tracing::info!(
                    run_id,
                    attempt,
                    next_sequence,
                    why,
                    "claimed stream run for recovery"
                );
                let token_for_undo = token.clone();
                // The claim's effects are budget and lease (the script), index entry
                // (the store) and the resume_stream message (here). They happen in full or
                // not at all by compensating release, not an outbox: when the enqueue
                // fails, the claim is undone (budget and lease as before) and the caller is
                // told nothing changed. What compensation cannot cover is this process
                // dying between the claim and the enqueue: then the claim's lease lapses
                // within its TTL and the attempt stays spent, as for a controller that died.
                let enqueued = self
                    .run_store
                    .clone()
                    .enqueue_control(runstore_pb::EnqueueControlRequest {
                        run_id: run_id.to_owned(),
                        // The claim's time makes the key unique per claim: a fresh budget
                        // counts from 1 again, and must not replay an old claim's message.
                        idempotency_key: format!("{run_id}:resume:{attempt}:{now}"),
                        control: Some(runstore_pb::enqueue_control_request::Control::ResumeStream(
                            runstore_pb::ResumeStreamPayload {
                                controller_token: token,
                                next_sequence,
                                attempt,
                                lease_expires_at: Some(timestamp(
                                    now + DEFAULT_LEASE_TTL.as_millis() as i64,
                                )),
                            },
                        )),
                    })
                    .await;
                let message = match enqueued {
                    Ok(answer) => answer
                        .into_inner()
                        .message
                        .map(|m| m.id)
                        .unwrap_or_default(),
                    Err(status) => {
                        match self.store.unclaim(run_id, &token_for_undo).await {
                            Ok(undone) => tracing::warn!(
                                run_id,
                                attempt,
                                undone,
                                code = ?status.code(),
                                "resume_stream not enqueued; claim undone"
                            ),
                            Err(cause) => tracing::error!(
                                run_id,
                                attempt,
                                %cause,
                                "resume_stream not enqueued and the claim not undone; its lease lapses"
                            ),
                        }
                        return Err(upstream(&status));
                    }
                };
                Ok((
                    recovery_pb::RecoveryDecision::Claimed,
                    Some((message, next_sequence)),
                ))
            }
        }
    }
}

pub(super) async fn plan_recovery(
    s: &CoordinatorState,
    request: Request<recovery_pb::PlanRecoveryRequest>,
) -> Result<Response<recovery_pb::PlanRecoveryResponse>, Status> {
    s.operator(&request)?;
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    validate::plan_reason(&req.reason)?;
    let (decision, claim) = s.plan(&req.run_id, &req.reason).await?;
    let b = s
        .store
        .budget(&req.run_id, s.now_ms())
        .await
        .map_err(store_error)?;
    let (resume_message_id, next_sequence) = claim.unwrap_or_default();
    Ok(Response::new(recovery_pb::PlanRecoveryResponse {
        decision: decision as i32,
        budget: Some(budget_of(&b)),
        resume_message_id,
        next_sequence,
    }))
}

pub(super) async fn get_recovery_budget(
    s: &CoordinatorState,
    request: Request<recovery_pb::GetRecoveryBudgetRequest>,
) -> Result<Response<recovery_pb::GetRecoveryBudgetResponse>, Status> {
    s.operator(&request)?;
    let req = request.get_ref();
    validate::run_id(&req.run_id)?;
    // A read: it creates no state, and needs no run store (an unknown run reads as
    // an empty budget and a free lease).
    let b = s
        .store
        .budget(&req.run_id, s.now_ms())
        .await
        .map_err(store_error)?;
    Ok(Response::new(recovery_pb::GetRecoveryBudgetResponse {
        budget: Some(budget_of(&b)),
        lease: Some(match &b.lease {
            Some((controller, _)) if b.parked => recovery_pb::LeaseInfo {
                state: recovery_pb::LeaseState::Parked as i32,
                controller_id: controller.clone(),
                expires_at: None,
            },
            Some((controller, expires)) => recovery_pb::LeaseInfo {
                state: recovery_pb::LeaseState::Held as i32,
                controller_id: controller.clone(),
                expires_at: Some(timestamp(*expires)),
            },
            None => recovery_pb::LeaseInfo {
                state: recovery_pb::LeaseState::Free as i32,
                ..Default::default()
            },
        }),
        next_sequence: b.next_sequence,
    }))
}
