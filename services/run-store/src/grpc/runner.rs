//! RunnerService: what a sandbox's runner calls with its run key.

use std::sync::Arc;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::runner_service_server::RunnerService;
use runplane_telemetry::metrics;
use tonic::{Request, Response, Status};

use super::fields::from_duration;
use super::service_state::ServiceState;
use crate::auth::presented;
use crate::convert;
use crate::domain::verdict::Verdict;
use crate::domain::{ids, validate};
use crate::error::RunStoreError;
use crate::store::Ack;

type Result<T> = std::result::Result<T, RunStoreError>;

/// `runplane.runstore.v1.RunnerService`: calls from the runner inside a sandbox.
#[derive(Debug, Clone)]
pub struct RunnerApi {
    pub state: Arc<ServiceState>,
}

#[tonic::async_trait]
impl RunnerService for RunnerApi {
    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn hello(
        &self,
        request: Request<runstore_pb::HelloRequest>,
    ) -> std::result::Result<Response<runstore_pb::HelloResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        let auth = s.runner(&request, &req.run_id, false).await?;
        validate::client_key("nonce", &req.nonce)?;
        let hello = s
            .store
            .hello(&auth.key.key_id, &req.run_id, &req.nonce)
            .await?;
        let run = hello.run;
        s.changes.notify(&run.id);
        tracing::info!(key_id = %auth.key.key_id, generation = auth.key.sandbox_generation, attempt = hello.attempt, "runner said hello");
        Ok(Response::new(runstore_pb::HelloResponse {
            chain_head: run.chain_head.clone(),
            run: Some(convert::run(&run)),
            claimed_at: Some(runplane_clock::to_timestamp(hello.claimed_at_us)),
            limits: Some(s.limits()),
            attempt: hello.attempt,
            previous_attempt_reason: hello.previous_attempt_reason,
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, events = request.get_ref().events.len()))]
    async fn append_events(
        &self,
        request: Request<runstore_pb::AppendEventsRequest>,
    ) -> std::result::Result<Response<runstore_pb::AppendEventsResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        let key = presented(&request)?;
        validate::run_id(&req.run_id)?;
        let checked = validate::client_key("batch_key", &req.batch_key)
            .and_then(|()| validate::batch(&req.events, &s.settings.limits, false));
        let events = match checked {
            Ok(events) => events,
            // The key is judged before the batch: a caller without a valid key learns
            // nothing about what it sent.
            Err(invalid) => {
                s.runner(&request, &req.run_id, false).await?;
                return Err(invalid.into());
            }
        };
        // Authenticates and appends together: the store checks the key in the statement
        // that appends.
        let appended = s
            .store
            .append_for_runner(key, &req.run_id, &req.batch_key, &events)
            .await?;
        s.changes.notify(&req.run_id);
        Ok(Response::new(runstore_pb::AppendEventsResponse {
            first_sequence: appended.first_sequence,
            last_sequence: appended.last_sequence,
            chain_head: appended.chain_head,
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, acks = request.get_ref().acks.len()))]
    async fn poll_steering(
        &self,
        request: Request<runstore_pb::PollSteeringRequest>,
    ) -> std::result::Result<Response<runstore_pb::PollSteeringResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        // A terminal run's key still polls: the runner learns the run ended (and gets an
        // abort enqueued as it ended) from the answer instead of an error.
        let auth = s.runner(&request, &req.run_id, true).await?;
        let attempt = crate::store::attempts::attempt_of(&auth.key);
        let acks = check_acks(&req.acks, s.settings.limits.max_ack_ids as usize)?;
        let limit = match req.max_messages {
            0 => 16,
            n @ 1..=64 => n,
            _ => return Err(RunStoreError::invalid("max_messages", "must be 0 to 64").into()),
        };
        let wait = from_duration("wait", req.wait.as_ref())?
            .unwrap_or_default()
            .min(s.settings.limits.max_poll_wait);

