//! The tonic side of credential health: `runplane.credentials.v1.CredentialHealthService`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use runplane_db::notify::Relay;
use runplane_grpc::client::{Bearer, TracedChannel};
use runplane_grpc::wake::Wakeups;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_server::CredentialHealthService;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_telemetry::metrics;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use crate::domain::profiles::Profiles;
use crate::error::CredentialHealthError;
use crate::store::incidents::incident_view;
use crate::store::{Report, Store};
use crate::view::{self, timestamp};

/// The run store, called with the service token.
pub type RunStoreClient = RunServiceClient<InterceptedService<TracedChannel, Bearer>>;

/// Longest failure tail accepted (the run store bounds it the same).
pub const MAX_FAILURE_TAIL_BYTES: usize = 8 << 10;

/// How long admission waits for the run store's active-run count before choosing
/// without it.
const COUNT_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the replica re-reads the notice counters of the leads being watched,
/// without a wake-up (the safety net: other replicas' notices arrive by NOTIFY).
pub const NOTICE_RECHECK: Duration = Duration::from_secs(30);
/// The Postgres channel of new notices; a key is a lead's [`crate::store::notices::notice_key`].
pub const NOTICE_CHANNEL: &str = "runplane_lead_notices";

/// What every CredentialHealthService handler works with; [`crate::CredentialHealth`]'s
/// rounds and shutdown reach the same store, clients and watchers through it.
pub struct HealthServiceState {
    pub store: Store,
    pub profiles: Profiles,
    pub run_store: RunStoreClient,
    /// The tokens the server's authentication layer knows (`[auth]`).
    pub tokens: runplane_grpc::auth::Tokens,
    /// Notice watchers, by lead ([`crate::store::notices::notice_key`]); what each last sent is its
    /// lead's notice sequence.
    pub notices: Wakeups<i64>,
    /// Tells the other replicas which leads got notices (Postgres only).
    pub notice_relay: Option<Relay>,
    /// Bumped when this process owes the run store a call.
    pub outbox: watch::Sender<u64>,
    /// Set at shutdown: watches end.
    pub closing: watch::Sender<bool>,
}

impl std::fmt::Debug for HealthServiceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthServiceState").finish_non_exhaustive()
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator or service token: any org.
    AnyOrg,
    /// An org token: only its org.
    Org(String),
}

impl HealthServiceState {
    /// Calls only runplane's services and operators make: an org token is refused.
    fn authenticate<T>(&self, request: &Request<T>) -> Result<(), CredentialHealthError> {
        match self.caller(request)? {
            Caller::AnyOrg => Ok(()),
            Caller::Org(org) => Err(CredentialHealthError::OrgDenied { org }),
        }
    }

    /// The caller the server's authentication layer found; only WatchNotices takes an
    /// org token, and the layer refuses one on every other method.
    fn caller<T>(&self, request: &Request<T>) -> Result<Caller, CredentialHealthError> {
        match runplane_grpc::auth::caller(request) {
            Some(runplane_grpc::auth::Caller::Operator | runplane_grpc::auth::Caller::Service) => {
                Ok(Caller::AnyOrg)
            }
            Some(runplane_grpc::auth::Caller::Org(org)) => Ok(Caller::Org(org.clone())),
            Some(runplane_grpc::auth::Caller::Presented(_)) | None => {
                Err(CredentialHealthError::Unauthenticated)
            }
        }
    }

    /// Active runs per credential and per `profile/credential`, from the run store.
    async fn count_active(
        &self,
        credentials: Vec<String>,
    ) -> Result<runstore_pb::CountActiveRunsResponse, CredentialHealthError> {
        let mut client = self.run_store.clone();
        let call = client.count_active_runs(runstore_pb::CountActiveRunsRequest {
            credential_ids: credentials,
            profiles: Vec::new(),
        });
        match tokio::time::timeout(COUNT_TIMEOUT, call).await {
            Ok(Ok(answer)) => Ok(answer.into_inner()),
            Ok(Err(status)) => Err(CredentialHealthError::Upstream(format!(
                "{:?}: {}",
                status.code(),
                status.message()
            ))),
            Err(_) => Err(CredentialHealthError::Upstream(
                "CountActiveRuns did not answer in time".into(),
            )),
        }
    }
}

