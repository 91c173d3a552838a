//! The tonic side of the coordinator: authenticate, validate, call the store and the run
//! store, map errors.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rand::RngCore;
use runplane_clock::SharedClock;
use runplane_grpc::client::Bearer;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::recovery::v1 as pb;
use runplane_proto::recovery::v1::stream_recovery_service_server::StreamRecoveryService;
use runplane_proto::runstore::v1 as rs;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::{Code, Request, Response, Status};

use crate::domain::policy::{BufferLimits, DEFAULT_LEASE_TTL, MAX_ATTEMPTS, RESET_AFTER};
use crate::error::RecoveryError;
use crate::store::{ClaimArgs, ClaimOutcome, RecoveryStore, StoreError};

/// The run store, called with the service token.
pub type RunStoreClient =
    RunServiceClient<InterceptedService<runplane_grpc::client::TracedChannel, Bearer>>;

/// What the coordinator's handlers share.
pub struct Shared {
    pub store: Arc<dyn RecoveryStore>,
    pub clock: SharedClock,
    pub run_store: RunStoreClient,
    pub limits: BufferLimits,
    /// SHA-256 of the operator/service token.
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub struct StreamRecoveryApi {
    pub shared: Arc<Shared>,
}

fn store_error(e: StoreError) -> Status {
    RecoveryError::Store(e).into()
}

fn invalid(field: &str, why: &str) -> Status {
    RecoveryError::Invalid {
        field: field.to_owned(),
        why: why.to_owned(),
    }
    .into()
}

fn upstream(status: &Status) -> Status {
    RecoveryError::Upstream(status.clone()).into()
}

/// A stored millisecond time as a protobuf `Timestamp`.
fn timestamp(ms: i64) -> prost_types::Timestamp {
    runplane_clock::to_timestamp(runplane_clock::ms_to_us(ms))
}

fn new_token() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "ct_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

fn ttl_ms(ttl: Option<&prost_types::Duration>) -> Result<i64, Status> {
    let ms = match ttl {
        None => DEFAULT_LEASE_TTL.as_millis() as i64,
        Some(d) if d.seconds == 0 && d.nanos == 0 => DEFAULT_LEASE_TTL.as_millis() as i64,
        // Saturating: a client's far-off duration must not overflow (and panic).
        Some(d) => d
            .seconds
            .saturating_mul(1000)
            .saturating_add(i64::from(d.nanos / 1_000_000)),
    };
    if !(5_000..=120_000).contains(&ms) {
        return Err(invalid("ttl", "must be 5 s to 120 s"));
    }
    Ok(ms)
}

fn budget_of(b: &crate::store::BudgetState) -> pb::RecoveryBudget {
    pb::RecoveryBudget {
        attempts: b.attempts,
        max_attempts: MAX_ATTEMPTS,
        claimed_at: b.claimed_ms.map(timestamp),
        not_before: b.not_before_ms.filter(|_| b.attempts > 0).map(timestamp),
        reset_after: Some(runplane_grpc::proto_duration(RESET_AFTER)),
        exhausted: b.exhausted,
    }
}

impl Shared {
    fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The operator or a service, as the server's authentication layer found.
    fn operator<T>(&self, request: &Request<T>) -> Result<(), Status> {
        match runplane_grpc::auth::caller(request) {
            Some(c) if c.is_any_org() => Ok(()),
            _ => Err(unauthenticated()),
        }
    }

    /// The runner's key, checked by the run store by its hash: the key never leaves here.
    async fn runner<T>(&self, request: &Request<T>, run_id: &str) -> Result<String, Status> {
        let key = runplane_grpc::auth::caller(request)
            .and_then(runplane_grpc::auth::Caller::presented)
            .ok_or_else(unauthenticated)?;
        let check = self
            .run_store
            .clone()
            .check_run_key(rs::CheckRunKeyRequest {
                run_id: run_id.to_owned(),
                key_sha256: key.sha256().to_vec(),
            })
            .await;
        match check {
            Ok(answer) => Ok(answer.into_inner().org_id),
            // The run store's refusal (invalid, revoked, other run, terminal) stands as is
            // (see `RecoveryError::Upstream`).
            Err(status) => Err(upstream(&status)),
        }
    }

