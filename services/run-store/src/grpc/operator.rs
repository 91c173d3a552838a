//! RunService: what operators and services call.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use prost::Message;
use runplane_grpc::proto_duration as duration;
use runplane_ids::OrgScope;
use runplane_proto::limits::MAX_LIST_RUNS_RUN_IDS;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_server::RunService;
use runplane_telemetry::metrics;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::create::{CheckedCreateRun, check_create_run};
use super::fields::from_duration;
use super::page::{decode_page_token, encode_page_token, page_filter_digest};
use super::service_state::ServiceState;
use super::watch;
use crate::convert;
use crate::domain::ids::{digest_hex, hex};
use crate::domain::state::RunState;
use crate::domain::validate;
use crate::error::RunStoreError;
use crate::store::{FailRequest, NewRun, RunFilter};

/// Most bytes of a CancelRun reason.
const MAX_CANCEL_REASON_BYTES: usize = 256;

/// Most bytes of runs in one ListRuns page, far below the 4 MiB a client decodes by
/// default, whatever the runs hold.
const MAX_PAGE_BYTES: usize = 2 << 20;

/// `runplane.runstore.v1.RunService`: calls from operators and other services.
#[derive(Debug, Clone)]
pub struct RunApi {
    pub state: Arc<ServiceState>,
}

pub(super) type WatchStream = Pin<
    Box<
        dyn Stream<Item = std::result::Result<runstore_pb::WatchRunResponse, Status>>
            + Send
            + 'static,
    >,
>;

#[tonic::async_trait]
impl RunService for RunApi {
    #[tracing::instrument(skip_all, fields(org_id = %request.get_ref().org_id, credential_id))]
    async fn create_run(
        &self,
        request: Request<runstore_pb::CreateRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::CreateRunResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let req = request.get_ref();
        let CheckedCreateRun {
            profile,
            credential_id,
            labels,
            max_duration,
            priority,
        } = check_create_run(req, s.settings.max_run_duration_seconds)?;
        scope.org_for(&req.org_id).map_err(RunStoreError::from)?;
        let mut body = serde_json::to_value((
            &req.org_id,
            &req.lead_id,
            &profile,
            &credential_id,
            &req.command,
            &req.args,
            &labels,
        ))
        .expect("serialisable");
        // Only a request that asks for a deadline digests it, so the digests of requests
        // made before deadlines existed stay what they were.
        if let (Some(d), Some(body)) = (max_duration, body.as_array_mut()) {
            body.push(serde_json::json!(d.as_micros() as u64));
        }
        // Likewise a priority, after the deadline (null when none was asked for).
        if let (Some(p), Some(body)) = (priority, body.as_array_mut()) {
            if max_duration.is_none() {
                body.push(serde_json::Value::Null);
            }
            body.push(serde_json::json!(p));
        }
        let request_digest = digest_hex(body.to_string().as_bytes());
        // A replay returns the run it created, whatever credential health says now.
        if let Some(run) = s
            .store
            .existing_run(&req.org_id, &req.client_request_id, &request_digest)
            .await?
        {
            return Ok(Response::new(runstore_pb::CreateRunResponse {
                run: Some(convert::run(&run)),
            }));
        }
        let target = req.target.as_ref().expect("validated above");
        let admitted = s.admit(&req.org_id, target).await?;
        let credential_id = if admitted.credential_id.is_empty() {
            credential_id
        } else {
            admitted.credential_id
        };
        // The run's own deadline, else its profile's, never past the configured bound.
        let bound = Duration::from_secs(s.settings.max_run_duration_seconds.into());
        let max_duration = max_duration.or_else(|| {
            (admitted.max_run_seconds > 0)
                .then(|| Duration::from_secs(admitted.max_run_seconds.into()).min(bound))
        });
        tracing::Span::current().record("credential_id", credential_id.as_str());
        let (run, created) = s
            .store
            .create_run(NewRun {
                org_id: req.org_id.clone(),
                lead_id: req.lead_id.clone(),
                client_request_id: req.client_request_id.clone(),
                request_digest,
                credential_id,
                profile,
                command: req.command.clone(),
                args: req.args.clone(),
                labels,
                max_duration_us: max_duration.map(|d| d.as_micros() as i64),
                priority: priority.unwrap_or(admitted.priority),
                max_queued: s.settings.tenancy.max_queued_runs(&req.org_id),
            })
            .await?;
        if created {
            metrics::runs_created().add(1, &[]);
            s.changes.created();
            tracing::info!(run_id = %run.id, "run created");
        }
        Ok(Response::new(runstore_pb::CreateRunResponse {
            run: Some(convert::run(&run)),
        }))
    }