/// `runplane.credentials.v1.CredentialHealthService`.
#[derive(Debug, Clone)]
pub struct CredentialHealthApi {
    pub state: Arc<HealthServiceState>,
}

fn name(field: &'static str, value: &str, required: bool) -> Result<(), CredentialHealthError> {
    if value.is_empty() {
        return if required {
            Err(CredentialHealthError::invalid(field, "is required"))
        } else {
            Ok(())
        };
    }
    if runplane_config::is_name(value) {
        Ok(())
    } else {
        Err(CredentialHealthError::invalid(
            field,
            "must be 1-128 characters of A-Z a-z 0-9 . _ : -",
        ))
    }
}

type NoticeStream = Pin<
    Box<dyn Stream<Item = Result<credentials_pb::WatchNoticesResponse, Status>> + Send + 'static>,
>;

#[tonic::async_trait]
impl CredentialHealthService for CredentialHealthApi {
    #[tracing::instrument(skip_all, fields(
        run_id = %request.get_ref().run_id,
        credential_id = %request.get_ref().credential_id,
        outcome,
    ))]
    async fn report_turn_failure(
        &self,
        request: Request<credentials_pb::ReportTurnFailureRequest>,
    ) -> Result<Response<credentials_pb::ReportTurnFailureResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.into_inner();
        let key_ok = (16..=128).contains(&req.turn_id.len())
            && req.turn_id.bytes().all(|b| b.is_ascii_graphic());
        if !key_ok {
            return Err(CredentialHealthError::invalid(
                "turn_id",
                "must be 16-128 printable ASCII characters",
            )
            .into());
        }
        name("run_id", &req.run_id, true)?;
        name("org_id", &req.org_id, true)?;
        name("lead_id", &req.lead_id, false)?;
        name("credential_id", &req.credential_id, true)?;
        name("profile", &req.profile, false)?;
        if req.failure_tail.len() > MAX_FAILURE_TAIL_BYTES {
            return Err(CredentialHealthError::invalid(
                "failure_tail",
                format!("at most {MAX_FAILURE_TAIL_BYTES} bytes"),
            )
            .into());
        }
        if !req.profile.is_empty() && s.profiles.named(&req.profile).next().is_none() {
            return Err(CredentialHealthError::ProfileUnknown(req.profile).into());
        }
        let Some(profile) = s.profiles.for_failure(&req.profile, &req.credential_id) else {
            // Nobody can map this failure to a credential this service knows: it is
            // dropped from correlation, and loudly, not silently.
            tracing::warn!(
                run_id = %req.run_id,
                credential_id = %req.credential_id,
                profile = %req.profile,
                "turn failure on a credential no profile names; not classified"
            );
            return Err(CredentialHealthError::CredentialUnknown(req.credential_id).into());
        };
        let (outcome, reason) = profile.classify(&req.failure_tail);
        tracing::Span::current().record(
            "outcome",
            crate::store::turn_failures::outcome_name(outcome),
        );
        let on_credential: Vec<(String, u32)> = s
            .profiles
            .on_credential(&req.credential_id)
            .map(|p| (p.name.clone(), p.capacity))
            .collect();
        let request_digest = {
            let mut h = Sha256::new();
            for part in [
                &req.run_id,
                &req.credential_id,
                &req.profile,
                &req.failure_tail,
            ] {
                h.update((part.len() as u64).to_be_bytes());
                h.update(part.as_bytes());
            }
            h.finalize().iter().map(|b| format!("{b:02x}")).collect()
        };
        let report = Report {
            turn_id: req.turn_id,
            run_id: req.run_id,
            org_id: req.org_id,
            lead_id: req.lead_id,
            credential_id: req.credential_id,
            request_digest,
            outcome,
            reason,
            capacity: on_credential.iter().map(|(_, capacity)| capacity).sum(),
            profiles: on_credential.into_iter().map(|(name, _)| name).collect(),
        };
        let (answer, changes) = s.store.report(&report).await?;
        if changes.opened_incident {
            metrics::credential_incidents().add(1, &[]);
        }
        if changes.quarantined {
            metrics::credential_quarantines().add(1, &[]);
        }
        for lead in &changes.notified_leads {
            s.notices.wake(lead);
            if let Some(relay) = &s.notice_relay {
                relay.publish(lead);
            }
        }
        if changes.outbox {
            s.outbox.send_modify(|n| *n += 1);
        }
        if let Some(incident) = &answer.incident
            && changes.notices > 0
        {
            tracing::warn!(
                incident_id = %incident.id,
                credential_id = %incident.credential_id,
                runs = ?incident.opening_run_ids,
                "backend outage incident: credential cooling off"
            );
        }
        Ok(Response::new(answer))
    }

    #[tracing::instrument(skip_all, fields(org_id = %request.get_ref().org_id, credential_id))]
    async fn check_admission(
        &self,
        request: Request<credentials_pb::CheckAdmissionRequest>,
    ) -> Result<Response<credentials_pb::CheckAdmissionResponse>, Status> {
        use credentials_pb::check_admission_request::Target;
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.into_inner();
        name("org_id", &req.org_id, false)?;
        let org = req.org_id.as_str();
        let not_owned = |field: &'static str, value: &str| CredentialHealthError::NotOwned {
            org: org.to_owned(),
            target: format!(
                "{} {value}",
                if field == "profile" {
                    "profile"
                } else {
                    "credential"
                }
            ),
            field,
            value: value.to_owned(),
        };
        let mut max_run_seconds = 0;
        let (profile, candidates): (String, Vec<(String, u32)>) = match &req.target {
            Some(Target::Profile(p)) => {
                name("profile", p, true)?;
                if s.profiles.named(p).next().is_none() {
                    return Err(CredentialHealthError::ProfileUnknown(p.clone()).into());
                }
                // Only the org's own (or shared) credentials of the pool are candidates:
                // another org's credential is neither chosen nor reported on.
                let entries: Vec<(String, u32)> = s
                    .profiles
                    .named(p)
                    .filter(|e| e.admits(org))
                    .map(|e| {
                        max_run_seconds = max_run_seconds.max(e.max_run_seconds);
                        (e.credential_id.clone(), e.capacity)
                    })
                    .collect();
                if entries.is_empty() {
                    return Err(not_owned("profile", p).into());
                }
                (p.clone(), entries)
            }
            Some(Target::CredentialId(c)) => {
                name("credential_id", c, true)?;
                if s.profiles.on_credential(c).next().is_none() {
                    return Err(CredentialHealthError::CredentialUnknown(c.clone()).into());
                }
                // A credential named directly is the org's when some profile on it admits
                // the org; its capacity is what those profiles give.
                let capacity: u32 = s
                    .profiles
                    .on_credential(c)
                    .filter(|e| e.admits(org))
                    .map(|e| e.capacity)
                    .sum();
                if capacity == 0 {
                    return Err(not_owned("credential_id", c).into());
                }
                (String::new(), vec![(c.clone(), capacity)])
            }
            None => {
                return Err(CredentialHealthError::invalid(
                    "target",
                    "exactly one of profile or credential_id is required",
                )
                .into());
            }
        };
        let ids: Vec<String> = candidates.iter().map(|(c, _)| c.clone()).collect();
        let states = s.store.states(&ids).await?;
        let now = s.store.now_ms();
        let health = |c: &str| {
            states.get(c).map_or((0, 0), |(st, _)| {
                (
                    st.cooling_off_for_seconds(now),
                    st.quarantined_for_seconds(now),
                )
            })
        };
        let healthy: Vec<&(String, u32)> = candidates
            .iter()
            .filter(|(c, _)| health(c) == (0, 0))
            .collect();
        if healthy.is_empty() {
            let refused = refusal(&profile, &candidates, health);
            if let CredentialHealthError::Refused { reason, .. } = &refused {
                metrics::admission_refusals()
                    .add(1, &[metrics::attr("reason", reason.as_str_name())]);
            }
            return Err(refused.into());
        }
        // Busy slots, to pick the least loaded healthy credential and report free. The
        // count is advisory: if the run store cannot be asked, admission still answers.
        let counts = s.count_active(ids.clone()).await.ok();
        let busy = |c: &str| -> Option<u32> {
            let counts = counts.as_ref()?;
            Some(if profile.is_empty() {
                counts.active_by_credential.get(c).copied().unwrap_or(0)
            } else {
                counts
                    .active_by_profile_credential
                    .get(&format!("{profile}/{c}"))
                    .copied()
                    .unwrap_or(0)
            })
        };
        let free = |(c, capacity): &(String, u32)| capacity.saturating_sub(busy(c).unwrap_or(0));
        // The most free slots; on a tie, the first in credential order.
        let mut chosen = healthy[0];
        for candidate in &healthy[1..] {
            if free(candidate) > free(chosen) {
                chosen = candidate;
            }
        }
        tracing::Span::current().record("credential_id", chosen.0.as_str());
        Ok(Response::new(credentials_pb::CheckAdmissionResponse {
            free: free(chosen),
            credential_id: chosen.0.clone(),
            profile,
            max_run_seconds,
        }))
    }

    async fn get_fleet(
        &self,
        request: Request<credentials_pb::GetFleetRequest>,
    ) -> Result<Response<credentials_pb::GetFleetResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.into_inner();
        name("profile", &req.profile, false)?;
        name("credential_id", &req.credential_id, false)?;
        let entries: Vec<_> = s
            .profiles
            .all()
            .iter()
            .filter(|p| req.profile.is_empty() || p.name == req.profile)
            .filter(|p| req.credential_id.is_empty() || p.credential_id == req.credential_id)
            .collect();
        if entries.is_empty() {
            if !req.profile.is_empty() && s.profiles.named(&req.profile).next().is_none() {
                return Err(CredentialHealthError::ProfileUnknown(req.profile).into());
            }
            if !req.credential_id.is_empty()
                && s.profiles
                    .on_credential(&req.credential_id)
                    .next()
                    .is_none()
            {
                return Err(CredentialHealthError::CredentialUnknown(req.credential_id).into());
            }
        }
        let mut ids: Vec<String> = entries.iter().map(|p| p.credential_id.clone()).collect();
        ids.sort();
        ids.dedup();
        let states = s.store.states(&ids).await?;
        let counts = s.count_active(ids.clone()).await?;
        let now = s.store.now_ms();
        let default_state = crate::domain::policy::CredentialState::default();
        let credentials = ids
            .iter()
            .map(|c| {
                let on: Vec<_> = s.profiles.on_credential(c).collect();
                let (state, incident) = states
                    .get(c)
                    .map_or((&default_state, None), |(st, i)| (st, i.as_ref()));
                let mut health = view::credential(
                    c,
                    on.iter().map(|p| p.name.clone()).collect(),
                    on.iter().map(|p| p.capacity).sum(),
                    Some(counts.active_by_credential.get(c).copied().unwrap_or(0)),
                    state,
                    incident.map(|i| incident_view(i, now)),
                    now,
                );
                health.queued = counts.queued_by_credential.get(c).copied().unwrap_or(0);
                health
            })
            .collect();
        let profiles = entries
            .iter()
            .map(|p| {
                let (state, incident) = states
                    .get(&p.credential_id)
                    .map_or((&default_state, None), |(st, i)| (st, i.as_ref()));
                let cooling = state.cooling_off_for_seconds(now);
                let quarantined = state.quarantined_for_seconds(now);
                let busy = counts
                    .active_by_profile_credential
                    .get(&format!("{}/{}", p.name, p.credential_id))
                    .copied()
                    .unwrap_or(0);
                credentials_pb::ProfileHealth {
                    profile: p.name.clone(),
                    credential_id: p.credential_id.clone(),
                    capacity: p.capacity,
                    busy,
                    free: view::free(p.capacity, busy, cooling, quarantined),
                    cooling_off_for_seconds: cooling,
                    quarantined_for_seconds: quarantined,
                    open_incident_id: incident
                        .filter(|_| cooling > 0)
                        .map(|i| i.id.clone())
                        .unwrap_or_default(),
                }
            })
            .collect();
        Ok(Response::new(credentials_pb::GetFleetResponse {
            credentials,
            profiles,
            observed_at: Some(timestamp(now)),
        }))
    }

    async fn watch_notices(
        &self,
        request: Request<credentials_pb::WatchNoticesRequest>,
    ) -> Result<Response<NoticeStream>, Status> {
        let s = self.state.clone();
        let caller = s.caller(&request)?;
        let req = request.into_inner();
        if req.lead_id.is_empty() || req.lead_id.len() > 128 {
            return Err(CredentialHealthError::invalid("lead_id", "must be 1-128 bytes").into());
        }
        // Notices are keyed by (org, lead): the org comes from an org token, or is named
        // by an operator, never guessed.
        let org = match caller {
            Caller::Org(own) if req.org_id.is_empty() || req.org_id == own => own,
            Caller::Org(_) => {
                return Err(CredentialHealthError::OrgDenied { org: req.org_id }.into());
            }
            Caller::AnyOrg => {
                name("org_id", &req.org_id, true)?;
                req.org_id.clone()
            }
        };
        let heartbeat = runplane_grpc::heartbeat::interval(req.heartbeat_interval.as_ref())
            .map_err(|why| CredentialHealthError::invalid("heartbeat_interval", why))?;
        let mut cursor = match req.after_cursor.as_str() {
            "" => 0,
            c => parse_cursor(c, s.store.last_notice_seq(&org, &req.lead_id).await?)?,
        };
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut wake = s
                .notices
                .subscribe(&crate::store::notices::notice_key(&org, &req.lead_id));
            let mut closing = s.closing.subscribe();
            let due = runplane_grpc::heartbeat::Due::new(heartbeat);
            loop {
                let batch = match s.store.notices_after(&org, &req.lead_id, cursor, 100).await {
                    Ok(batch) => batch,
                    Err(e) => {
                        let _ = tx.send(Err(Status::from(e))).await;
                        return;
                    }
                };
                let full = batch.len() == 100;
                let mut missed = 0u32;
                for n in batch {
                    cursor = n.seq;
                    if n.pruned {
                        missed += 1;
                        continue;
                    }
                    if missed > 0 {
                        let gap = credentials_pb::watch_notices_response::Item::Gap(
                            credentials_pb::NoticesGap { missed },
                        );
                        due.sent();
                        if tx.send(Ok(item(gap))).await.is_err() {
                            return;
                        }
                        missed = 0;
                    }
                    let notice =
                        credentials_pb::watch_notices_response::Item::Notice(notice_view(&n));
                    due.sent();
                    if tx.send(Ok(item(notice))).await.is_err() {
                        return;
                    }
                }
                if missed > 0 {
                    let gap = credentials_pb::watch_notices_response::Item::Gap(
                        credentials_pb::NoticesGap { missed },
                    );
                    due.sent();
                    if tx.send(Ok(item(gap))).await.is_err() {
                        return;
                    }
                }
                if full {
                    continue;
                }
                if *closing.borrow() {
                    return;
                }
                wake.seen(cursor);
                // Read again only when the lead got a notice; heartbeats cost no query.
                loop {
                    let woken = tokio::select! {
                        woken = wake.changed(due.at()) => woken,
                        _ = closing.wait_for(|c| *c) => return,
                        () = tx.closed() => return,
                    };
                    if woken {
                        break;
                    }
                    // Nothing sent for an interval: say the stream is alive, and where it is.
                    due.sent();
                    let heartbeat = credentials_pb::watch_notices_response::Item::Heartbeat(
                        credentials_pb::Heartbeat {
                            cursor: if cursor > 0 {
                                cursor.to_string()
                            } else {
                                String::new()
                            },
                            server_time: Some(timestamp(s.store.now_ms())),
                        },
                    );
                    if tx.send(Ok(item(heartbeat))).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn list_incidents(
        &self,
        request: Request<credentials_pb::ListIncidentsRequest>,
    ) -> Result<Response<credentials_pb::ListIncidentsResponse>, Status> {
        let s = &self.state;
        s.authenticate(&request)?;
        let req = request.into_inner();
        name("credential_id", &req.credential_id, false)?;
        let state = credentials_pb::IncidentState::try_from(req.state)
            .map_err(|_| CredentialHealthError::invalid("state", "unknown incident state"))?;
        let limit = runplane_grpc::page_size(req.page_size, 50)
            .map_err(|reason| CredentialHealthError::invalid("page_size", reason))?;
        let filters = format!("{}|{}", req.credential_id, req.state);
        let after = match req.page_token.as_str() {
            "" => None,
            token => Some(decode_page_token(token, &filters)?),
        };
        let mut rows = s
            .store
            .incidents(
                (!req.credential_id.is_empty()).then_some(req.credential_id.as_str()),
                state,
                after,
                u64::from(limit) + 1,
            )
            .await?;
        let next_page_token = if rows.len() > limit as usize {
            rows.truncate(limit as usize);
            let last = rows.last().expect("a full page");
            format!(
                "{}:{}:{}",
                page_filter_tag(&filters),
                last.opened_at_ms,
                last.id
            )
        } else {
            String::new()
        };
        let now = s.store.now_ms();
        Ok(Response::new(credentials_pb::ListIncidentsResponse {
            incidents: rows.iter().map(|i| incident_view(i, now)).collect(),
            next_page_token,
        }))
    }
}

fn item(
    item: credentials_pb::watch_notices_response::Item,
) -> credentials_pb::WatchNoticesResponse {
    credentials_pb::WatchNoticesResponse { item: Some(item) }
}

/// A cursor is the decimal seq of the lead's last notice received; one past the last seq
/// issued to the lead was never issued by this service.
fn parse_cursor(cursor: &str, last_issued: i64) -> Result<i64, CredentialHealthError> {
    match cursor.parse::<i64>() {
        Ok(seq) if (1..=last_issued).contains(&seq) => Ok(seq),
        _ => Err(CredentialHealthError::CursorInvalid(
            "after_cursor was not issued by this service".into(),
        )),
    }
}

fn page_filter_tag(filters: &str) -> String {
    let digest = Sha256::digest(filters.as_bytes());
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_page_token(token: &str, filters: &str) -> Result<(i64, String), CredentialHealthError> {
    let invalid = || {
        CredentialHealthError::CursorInvalid("page_token was not issued for these filters".into())
    };
    let mut parts = token.splitn(3, ':');
    let (Some(tag), Some(at), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    if tag != page_filter_tag(filters) {
        return Err(invalid());
    }
    Ok((at.parse().map_err(|_| invalid())?, id.to_owned()))
}

/// Why nothing of `candidates` may take a run. One credential: exhaustion wins over a
/// cool-off. A profile: the reason of the credential that becomes usable first, so the
/// caller learns when to ask again.
fn refusal(
    profile: &str,
    candidates: &[(String, u32)],
    health: impl Fn(&str) -> (u32, u32),
) -> CredentialHealthError {
    let mut best: Option<(u32, &str, u32, u32)> = None;
    for (c, _) in candidates {
        let (cooling, quarantined) = health(c);
        let usable_in = if quarantined > 0 {
            quarantined
        } else {
            cooling
        };
        if best.is_none_or(|(at, ..)| usable_in < at) {
            best = Some((usable_in, c, cooling, quarantined));
        }
    }
    let (_, credential_id, cooling, quarantined) = best.expect("at least one candidate");
    let on = if profile.is_empty() {
        format!("credential {credential_id}")
    } else if candidates.len() == 1 {
        format!("profile {profile} (credential {credential_id})")
    } else {
        format!("profile {profile} (every credential; soonest {credential_id})")
    };
    let (reason, message) = if quarantined > 0 {
        (
            runplane_grpc::ErrorReason::Exhausted,
            format!("{on} is quarantined as exhausted (spent), {quarantined} s left"),
        )
    } else {
        (
            runplane_grpc::ErrorReason::CoolingOff,
            format!("{on} is cooling off after repeated backend errors, {cooling} s left"),
        )
    };
    CredentialHealthError::Refused {
        reason,
        message,
        credential_id: credential_id.to_owned(),
        cooling_off_for_seconds: cooling,
        quarantined_for_seconds: quarantined,
    }
}

fn notice_view(n: &crate::store::entities::notice::Model) -> credentials_pb::Notice {
    credentials_pb::Notice {
        id: n.id.clone(),
        cursor: n.seq.to_string(),
        org_id: n.org_id.clone(),
        lead_id: n.lead_id.clone(),
        kind: match n.kind.as_str() {
            "incident_opened" => credentials_pb::NoticeKind::IncidentOpened,
            _ => credentials_pb::NoticeKind::CredentialQuarantined,
        } as i32,
        credential_id: n.credential_id.clone(),
        incident_id: n.incident_id.clone(),
        affected_run_ids: serde_json::from_str(&n.affected_run_ids).unwrap_or_default(),
        message: n.message.clone(),
        cooling_off_for_seconds: n.cooling_off_for_seconds.max(0) as u32,
        quarantined_for_seconds: n.quarantined_for_seconds.max(0) as u32,
        created_at: Some(timestamp(n.created_at_ms)),
    }
}