    /// The run's state, from the run store.
    async fn run(&self, run_id: &str) -> Result<rs::Run, Status> {
        match self
            .run_store
            .clone()
            .get_run(rs::GetRunRequest {
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
    async fn end_exhausted(&self, run_id: &str) -> Result<(), Status> {
        self.run_store
            .clone()
            .enqueue_control(rs::EnqueueControlRequest {
                run_id: run_id.to_owned(),
                idempotency_key: format!("{run_id}:abort"),
                control: Some(rs::enqueue_control_request::Control::Abort(
                    rs::AbortPayload {
                        reason: "stream_recovery_exhausted".into(),
                    },
                )),
            })
            .await
            .map_err(|s| upstream(&s))?;
        let failed = self
            .run_store
            .clone()
            .fail_run(rs::FailRunRequest {
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
        if outcome == runplane_proto::runstore::v1::FailRunOutcome::MadeTerminal {
            runplane_telemetry::metrics::recovery_exhaustions().add(1, &[]);
        }
        tracing::warn!(run_id, ?outcome, "stream recovery exhausted; run ended");
        Ok(())
    }

    /// Plans a recovery and, when allowed, claims it: the run store's state is read
    /// first (a failure there spends nothing), the claim is one atomic store step, and
    /// the claim is handed to the runner as `resume_stream`.
    pub async fn plan(
        &self,
        run_id: &str,
        why: &str,
    ) -> Result<(pb::RecoveryDecision, Option<(String, u64)>), Status> {
        let run = self.run(run_id).await?;
        if run.state().is_terminal() {
            return Ok((pb::RecoveryDecision::RunTerminal, None));
        }
        // Only a lost controller is replaced: a run no runner has started has none, and
        // the claim script checks the same for a running run whose runner never acquired.
        if matches!(run.state(), rs::RunState::Queued | rs::RunState::Starting) {
            return Ok((pb::RecoveryDecision::NoControllerYet, None));
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
            ClaimOutcome::NoControllerYet => Ok((pb::RecoveryDecision::NoControllerYet, None)),
            ClaimOutcome::LeaseHeld => Ok((pb::RecoveryDecision::LeaseHeld, None)),
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
                    .enqueue_control(rs::EnqueueControlRequest {
                        run_id: run_id.to_owned(),
                        // The claim's time makes the key unique per claim: a fresh budget
                        // counts from 1 again, and must not replay an old claim's message.
                        idempotency_key: format!("{run_id}:resume:{attempt}:{now}"),
                        control: Some(rs::enqueue_control_request::Control::ResumeStream(
                            rs::ResumeStreamPayload {
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
                    pb::RecoveryDecision::Claimed,
                    Some((message, next_sequence)),
                ))
            }
        }
    }
}

impl Shared {
    /// One bounded batch of the orphan sweep, after `cursor` (in run id order): runs the
    /// run store reports terminal or unknown lose their keys; a live run whose lease is
    /// free, not parked, and whose budget is spent within the reset window is ended as
    /// exhausted. The reset rule is a claim's: a spent budget whose last takeover is more
    /// than RESET_AFTER old would start afresh on the next claim, so it is left alone.
    /// Every settlement is guarded and keyed, so replicas sweeping at once, or a batch
    /// replayed, change nothing twice. Returns the results and the next cursor (empty at
    /// the end of a pass).
    pub async fn sweep(
        &self,
        cursor: &str,
        limit: usize,
        dry_run: bool,
    ) -> Result<(Vec<pb::OrphanResult>, String), Status> {
        let runs = self.store.runs(cursor, limit).await.map_err(store_error)?;
        let mut results = Vec::new();
        for run_id in &runs {
            let action = match self.run(run_id).await {
                Err(status) if status.code() == Code::NotFound => pb::OrphanAction::KeysDeleted,
                Err(status) => return Err(status),
                Ok(run) if run.state().is_terminal() => pb::OrphanAction::KeysDeleted,
                Ok(_) => {
                    // The time is read after the run store answers, however long that
                    // took: the lease and the window are judged at the same moment the
                    // store reads them, or a spent budget whose window lapsed meanwhile
                    // (its lease gone too) would be ended though a claim starts afresh.
                    let now = self.now_ms();
                    let b = self.store.budget(run_id, now).await.map_err(store_error)?;
                    let in_window = b
                        .claimed_ms
                        .is_some_and(|c| now - c <= RESET_AFTER.as_millis() as i64);
                    if b.lease.is_none()
                        && (b.exhausted || (b.attempts >= MAX_ATTEMPTS && in_window))
                    {
                        pb::OrphanAction::RunEnded
                    } else {
                        pb::OrphanAction::Skipped
                    }
                }
            };
            if !dry_run {
                match action {
                    pb::OrphanAction::KeysDeleted => {
                        self.store.forget(run_id).await.map_err(store_error)?
                    }
                    pb::OrphanAction::RunEnded => self.end_exhausted(run_id).await?,
                    _ => {}
                }
            }
            results.push(pb::OrphanResult {
                run_id: run_id.clone(),
                action: action as i32,
            });
        }
        let next = if runs.len() == limit {
            runs.last().cloned().unwrap_or_default()
        } else {
            String::new()
        };
        Ok((results, next))
    }
}

/// The scheduled sweep: one bounded batch every `every`, continuing from the previous
/// batch's cursor, so a pass over many runs is spread over rounds. A failed round is
/// logged and retried from the same cursor at the next tick. Runs until aborted.
pub async fn sweep_forever(shared: Arc<Shared>, every: Duration, batch: usize) {
    let mut cursor = String::new();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match shared.sweep(&cursor, batch, false).await {
            Ok((results, next)) => {
                let count =
                    |a: pb::OrphanAction| results.iter().filter(|r| r.action() == a).count();
                let (deleted, ended) = (
                    count(pb::OrphanAction::KeysDeleted),
                    count(pb::OrphanAction::RunEnded),
                );
                for (action, n) in [("keys_deleted", deleted), ("run_ended", ended)] {
                    if n > 0 {
                        runplane_telemetry::metrics::recovery_sweep_settled().add(
                            n as u64,
                            &[runplane_telemetry::metrics::attr("action", action)],
                        );
                    }
                }
                if deleted + ended > 0 {
                    tracing::info!(
                        examined = results.len(),
                        deleted,
                        ended,
                        "orphan sweep settled runs"
                    );
                }
                cursor = next;
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "orphan sweep round failed")
            }
        }
    }
}

fn unauthenticated() -> Status {
    RecoveryError::Unauthenticated.into()
}

/// A run id is a lowercase UUID, as the run store mints them; anything else is refused
/// before any key is read or written.
fn run_id_of(id: &str) -> Result<(), Status> {
    let b = id.as_bytes();
    let well_formed = b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        });
    if !well_formed {
        return Err(invalid("run_id", "must be a run id (a lowercase UUID)"));
    }
    Ok(())
}

type TailStream = Pin<Box<dyn Stream<Item = Result<pb::TailResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl StreamRecoveryService for StreamRecoveryApi {
    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn acquire_lease(
        &self,
        request: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let s = &self.shared;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        if !(16..=128).contains(&req.controller_id.len())
            || !req.controller_id.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(invalid(
                "controller_id",
                "must be 16 to 128 printable ASCII bytes",
            ));
        }
        let ttl = ttl_ms(req.ttl.as_ref())?;
        s.runner(&request, &req.run_id).await?;
        let acquired = s
            .store
            .acquire(
                &req.run_id,
                &req.controller_id,
                &new_token(),
                ttl,
                s.now_ms(),
            )
            .await
            .map_err(store_error)?;
        Ok(Response::new(pb::AcquireLeaseResponse {
            controller_token: acquired.token,
            expires_at: Some(timestamp(acquired.expires_ms)),
            next_sequence: acquired.next_sequence,
        }))
    }

    async fn renew_lease(
        &self,
        request: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let s = &self.shared;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        let ttl = ttl_ms(req.ttl.as_ref())?;
        s.runner(&request, &req.run_id).await?;
        let expires = s
            .store
            .renew(&req.run_id, &req.controller_token, ttl, s.now_ms())
            .await
            .map_err(store_error)?;
        Ok(Response::new(pb::RenewLeaseResponse {
            expires_at: Some(timestamp(expires)),
        }))
    }

    async fn release_lease(
        &self,
        request: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let s = &self.shared;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        s.runner(&request, &req.run_id).await?;
        let released = s
            .store
            .release(&req.run_id, &req.controller_token)
            .await
            .map_err(store_error)?;
        Ok(Response::new(pb::ReleaseLeaseResponse { released }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, frames = request.get_ref().frames.len()))]
    async fn append_frames(
        &self,
        request: Request<pb::AppendFramesRequest>,
    ) -> Result<Response<pb::AppendFramesResponse>, Status> {
        let s = &self.shared;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        if req.frames.is_empty() || req.frames.len() > 256 {
            return Err(invalid("frames", "1 to 256 frames"));
        }
        let total: usize = req.frames.iter().map(|f| f.data.len()).sum();
        if total > 1 << 20 {
            return Err(RecoveryError::BatchTooLarge {
                limit: 1 << 20,
                actual: total as u64,
            }
            .into());
        }
        for (i, f) in req.frames.iter().enumerate() {
            if f.data.is_empty() || f.data.len() > 64 << 10 {
                return Err(invalid("frames", "each frame is 1 byte to 64 KiB"));
            }
            // Checked: a client's u64::MAX must not overflow here, and sequences stay
            // within what the store's Lua numbers (doubles) hold exactly.
            let follows = i == 0 || req.frames[i - 1].sequence.checked_add(1) == Some(f.sequence);
            if f.sequence == 0 || f.sequence > MAX_FRAME_SEQUENCE || !follows {
                return Err(invalid(
                    "frames",
                    "sequences start at 1, are at most 2^53 and are contiguous and ascending",
                ));
            }
        }
        let org = s.runner(&request, &req.run_id).await?;
        let frames: Vec<(u64, Vec<u8>)> = req
            .frames
            .iter()
            .map(|f| (f.sequence, f.data.clone()))
            .collect();
        // The org's hourly budget is reserved for the whole batch first (its own key, so
        // Redis Cluster keeps working), then what the append did not store is given back:
        // a replay costs nothing, a refusal writes nothing.
        let now = s.now_ms();
        let hour = now.div_euclid(3_600_000);
        let reserved = total as u64;
        let org_left = s
            .store
            .charge_org(&org, hour, reserved, s.limits.org_hour_bytes)
            .await
            .map_err(store_error)?;
        let appended = match s
            .store
            .append(
                &req.run_id,
                &req.controller_token,
                &frames,
                now,
                &s.limits,
                req.resync,
            )
            .await
        {
            Ok(a) => a,
            Err(e) => {
                let _ = s.store.refund_org(&org, hour, reserved).await;
                return Err(store_error(e));
            }
        };
        let unused = reserved - appended.stored_bytes.min(reserved);
        let _ = s.store.refund_org(&org, hour, unused).await;
        Ok(Response::new(pb::AppendFramesResponse {
            next_sequence: appended.next_sequence,
            stored_count: appended.stored,
            budget: Some(pb::ReplayBudget {
                stream_bytes_remaining: appended.stream_bytes_remaining,
                org_hour_bytes_remaining: org_left + unused,
            }),
        }))
    }

    async fn tail(
        &self,
        request: Request<pb::TailRequest>,
    ) -> Result<Response<TailStream>, Status> {
        let s = self.shared.clone();
        s.operator(&request)?;
        let req = request.into_inner();
        run_id_of(&req.run_id)?;
        let heartbeat = runplane_grpc::heartbeat::interval(req.heartbeat_interval.as_ref())
            .map_err(|why| invalid("heartbeat_interval", why))?;
        // An unknown run is NOT_FOUND before anything is read or written for it.
        s.run(&req.run_id).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            if let Err(status) = tail(&s, &req, heartbeat, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_recovery_budget(
        &self,
        request: Request<pb::GetRecoveryBudgetRequest>,
    ) -> Result<Response<pb::GetRecoveryBudgetResponse>, Status> {
        let s = &self.shared;
        s.operator(&request)?;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        // A read: it creates no state, and needs no run store (an unknown run reads as
        // an empty budget and a free lease).
        let b = s
            .store
            .budget(&req.run_id, s.now_ms())
            .await
            .map_err(store_error)?;
        Ok(Response::new(pb::GetRecoveryBudgetResponse {
            budget: Some(budget_of(&b)),
            lease: Some(match &b.lease {
                Some((controller, _)) if b.parked => pb::LeaseInfo {
                    state: pb::LeaseState::Parked as i32,
                    controller_id: controller.clone(),
                    expires_at: None,
                },
                Some((controller, expires)) => pb::LeaseInfo {
                    state: pb::LeaseState::Held as i32,
                    controller_id: controller.clone(),
                    expires_at: Some(timestamp(*expires)),
                },
                None => pb::LeaseInfo {
                    state: pb::LeaseState::Free as i32,
                    ..Default::default()
                },
            }),
            next_sequence: b.next_sequence,
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn plan_recovery(
        &self,
        request: Request<pb::PlanRecoveryRequest>,
    ) -> Result<Response<pb::PlanRecoveryResponse>, Status> {
        let s = &self.shared;
        s.operator(&request)?;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        if req.reason.len() > 256 {
            return Err(invalid("reason", "at most 256 bytes"));
        }
        let (decision, claim) = s.plan(&req.run_id, &req.reason).await?;
        let b = s
            .store
            .budget(&req.run_id, s.now_ms())
            .await
            .map_err(store_error)?;
        let (resume_message_id, next_sequence) = claim.unwrap_or_default();
        Ok(Response::new(pb::PlanRecoveryResponse {
            decision: decision as i32,
            budget: Some(budget_of(&b)),
            resume_message_id,
            next_sequence,
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn park_stream(
        &self,
        request: Request<pb::ParkStreamRequest>,
    ) -> Result<Response<pb::ParkStreamResponse>, Status> {
        let s = &self.shared;
        s.operator(&request)?;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        let parked = s.store.park(&req.run_id).await.map_err(store_error)?;
        tracing::info!(sandbox_id = %req.sandbox_id, parked, "stream parked for a suspend");
        Ok(Response::new(pb::ParkStreamResponse { parked }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn unpark_stream(
        &self,
        request: Request<pb::UnparkStreamRequest>,
    ) -> Result<Response<pb::UnparkStreamResponse>, Status> {
        let s = &self.shared;
        s.operator(&request)?;
        let req = request.get_ref();
        run_id_of(&req.run_id)?;
        let ttl = ttl_ms(req.ttl.as_ref())?;
        let unparked = s
            .store
            .unpark(&req.run_id, ttl, s.now_ms())
            .await
            .map_err(store_error)?;
        Ok(Response::new(pb::UnparkStreamResponse { unparked }))
    }

    async fn sweep_orphans(
        &self,
        request: Request<pb::SweepOrphansRequest>,
    ) -> Result<Response<pb::SweepOrphansResponse>, Status> {
        let s = &self.shared;
        s.operator(&request)?;
        let req = request.get_ref();
        let limit = match req.limit {
            0 => 100,
            n @ 1..=500 => n as usize,
            _ => return Err(invalid("limit", "must be 0 to 500")),
        };
        let (results, next_cursor) = s.sweep(&req.cursor, limit, req.dry_run).await?;
        Ok(Response::new(pb::SweepOrphansResponse {
            results,
            next_cursor,
        }))
    }
}

/// The highest frame sequence accepted: 2^53, the largest integer a Lua number holds
/// exactly.
const MAX_FRAME_SEQUENCE: u64 = 1 << 53;
/// How often a following tail of a run whose lease is free plans a recovery, at most.
const TAIL_PLAN_EVERY: Duration = Duration::from_secs(1);
/// A tail re-reads the buffer this often even with no wake-up (the safety net).
const TAIL_RECHECK: Duration = Duration::from_secs(30);

/// What a tail knows of its run's state, from the run store's WatchRun.
#[derive(Debug, Clone)]
enum RunSeen {
    Unknown,
    Known(Box<rs::Run>),
    Gone(Status),
}

/// Follows `run_id`'s state through the run store's WatchRun (states only, re-opened a
/// second after it fails), so a tail learns that its run started or ended when it
/// happens, without polling the run store. Stops when the receiver is dropped.
fn follow_run(s: &Shared, run_id: &str) -> tokio::sync::watch::Receiver<RunSeen> {
    let (tx, rx) = tokio::sync::watch::channel(RunSeen::Unknown);
    let (mut client, run_id) = (s.run_store.clone(), run_id.to_owned());
    tokio::spawn(async move {
        let request = || rs::WatchRunRequest {
            run_id: run_id.clone(),
            states_only: true,
            heartbeat_interval: Some(runplane_grpc::proto_duration(Duration::from_secs(60))),
            ..Default::default()
        };
        loop {
            let opened = tokio::select! {
                () = tx.closed() => return,
                opened = client.watch_run(request()) => opened,
            };
            match opened {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        let next = tokio::select! {
                            () = tx.closed() => return,
                            next = stream.message() => next,
                        };
                        match next {
                            Ok(Some(rs::WatchRunResponse {
                                update: Some(rs::watch_run_response::Update::Run(run)),
                            })) => {
                                let terminal = run.state().is_terminal();
                                tx.send_replace(RunSeen::Known(Box::new(run)));
                                if terminal {
                                    return;
                                }
                            }
                            Ok(Some(_)) => {}
                            Ok(None) | Err(_) => break,
                        }
                    }
                }
                Err(status) if status.code() == Code::NotFound => {
                    tx.send_replace(RunSeen::Gone(status));
                    return;
                }
                Err(status) => {
                    tracing::debug!(run_id = %run_id, code = ?status.code(), "cannot follow the run's state; retrying in 1 s");
                }
            }
            tokio::select! {
                () = tx.closed() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
    rx
}

async fn tail(
    s: &Shared,
    req: &pb::TailRequest,
    heartbeat: Duration,
    tx: &tokio::sync::mpsc::Sender<Result<pb::TailResponse, Status>>,
) -> Result<(), Status> {
    use pb::tail_response::Item;
    let due = runplane_grpc::heartbeat::Due::new(heartbeat);
    let due = &due;
    let send = |item: Item| {
        due.sent();
        async move {
            tx.send(Ok(pb::TailResponse { item: Some(item) }))
                .await
                .is_ok()
        }
    };
    // Subscribe before the first read, so a frame appended in between wakes this tail.
    let mut changes = s.store.wakeups().subscribe(&req.run_id);
    let mut next = req.from_sequence.max(1);
    let first = s
        .store
        .read(&req.run_id, next, 0)
        .await
        .map_err(store_error)?;
    if req.from_sequence > 0 && req.from_sequence < first.first_available
        || (req.from_sequence == 0 && first.first_available > 1)
    {
        if !send(Item::ReplayGap(pb::ReplayGap {
            requested_from: req.from_sequence,
            first_available: first.first_available,
        }))
        .await
        {
            return Ok(());
        }
        next = first.first_available;
    }
    let mut caught_up = false;
    let mut run = None;
    // "No controller yet" is reported once, not on every plan while the run waits.
    let mut last_decision = None;
    // When the lease is next worth a look: at once, then as its state says.
    let mut plan_at = tokio::time::Instant::now();
    loop {
        let replay = s
            .store
            .read(&req.run_id, next, 256)
            .await
            .map_err(store_error)?;
        // The buffer restarted past what this reader has (lost keys, a resync): say so.
        if replay.first_available > next {
            if !send(Item::ReplayGap(pb::ReplayGap {
                requested_from: next,
                first_available: replay.first_available,
            }))
            .await
            {
                return Ok(());
            }
            next = replay.first_available;
        }
        for f in &replay.frames {
            next = f.sequence.saturating_add(1);
            if !send(Item::Frame(pb::Frame {
                sequence: f.sequence,
                data: f.data.clone(),
                appended_at: Some(timestamp(f.appended_ms)),
            }))
            .await
            {
                return Ok(());
            }
        }
        if replay.frames.len() == 256 {
            continue;
        }
        if !caught_up {
            caught_up = true;
            if !send(Item::CaughtUp(pb::CaughtUp {
                next_sequence: next,
            }))
            .await
                || !req.follow
            {
                return Ok(());
            }
        }
        // The run's state, followed from the run store rather than polled.
        let followed = run.get_or_insert_with(|| follow_run(s, &req.run_id));
        let state = loop {
            let seen = followed.borrow_and_update().clone();
            match seen {
                RunSeen::Known(run) => break run,
                RunSeen::Gone(status) => return Err(status),
                RunSeen::Unknown => {
                    if followed.changed().await.is_err() {
                        return Err(Status::unavailable("the run's state cannot be followed"));
                    }
                }
            }
        };
        if state.state().is_terminal() {
            let reason = state.verdict.map(|v| v.reason).unwrap_or_default();
            send(Item::Ended(pb::StreamEnded { reason })).await;
            return Ok(());
        }
        // A tail of a live run whose lease is free plans a recovery, at most once a second;
        // while the lease is held it looks again when the lease would lapse.
        if tokio::time::Instant::now() >= plan_at {
            let b = s
                .store
                .budget(&req.run_id, s.now_ms())
                .await
                .map_err(store_error)?;
            plan_at = match (&b.lease, b.parked) {
                // Parked: only an unpark (which wakes this tail) changes anything.
                (Some(_), true) => tokio::time::Instant::now() + TAIL_RECHECK,
                (Some((_, expires_ms)), false) => {
                    let lapses = Duration::from_millis((expires_ms - s.now_ms()).max(0) as u64);
                    tokio::time::Instant::now() + lapses.max(TAIL_PLAN_EVERY)
                }
                (None, _) => tokio::time::Instant::now() + TAIL_PLAN_EVERY,
            };
            // A run no runner has started has no controller to replace (what plan() would
            // answer after reading the run again); its start wakes this tail.
            let unstarted = matches!(state.state(), rs::RunState::Queued | rs::RunState::Starting);
            if b.lease.is_none() {
                let planned = if unstarted {
                    Ok((pb::RecoveryDecision::NoControllerYet, None))
                } else {
                    s.plan(&req.run_id, "tail").await
                };
                let decision = match planned {
                    Ok((decision, _)) => Some(decision),
                    Err(status) => match error_info(&status).map(|i| i.reason) {
                        Some(r) if r == ErrorReason::RecoveryNotBefore.as_str_name() => {
                            Some(pb::RecoveryDecision::Wait)
                        }
                        Some(r) if r == ErrorReason::RecoveryExhausted.as_str_name() => {
                            Some(pb::RecoveryDecision::Exhausted)
                        }
                        _ => None,
                    },
                };
                let new = decision.filter(|d| {
                    *d != pb::RecoveryDecision::LeaseHeld
                        && !(*d == pb::RecoveryDecision::NoControllerYet
                            && last_decision == Some(*d))
                });
                if decision.is_some() {
                    last_decision = decision;
                }
                if let Some(decision) = new {
                    let b = s
                        .store
                        .budget(&req.run_id, s.now_ms())
                        .await
                        .map_err(store_error)?;
                    if !send(Item::Recovery(pb::RecoveryNotice {
                        decision: decision as i32,
                        budget: Some(budget_of(&b)),
                    }))
                    .await
                    {
                        return Ok(());
                    }
                }
            }
        }
        // Wait for a change to the run's stream, its state, a plan, or a heartbeat.
        let wake_at = due
            .at()
            .min(plan_at)
            .min(tokio::time::Instant::now() + TAIL_RECHECK);
        let woken = tokio::select! {
            woken = changes.changed(wake_at) => woken,
            changed = followed.changed() => changed.is_ok(),
            () = tx.closed() => return Ok(()),
        };
        if woken {
            // A lease may have changed hands: look at it again, within the plan limit.
            plan_at = plan_at.min(tokio::time::Instant::now() + TAIL_PLAN_EVERY);
        }
        // Nothing sent for an interval: say the stream is alive, and where it is.
        if due.is_due()
            && !send(Item::Heartbeat(pb::Heartbeat {
                next_sequence: next,
                server_time: Some(timestamp(s.now_ms())),
            }))
            .await
        {
            return Ok(());
        }
    }
}