        s.store.acknowledge(&req.run_id, &acks).await?;
        for ack in &acks {
            let outcome = if ack.dropped { "dropped" } else { "applied" };
            metrics::steering_acks().add(1, &[metrics::attr("outcome", outcome)]);
        }
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = s.changes.subscribe(&req.run_id);
        loop {
            let mut pending = s.store.pending_messages(&req.run_id, limit.into()).await?;
            let run = s.store.get_run(&req.run_id).await?;
            // This runner's attempt ended while it waited: the messages are the next
            // attempt's, and this runner is done.
            let current = crate::store::attempts::current_attempt(&run);
            if current != attempt && !run.state.is_terminal() {
                return Err(RunStoreError::AttemptSuperseded {
                    run_id: run.id,
                    attempt,
                    current,
                }
                .into());
            }
            let terminal = run.state.is_terminal();
            if terminal {
                // Only an abort still means anything to a runner whose run ended.
                pending.retain(|m| m.kind == runstore_pb::SteeringKind::Abort as i32);
            }
            if !pending.is_empty()
                || terminal
                || tokio::time::Instant::now() >= deadline
                || s.changes.is_closing()
            {
                return Ok(Response::new(runstore_pb::PollSteeringResponse {
                    messages: pending.iter().map(convert::message).collect(),
                    run_state: runstore_pb::RunState::from(run.state) as i32,
                }));
            }
            changes.changed(deadline).await;
        }
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn submit_result(
        &self,
        request: Request<runstore_pb::SubmitResultRequest>,
    ) -> std::result::Result<Response<runstore_pb::SubmitResultResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        let superseded = match s.runner(&request, &req.run_id, true).await {
            Ok(_) => false,
            Err(RunStoreError::AttemptSuperseded { .. }) => true,
            Err(e) => return Err(e.into()),
        };
        let verdict = req
            .verdict
            .as_ref()
            .ok_or_else(|| RunStoreError::invalid("verdict", "is required"))?;
        let verdict = Verdict::try_from(verdict)?;
        validate::verdict(&verdict)?;
        if superseded {
            // The runner of an attempt that has ended: its verdict's own replay is
            // answered, any other refused and recorded on its attempt.
            let run = s
                .store
                .superseded_verdict(crate::auth::presented(&request)?, &verdict)
                .await?;
            return Ok(Response::new(runstore_pb::SubmitResultResponse {
                run: Some(convert::run(&run)),
                already_recorded: true,
                receipt: None,
            }));
        }
        validate::bounded(
            "failure_tail",
            &req.failure_tail,
            0,
            s.settings.limits.max_failure_tail_bytes as usize,
        )?;
        let final_events = validate::batch(&req.final_events, &s.settings.limits, true)?;
        let final_batch = if final_events.is_empty() {
            None
        } else {
            validate::client_key("final_batch_key", &req.final_batch_key)?;
            Some((req.final_batch_key.as_str(), final_events.as_slice()))
        };
        let finished = s
            .store
            .submit_result(
                &req.run_id,
                &verdict,
                &req.failure_tail,
                final_batch,
                &s.settings.signer,
            )
            .await?;
        if finished.made_terminal {
            s.changes.ended(&req.run_id, finished.run.state);
            tracing::info!(outcome = %verdict.outcome, reason = %verdict.reason, "run finished");
        } else if finished.retried {
            s.changes.attempt_ended(&req.run_id);
        } else {
            s.changes.ended_again(&req.run_id);
        }
        let receipt = s.store.receipt(&req.run_id).await?;
        Ok(Response::new(runstore_pb::SubmitResultResponse {
            run: Some(convert::run(&finished.run)),
            already_recorded: !finished.made_terminal,
            receipt,
        }))
    }
}

/// PollSteering's checks of its acknowledgements; pure, so it is fuzzed.
pub fn check_acks(acks: &[runstore_pb::SteeringAck], max: usize) -> Result<Vec<Ack>> {
    if acks.len() > max {
        return Err(RunStoreError::AckInvalid {
            index: max,
            reason: format!(
                "at most {max} acknowledgements per poll, got {}",
                acks.len()
            ),
        });
    }
    acks.iter()
        .enumerate()
        .map(|(index, a)| {
            if !ids::is_message_id(&a.message_id) {
                return Err(RunStoreError::AckInvalid {
                    index,
                    reason: "not a message id this server issues".into(),
                });
            }
            let dropped = match runstore_pb::AckOutcome::try_from(a.outcome) {
                Ok(runstore_pb::AckOutcome::Applied) => false,
                Ok(runstore_pb::AckOutcome::DroppedUndeliverable) => true,
                _ => {
                    return Err(RunStoreError::AckInvalid {
                        index,
                        reason: "outcome must be applied or dropped_undeliverable".into(),
                    });
                }
            };
            if a.error.len() > 512 {
                return Err(RunStoreError::AckInvalid {
                    index,
                    reason: "error is more than 512 bytes".into(),
                });
            }
            Ok(Ack {
                message_id: a.message_id.clone(),
                dropped,
                attempts: a.attempts.max(1),
                error: a.error.clone(),
            })
        })
        .collect()
}