    async fn get_run(
        &self,
        request: Request<runstore_pb::GetRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::GetRunResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let run = s.visible_run(&scope, &request.get_ref().run_id).await?;
        let mut answer = convert::run(&run);
        answer.attempts = s
            .store
            .attempts(&run.id)
            .await?
            .iter()
            .map(convert::attempt)
            .collect();
        Ok(Response::new(runstore_pb::GetRunResponse {
            run: Some(answer),
        }))
    }

    async fn list_runs(
        &self,
        request: Request<runstore_pb::ListRunsRequest>,
    ) -> std::result::Result<Response<runstore_pb::ListRunsResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let req = request.get_ref();
        let org_id = scope
            .org_for(&req.org_id)
            .map_err(RunStoreError::from)?
            .map(str::to_owned);
        let mut states = Vec::new();
        for st in &req.states {
            let st = runstore_pb::RunState::try_from(*st)
                .ok()
                .and_then(|st| RunState::try_from(st).ok())
                .ok_or_else(|| {
                    RunStoreError::invalid("states", "holds an unknown or unspecified state")
                })?;
            states.push(st);
        }
        if req.run_ids.len() > MAX_LIST_RUNS_RUN_IDS {
            return Err(RunStoreError::invalid(
                "run_ids",
                format!("at most {MAX_LIST_RUNS_RUN_IDS} ids"),
            )
            .into());
        }
        for id in &req.run_ids {
            validate::run_id(id)?;
        }
        let limit = runplane_grpc::page_size(req.page_size, 50)
            .map_err(|reason| RunStoreError::invalid("page_size", reason))?;
        let selector = crate::domain::labels::Selector::parse(&req.label_selector)
            .map_err(|reason| RunStoreError::invalid("label_selector", reason))?;
        let mut filter = RunFilter {
            org_id,
            lead_id: (!req.lead_id.is_empty()).then(|| req.lead_id.clone()),
            credential_id: (!req.credential_id.is_empty()).then(|| req.credential_id.clone()),
            profile: (!req.profile.is_empty()).then(|| req.profile.clone()),
            states,
            run_ids: req.run_ids.clone(),
            with_pending_messages: req.with_pending_messages,
            paused_only: req.paused_only,
            labels: selector.terms,
            after: None,
            limit: u64::from(limit) + 1,
            basic: req.view() == runstore_pb::RunView::Basic,
        };
        let filter_digest = page_filter_digest(&filter);
        if !req.page_token.is_empty() {
            filter.after = Some(decode_page_token(&req.page_token, &filter_digest)?);
        }
        let mut runs = s.store.list_runs(&filter).await?;
        let more = runs.len() > limit as usize;
        runs.truncate(limit as usize);
        let mut page = Vec::with_capacity(runs.len());
        let mut bytes = 0;
        for run in &runs {
            let run = convert::run_in(run, req.view());
            bytes += prost::Message::encoded_len(&run);
            // A page holds at least one run; a run is bounded far below the budget.
            if bytes > MAX_PAGE_BYTES && !page.is_empty() {
                break;
            }
            page.push(run);
        }
        let last = page.len().checked_sub(1).and_then(|i| runs.get(i));
        let next_page_token = match last {
            Some(last) if more || page.len() < runs.len() => {
                encode_page_token(&filter_digest, last.created_at_us, &last.id)
            }
            _ => String::new(),
        };
        Ok(Response::new(runstore_pb::ListRunsResponse {
            runs: page,
            next_page_token,
        }))
    }

    async fn count_active_runs(
        &self,
        request: Request<runstore_pb::CountActiveRunsRequest>,
    ) -> std::result::Result<Response<runstore_pb::CountActiveRunsResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        if req.credential_ids.len() > 10_000 || req.profiles.len() > 10_000 {
            return Err(RunStoreError::invalid("credential_ids", "at most 10000 entries").into());
        }
        let mut counts = s
            .store
            .count_active(&req.credential_ids, &req.profiles)
            .await?;
        if !req.credential_ids.is_empty() {
            counts
                .by_credential
                .retain(|k, _| req.credential_ids.contains(k));
        }
        if !req.profiles.is_empty() {
            counts.by_profile.retain(|k, _| req.profiles.contains(k));
        }
        counts.by_profile_credential.retain(|k, _| {
            let (profile, credential) = k.split_once('/').unwrap_or_default();
            (req.profiles.is_empty() || req.profiles.iter().any(|p| p == profile))
                && (req.credential_ids.is_empty()
                    || req.credential_ids.iter().any(|c| c == credential))
        });
        Ok(Response::new(runstore_pb::CountActiveRunsResponse {
            active_by_credential: counts.by_credential,
            active_by_profile: counts.by_profile,
            active_by_profile_credential: counts.by_profile_credential,
            queued_by_credential: counts.queued_by_credential,
            counted_at: Some(runplane_clock::to_timestamp(s.store.now_us())),
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn wait_for_runs(
        &self,
        request: Request<runstore_pb::WaitForRunsRequest>,
    ) -> std::result::Result<Response<runstore_pb::WaitForRunsResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let wait = from_duration("wait", request.get_ref().wait.as_ref())?
            .unwrap_or_default()
            .min(s.settings.limits.max_poll_wait);
        let deadline = tokio::time::Instant::now() + wait;
        let woken = s
            .changes
            .subscribe(crate::changes::RECONCILER_WORK)
            .changed(deadline)
            .await;
        Ok(Response::new(runstore_pb::WaitForRunsResponse { woken }))
    }

    #[tracing::instrument(skip_all, fields(credentials = request.get_ref().credentials.len(), claimed))]
    async fn claim_slots(
        &self,
        request: Request<runstore_pb::ClaimSlotsRequest>,
    ) -> std::result::Result<Response<runstore_pb::ClaimSlotsResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        if req.credentials.len() > 10_000 {
            return Err(RunStoreError::invalid("credentials", "at most 10000 entries").into());
        }
        let max_runs = match req.max_runs {
            0 => 100,
            n @ 1..=500 => n,
            _ => return Err(RunStoreError::invalid("max_runs", "must be 0 to 500").into()),
        };
        let mut capacity = std::collections::HashMap::new();
        for c in &req.credentials {
            validate::name("credentials.credential_id", &c.credential_id)?;
            validate::bounded("credentials.unavailable", &c.unavailable, 0, 256)?;
            if c.unavailable_orgs.len() > 10_000 {
                return Err(RunStoreError::invalid(
                    "credentials.unavailable_orgs",
                    "at most 10000 entries",
                )
                .into());
            }
            let mut unavailable_orgs = std::collections::HashMap::new();
            for o in &c.unavailable_orgs {
                validate::name("credentials.unavailable_orgs.org_id", &o.org_id)?;
                validate::bounded("credentials.unavailable_orgs.reason", &o.reason, 1, 256)?;
                unavailable_orgs.insert(o.org_id.clone(), o.reason.clone());
            }
            capacity.insert(
                c.credential_id.clone(),
                crate::store::SlotLimit {
                    capacity: c.capacity,
                    unavailable: c.unavailable.clone(),
                    unavailable_orgs,
                },
            );
        }
        let claimed = s
            .store
            .claim_slots(
                (!req.unlimited).then_some(&capacity),
                &s.settings.tenancy,
                max_runs.into(),
            )
            .await?;
        tracing::Span::current().record("claimed", claimed.len());
        for run in &claimed {
            s.changes.notify(&run.id);
        }
        Ok(Response::new(runstore_pb::ClaimSlotsResponse {
            claimed: claimed
                .iter()
                .map(|run| convert::run_in(run, runstore_pb::RunView::Basic))
                .collect(),
        }))
    }

    async fn watch_run(
        &self,
        request: Request<runstore_pb::WatchRunRequest>,
    ) -> std::result::Result<Response<WatchStream>, Status> {
        let s = self.state.clone();
        let scope = s.org_scope(&request)?;
        let req = request.into_inner();
        validate::int64("after_sequence", req.after_sequence)?;
        let heartbeat = runplane_grpc::heartbeat::interval(req.heartbeat_interval.as_ref())
            .map_err(|why| RunStoreError::invalid("heartbeat_interval", why))?;
        let first = s.visible_run(&scope, &req.run_id).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            if let Err(status) = watch::watch(&s, first, &req, heartbeat, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, generation = request.get_ref().sandbox_generation))]
    async fn issue_run_key(
        &self,
        request: Request<runstore_pb::IssueRunKeyRequest>,
    ) -> std::result::Result<Response<runstore_pb::IssueRunKeyResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        validate::name("sandbox_id", &req.sandbox_id)?;
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        if validate::int64("sandbox_generation", req.sandbox_generation)? == 0 {
            return Err(RunStoreError::invalid("sandbox_generation", "must be at least 1").into());
        }
        validate::bounded("node_id", &req.node_id, 0, 128)?;
        let (key, secret) = s
            .store
            .issue_run_key(
                &req.run_id,
                &crate::store::KeyFor {
                    sandbox_id: &req.sandbox_id,
                    generation: req.sandbox_generation,
                    attempt: req.attempt,
                    node_id: &req.node_id,
                },
                &req.idempotency_key,
            )
            .await?;
        s.changes.notify(&req.run_id);
        tracing::info!(key_id = %key.key_id, "run key issued");
        Ok(Response::new(runstore_pb::IssueRunKeyResponse {
            run_key: secret,
            key_id: key.key_id,
            sandbox_generation: key.sandbox_generation as u64,
        }))
    }

    async fn check_run_key(
        &self,
        request: Request<runstore_pb::CheckRunKeyRequest>,
    ) -> std::result::Result<Response<runstore_pb::CheckRunKeyResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        if req.key_sha256.len() != 32 {
            return Err(RunStoreError::invalid("key_sha256", "must be 32 bytes").into());
        }
        let auth = s
            .store
            .authenticate_key_hash(&hex(&req.key_sha256), &req.run_id, false)
            .await?;
        Ok(Response::new(runstore_pb::CheckRunKeyResponse {
            org_id: auth.run.org_id.clone(),
            run_state: runstore_pb::RunState::from(auth.run.state) as i32,
            sandbox_generation: auth.key.sandbox_generation as u64,
            attempt: crate::store::attempts::attempt_of(&auth.key),
            key_id: auth.key.key_id,
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn steer(
        &self,
        request: Request<runstore_pb::SteerRequest>,
    ) -> std::result::Result<Response<runstore_pb::SteerResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let req = request.get_ref();
        s.visible_run(&scope, &req.run_id).await?;
        validate::bounded("text", &req.text, 1, 8192)?;
        if req.text.contains('\n') {
            return Err(RunStoreError::invalid("text", "must be one line (no newline)").into());
        }
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        let payload = runstore_pb::SteerPayload {
            text: req.text.clone(),
        }
        .encode_to_vec();
        let message = s
            .store
            .enqueue(
                &req.run_id,
                runstore_pb::SteeringKind::Steer,
                payload,
                &req.idempotency_key,
                false,
                Some(s.settings.max_queued_steering_messages),
            )
            .await?;
        s.changes.queued(&req.run_id);
        Ok(Response::new(runstore_pb::SteerResponse {
            message: Some(convert::message(&message)),
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn interrupt(
        &self,
        request: Request<runstore_pb::InterruptRequest>,
    ) -> std::result::Result<Response<runstore_pb::InterruptResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let req = request.get_ref();
        let run = s.visible_run(&scope, &req.run_id).await?;
        validate::bounded("reason", &req.reason, 0, 512)?;
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        let grace = from_duration("grace", req.grace.as_ref())?.unwrap_or(Duration::from_secs(10));
        if grace > Duration::from_secs(300) {
            return Err(RunStoreError::invalid("grace", "must be at most 5 minutes").into());
        }
        if run.state == RunState::Queued
            && let Some(cancelled) = s
                .store
                .cancel_queued(&req.run_id, &req.reason, &s.settings.signer)
                .await?
        {
            s.changes.ended(&req.run_id, cancelled.state);
            return Ok(Response::new(runstore_pb::InterruptResponse {
                message: None,
                run: Some(convert::run(&cancelled)),
            }));
        }
        let payload = runstore_pb::InterruptPayload {
            reason: req.reason.clone(),
            grace: Some(duration(grace)),
        }
        .encode_to_vec();
        let message = s
            .store
            .enqueue(
                &req.run_id,
                runstore_pb::SteeringKind::Interrupt,
                payload,
                &req.idempotency_key,
                false,
                Some(s.settings.max_queued_steering_messages),
            )
            .await?;
        s.changes.queued(&req.run_id);
        let run = s.store.get_run(&req.run_id).await?;
        Ok(Response::new(runstore_pb::InterruptResponse {
            message: Some(convert::message(&message)),
            run: Some(convert::run(&run)),
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn enqueue_control(
        &self,
        request: Request<runstore_pb::EnqueueControlRequest>,
    ) -> std::result::Result<Response<runstore_pb::EnqueueControlResponse>, Status> {
        use runstore_pb::enqueue_control_request::Control;
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        let (kind, payload, on_terminal) = match &req.control {
            Some(Control::ResumeStream(p)) => {
                validate::bounded(
                    "resume_stream.controller_token",
                    &p.controller_token,
                    1,
                    256,
                )?;
                (
                    runstore_pb::SteeringKind::ResumeStream,
                    p.encode_to_vec(),
                    false,
                )
            }
            Some(Control::Abort(p)) => {
                validate::snake_reason("abort.reason", &p.reason)?;
                (runstore_pb::SteeringKind::Abort, p.encode_to_vec(), true)
            }
            None => {
                return Err(RunStoreError::invalid(
                    "control",
                    "one of resume_stream or abort is required",
                )
                .into());
            }
        };
        let message = s
            .store
            .enqueue(
                &req.run_id,
                kind,
                payload,
                &req.idempotency_key,
                on_terminal,
                // A service's control (a stream resume, an abort) is never refused.
                None,
            )
            .await?;
        s.changes.queued(&req.run_id);
        Ok(Response::new(runstore_pb::EnqueueControlResponse {
            message: Some(convert::message(&message)),
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn cancel_run(
        &self,
        request: Request<runstore_pb::CancelRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::CancelRunResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let req = request.get_ref();
        validate::bounded("reason", &req.reason, 0, MAX_CANCEL_REASON_BYTES)?;
        if req.reason.chars().any(char::is_control) {
            return Err(
                RunStoreError::invalid("reason", "must not contain control characters").into(),
            );
        }
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        let run = s.visible_run(&scope, &req.run_id).await?;
        // The cancel is part of the run's story: it joins the run's trace.
        let span = tracing::info_span!("run.cancel", run_id = %run.id);
        runplane_grpc::trace_context::continue_trace(&span, &run.traceparent);
        let message = if req.reason.is_empty() {
            "cancelled by an operator"
        } else {
            req.reason.as_str()
        };
        let digest = digest_hex(message.as_bytes());
        let finished = s
            .store
            .cancel_run(
                &req.run_id,
                message,
                &req.idempotency_key,
                &digest,
                &s.settings.signer,
            )
            .instrument(span.clone())
            .await?;
        if finished.made_terminal {
            s.changes.ended(&req.run_id, finished.run.state);
            span.in_scope(|| tracing::info!(reason = %message, "run cancelled"));
        } else {
            s.changes.ended_again(&req.run_id);
        }
        Ok(Response::new(runstore_pb::CancelRunResponse {
            run: Some(convert::run(&finished.run)),
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id, reason = %request.get_ref().reason))]
    async fn fail_run(
        &self,
        request: Request<runstore_pb::FailRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::FailRunResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        validate::snake_reason("reason", &req.reason)?;
        validate::bounded("message", &req.message, 0, 512)?;
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        if !req.if_sandbox_id.is_empty() {
            validate::name("if_sandbox_id", &req.if_sandbox_id)?;
        }
        if let Some(generation) = req.if_sandbox_generation {
            validate::int64("if_sandbox_generation", generation)?;
        }
        // Without a sandbox guard the digest is what it was before the guard existed, so a
        // FailRun owed across an upgrade still replays as itself.
        let digest = if req.if_sandbox_id.is_empty() {
            serde_json::to_string(&(&req.reason, &req.message, req.if_sandbox_generation))
        } else {
            serde_json::to_string(&(
                &req.reason,
                &req.message,
                req.if_sandbox_generation,
                &req.if_sandbox_id,
            ))
        };
        let digest = digest_hex(digest.expect("serialisable").as_bytes());
        let crate::store::Keyed {
            outcome,
            run,
            replayed,
        } = s
            .store
            .fail_run(
                &req.run_id,
                &FailRequest {
                    reason: &req.reason,
                    message: &req.message,
                    idempotency_key: &req.idempotency_key,
                    guard_generation: req.if_sandbox_generation,
                    guard_sandbox: (!req.if_sandbox_id.is_empty())
                        .then_some(req.if_sandbox_id.as_str()),
                    request_digest: &digest,
                },
                &s.settings.signer,
            )
            .await?;
        if replayed {
            s.changes.ended_again(&req.run_id);
        } else if outcome == runstore_pb::FailRunOutcome::MadeTerminal {
            s.changes.ended(&req.run_id, run.state);
        } else if outcome == runstore_pb::FailRunOutcome::AttemptEnded {
            s.changes.attempt_ended(&req.run_id);
        }
        tracing::info!(outcome = outcome.as_str_name(), "fail run");
        Ok(Response::new(runstore_pb::FailRunResponse {
            outcome: outcome as i32,
            run: Some(convert::run(&run)),
        }))
    }

    #[tracing::instrument(skip_all, fields(run_id = %request.get_ref().run_id))]
    async fn mark_backend_error(
        &self,
        request: Request<runstore_pb::MarkBackendErrorRequest>,
    ) -> std::result::Result<Response<runstore_pb::MarkBackendErrorResponse>, Status> {
        let s = &self.state;
        s.service(&request)?;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        validate::client_key("idempotency_key", &req.idempotency_key)?;
        let kind = match runstore_pb::BackendErrorKind::try_from(req.kind) {
            Ok(
                k @ (runstore_pb::BackendErrorKind::Error
                | runstore_pb::BackendErrorKind::Exhausted),
            ) => k,
            _ => return Err(RunStoreError::invalid("kind", "must be error or exhausted").into()),
        };
        validate::bounded("reason", &req.reason, 1, 512)?;
        validate::name("credential_id", &req.credential_id)?;
        validate::bounded("incident_id", &req.incident_id, 0, 128)?;
        validate::bounded("turn_id", &req.turn_id, 0, 128)?;
        let request_json = serde_json::json!({
            "kind": kind.as_str_name(),
            "reason": req.reason,
            "credential_id": req.credential_id,
            "incident_id": req.incident_id,
            "turn_id": req.turn_id,
        });
        let digest = digest_hex(request_json.to_string().as_bytes());
        let mut outcome_json = request_json;
        outcome_json["recorded_at_us"] = s.store.now_us().into();
        let crate::store::Keyed {
            outcome,
            run,
            replayed,
        } = s
            .store
            .mark_backend_error(
                &req.run_id,
                &req.idempotency_key,
                &digest,
                &outcome_json.to_string(),
                &req.reason,
                &s.settings.signer,
            )
            .await?;
        if replayed {
            s.changes.ended_again(&req.run_id);
        } else if outcome == runstore_pb::MarkBackendErrorOutcome::Marked {
            s.changes.ended(&req.run_id, run.state);
        } else {
            s.changes.notify(&req.run_id);
        }
        Ok(Response::new(runstore_pb::MarkBackendErrorResponse {
            outcome: outcome as i32,
            run: Some(convert::run(&run)),
        }))
    }

    async fn get_receipt(
        &self,
        request: Request<runstore_pb::GetReceiptRequest>,
    ) -> std::result::Result<Response<runstore_pb::GetReceiptResponse>, Status> {
        let s = &self.state;
        let scope = s.org_scope(&request)?;
        let run_id = &request.get_ref().run_id;
        let run = match s.visible_run(&scope, run_id).await {
            Ok(run) => Some(run),
            // Retention deleted the run and kept its receipt, the audit record: the
            // receipt's own body says whose it is.
            Err(RunStoreError::RunNotFound { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        let not_found = || RunStoreError::RunNotFound {
            run_id: run_id.clone(),
        };
        let receipt = match (run, s.store.receipt(run_id).await?) {
            (_, Some(receipt)) => receipt,
            (Some(run), None) => {
                return Err(RunStoreError::ReceiptNotSealed { run_id: run.id }.into());
            }
            (None, None) => return Err(not_found().into()),
        };
        let org = receipt
            .body
            .as_ref()
            .map(|b| b.org_id.as_str())
            .unwrap_or("");
        let visible = match &scope {
            OrgScope::Any => true,
            OrgScope::Only(own) => !org.is_empty() && org == own,
        };
        if !visible {
            return Err(not_found().into());
        }
        Ok(Response::new(runstore_pb::GetReceiptResponse {
            receipt: Some(receipt),
        }))
    }

    async fn get_receipt_public_key(
        &self,
        request: Request<runstore_pb::GetReceiptPublicKeyRequest>,
    ) -> std::result::Result<Response<runstore_pb::GetReceiptPublicKeyResponse>, Status> {
        let s = &self.state;
        s.org_scope(&request)?;
        let key_id = &request.get_ref().key_id;
        let signer = &s.settings.signer;
        let public_key = if key_id == signer.key_id() {
            signer.public_key()
        } else if let Some(retired) = s.settings.retired_receipt_keys.get(key_id) {
            *retired
        } else {
            return Err(RunStoreError::ReceiptKeyUnknown {
                key_id: key_id.clone(),
            }
            .into());
        };
        Ok(Response::new(runstore_pb::GetReceiptPublicKeyResponse {
            key_id: key_id.clone(),
            public_key: public_key.to_vec(),
            algorithm: "ed25519".into(),
        }))
    }

    async fn pause_run(
        &self,
        request: Request<runstore_pb::PauseRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::PauseRunResponse>, Status> {
        let scope = self.state.org_scope(&request)?;
        let req = request.get_ref();
        let run = super::pause::toggle(
            &self.state,
            &scope,
            &req.run_id,
            &req.idempotency_key,
            super::pause::Toggle::Pause,
        )
        .await?;
        Ok(Response::new(runstore_pb::PauseRunResponse {
            run: Some(run),
        }))
    }

    async fn resume_run(
        &self,
        request: Request<runstore_pb::ResumeRunRequest>,
    ) -> std::result::Result<Response<runstore_pb::ResumeRunResponse>, Status> {
        let scope = self.state.org_scope(&request)?;
        let req = request.get_ref();
        let run = super::pause::toggle(
            &self.state,
            &scope,
            &req.run_id,
            &req.idempotency_key,
            super::pause::Toggle::Resume,
        )
        .await?;
        Ok(Response::new(runstore_pb::ResumeRunResponse {
            run: Some(run),
        }))
    }

    async fn list_webhooks(
        &self,
        _request: Request<runstore_pb::ListWebhooksRequest>,
    ) -> std::result::Result<Response<runstore_pb::ListWebhooksResponse>, Status> {
        Ok(Response::new(super::webhooks::list(&self.state).await?))
    }

    async fn report_waiting_for_input(
        &self,
        request: Request<runstore_pb::ReportWaitingForInputRequest>,
    ) -> std::result::Result<Response<runstore_pb::ReportWaitingForInputResponse>, Status> {
        let s = &self.state;
        let req = request.get_ref();
        validate::run_id(&req.run_id)?;
        let generation = validate::int64("execution_generation", req.execution_generation)?;
        let seq = validate::int64("observation_seq", req.observation_seq)?;
        let applied = s
            .store
            .report_waiting(&req.run_id, generation, seq, req.waiting)
            .await?;
        if applied {
            s.changes.notify(&req.run_id);
        }
        Ok(Response::new(runstore_pb::ReportWaitingForInputResponse {
            applied,
        }))
    }
}
