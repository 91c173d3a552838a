//! Credential health's persistence: Postgres (or SQLite for `runplane dev`).
//!
//! - `credentials`: each credential's outage-policy state, changed only by
//!   compare-and-set on `version`, so replicas sharing the database agree;
//! - `incidents`: every outage incident, open or closed;
//! - `turn_failures`: each reported turn, classified once, with the answer a replay gets;
//! - `notices` and `counters`: lead notices in commit order, per (org, lead) (see
//!   `entities::notice`);
//! - `outbox`: the MarkBackendError calls owed to the run store.

pub mod entities;
mod migration;

use std::collections::HashMap;

use prost::Message;
use runplane_clock::SharedClock;
use runplane_proto::credentials::v1 as credentials_pb;
use sea_orm::sea_query::{Expr, ExprTrait as _, OnConflict};
use sea_orm::{
    ColumnTrait, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait, IntoActiveModel,
    Order, QueryFilter, QueryOrder, QuerySelect, SqlErr,
};

pub use migration::Migrator;

use crate::domain::policy::{CredentialState, ErrorEffect, Evidence, PolicyConfig};
use crate::error::CredentialHealthError;
use crate::view::{self, timestamp};
use entities::{counter, credential, incident, notice, turn_failure};

type Result<T> = std::result::Result<T, CredentialHealthError>;

/// How many times a report is retried after losing a compare-and-set to another replica
/// (or the same turn arriving twice at once) before the caller is told to retry.
const CAS_ATTEMPTS: usize = 16;

/// A classified turn failure to record.
#[derive(Debug, Clone)]
pub struct Report {
    pub turn_id: String,
    pub run_id: String,
    /// The run's org; its lead is told as a lead of this org.
    pub org_id: String,
    pub lead_id: String,
    pub credential_id: String,
    pub request_digest: String,
    pub outcome: credentials_pb::TurnOutcome,
    pub reason: String,
    /// Capacity of the credential (sum over its profiles), for the answer's health.
    pub capacity: u32,
    pub profiles: Vec<String>,
}

/// What a report changed, beyond its answer.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// Notices created (their leads' watchers should wake).
    pub notices: usize,
    /// The [`notice_key`] of each lead that got one.
    pub notified_leads: Vec<String>,
    /// An outbox row for the run store was written.
    pub outbox: bool,
    /// This report opened an incident (a cool-off started).
    pub opened_incident: bool,
    /// This report quarantined the credential (it was not before).
    pub quarantined: bool,
}

#[derive(Debug, Clone)]
pub struct Store {
    db: DatabaseConnection,
    clock: SharedClock,
    policy: PolicyConfig,
}

impl Store {
    pub fn new(db: DatabaseConnection, clock: SharedClock, policy: PolicyConfig) -> Self {
        Self { db, clock, policy }
    }

    pub fn db(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn policy(&self) -> &PolicyConfig {
        &self.policy
    }

    /// Wall-clock milliseconds from the injected clock (see `policy` for why wall time).
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Wall-clock microseconds, for the outbox table every service shares.
    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// Records a classified turn failure: the policy update, an incident or quarantine
    /// it causes, notices for the leads, the run store's MarkBackendError (outbox) and
    /// the answer, in one transaction. A replay of `turn_id` returns the first answer.
    pub async fn report(
        &self,
        report: &Report,
    ) -> Result<(credentials_pb::ReportTurnFailureResponse, Changes)> {
        for _ in 0..CAS_ATTEMPTS {
            match self.try_report(report).await {
                Err(CredentialHealthError::Storage(e))
                    if matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) =>
                {
                    continue;
                }
                Ok(None) => continue,
                Ok(Some(done)) => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Err(CredentialHealthError::Storage(DbErr::Custom(
            "credential state kept changing under this report; retry".into(),
        )))
    }

    /// One attempt; `None` when another writer changed the credential first.
    async fn try_report(
        &self,
        report: &Report,
    ) -> Result<Option<(credentials_pb::ReportTurnFailureResponse, Changes)>> {
        let txn = runplane_db::write_tx(&self.db).await?;
        if let Some(done) = turn_failure::Entity::find_by_id(report.turn_id.clone())
            .one(&txn)
            .await?
        {
            if done.request_digest != report.request_digest {
                return Err(CredentialHealthError::TurnReused(report.turn_id.clone()));
            }
            let answer = credentials_pb::ReportTurnFailureResponse::decode(done.answer.as_slice())
                .map_err(|e| DbErr::Custom(format!("stored answer: {e}")))?;
            return Ok(Some((answer, Changes::default())));
        }
        let (row, mut state) = self.load(&txn, &report.credential_id).await?;
        let now = self.now_ms();
        let mut changes = Changes::default();

        let expired = state.settle(now);
        let mut incident_id = None;
        let mut notices: Vec<NewNotice> = Vec::new();
        match report.outcome {
            credentials_pb::TurnOutcome::BackendError => {
                let effect = state.backend_error(
                    &self.policy,
                    &report.run_id,
                    &report.org_id,
                    &report.lead_id,
                    now,
                    || uuid::Uuid::now_v7().to_string(),
                );
                match effect {
                    ErrorEffect::Counted => {}
                    ErrorEffect::Opened {
                        incident_id: id,
                        opening,
                    } => {
                        notices = incident_notices(&report.credential_id, &id, &opening);
                        incident_id = Some(id);
                        changes.opened_incident = true;
                    }
                    ErrorEffect::Absorbed { incident_id: id } => incident_id = Some(id),
                }
            }
            credentials_pb::TurnOutcome::BackendExhausted => {
                let fresh = state.exhausted(&self.policy, now);
                changes.quarantined = fresh;
                if fresh && !report.lead_id.is_empty() {
                    notices.push(NewNotice {
                        org_id: report.org_id.clone(),
                        lead_id: report.lead_id.clone(),
                        kind: "credential_quarantined",
                        credential_id: report.credential_id.clone(),
                        incident_id: String::new(),
                        runs: vec![report.run_id.clone()],
                    });
                }
            }
            _ => {}
        }
        if !self.compare_and_set(&txn, &row, &state).await? {
            txn.rollback().await?;
            return Ok(None);
        }
        if let Some(closed) = &expired.closed_incident {
            incident::Entity::update_many()
                .col_expr(incident::Column::State, Expr::value("closed"))
                .filter(incident::Column::Id.eq(closed.as_str()))
                .exec(&txn)
                .await?;
        }
        let incident = match &incident_id {
            Some(id) if state.cool_off_until_ms != 0 => Some(
                self.record_incident(&txn, id, report, &state, &mut notices, now)
                    .await?,
            ),
            _ => None,
        };
        changes.notices = notices.len();
        changes.notified_leads = notices
            .iter()
            .map(|n| notice_key(&n.org_id, &n.lead_id))
            .collect();

        if report.outcome != credentials_pb::TurnOutcome::Other
            && report.outcome != credentials_pb::TurnOutcome::Unspecified
        {
            changes.outbox = self
                .owe_mark_backend_error(&txn, report, incident_id.as_deref(), now)
                .await?;
        }
        let incident = incident.as_ref().map(|i| incident_view(i, now));
        let answer = credentials_pb::ReportTurnFailureResponse {
            outcome: report.outcome as i32,
            reason: report.reason.clone(),
            incident: incident.clone(),
            credential: Some(view::credential(
                &report.credential_id,
                report.profiles.clone(),
                report.capacity,
                None,
                &state,
                incident,
                now,
            )),
        };
        turn_failure::Entity::insert(
            turn_failure::Model {
                turn_id: report.turn_id.clone(),
                run_id: report.run_id.clone(),
                credential_id: report.credential_id.clone(),
                request_digest: report.request_digest.clone(),
                outcome: outcome_name(report.outcome).to_owned(),
                incident_id,
                answer: answer.encode_to_vec(),
                created_at_ms: now,
            }
            .into_active_model(),
        )
        .exec_without_returning(&txn)
        .await?;
        // Last: a notice takes the seq counter's row lock, which every notice-writing
        // transaction queues on until commit; holding it only for the commit keeps a
        // storm of incidents from serialising on the rest of the work.
        for n in &notices {
            self.insert_notice(&txn, n, &state, now).await?;
        }
        txn.commit().await?;
        Ok(Some((answer, changes)))
    }

    /// The credential's row (created when first seen) and its policy state.
    async fn load(
        &self,
        txn: &DatabaseTransaction,
        credential_id: &str,
    ) -> Result<(credential::Model, CredentialState)> {
        credential::Entity::insert(
            credential::Model {
                credential_id: credential_id.to_owned(),
                version: 0,
                evidence: "[]".into(),
                cool_off_until_ms: 0,
                open_incident_id: None,
                quarantine_until_ms: 0,
                last_seen_ms: 0,
            }
            .into_active_model(),
        )
        .on_conflict(
            OnConflict::column(credential::Column::CredentialId)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(txn)
        .await?;
        let row = credential::Entity::find_by_id(credential_id.to_owned())
            .one(txn)
            .await?
            .ok_or_else(|| DbErr::RecordNotFound(credential_id.to_owned()))?;
        let state = state_of(&row);
        Ok((row, state))
    }

    /// Writes `state` over `row` if nobody changed it since it was read.
    async fn compare_and_set(
        &self,
        txn: &DatabaseTransaction,
        row: &credential::Model,
        state: &CredentialState,
    ) -> Result<bool> {
        let done = credential::Entity::update_many()
            .col_expr(credential::Column::Version, Expr::value(row.version + 1))
            .col_expr(
                credential::Column::Evidence,
                Expr::value(serde_json::to_string(&state.evidence).expect("serialisable")),
            )
            .col_expr(
                credential::Column::CoolOffUntilMs,
                Expr::value(state.cool_off_until_ms),
            )
            .col_expr(
                credential::Column::OpenIncidentId,
                Expr::value(state.open_incident.clone()),
            )
            .col_expr(
                credential::Column::QuarantineUntilMs,
                Expr::value(state.quarantine_until_ms),
            )
            .col_expr(
                credential::Column::LastSeenMs,
                Expr::value(state.last_seen_ms),
            )
            .filter(credential::Column::CredentialId.eq(row.credential_id.as_str()))
            .filter(credential::Column::Version.eq(row.version))
            .exec(txn)
            .await?;
        Ok(done.rows_affected == 1)
    }

    /// Creates the incident this report opened, or counts the report against the open
    /// one; a lead not yet told about it is added to `notices`.
    async fn record_incident(
        &self,
        txn: &DatabaseTransaction,
        id: &str,
        report: &Report,
        state: &CredentialState,
        notices: &mut Vec<NewNotice>,
        now: i64,
    ) -> Result<incident::Model> {
        let leads_of = |notices: &[NewNotice]| -> Vec<String> {
            notices.iter().map(NewNotice::lead).collect()
        };
        match incident::Entity::find_by_id(id.to_owned()).one(txn).await? {
            None => {
                let opening: Vec<String> = notices.iter().flat_map(|n| n.runs.clone()).collect();
                let model = incident::Model {
                    id: id.to_owned(),
                    credential_id: report.credential_id.clone(),
                    state: "open".into(),
                    opening_run_ids: json(&opening),
                    failures_during_cool_off: 0,
                    notified_lead_ids: json(&leads_of(notices)),
                    opened_at_ms: now,
                    cool_off_ends_at_ms: state.cool_off_until_ms,
                };
                incident::Entity::insert(model.clone().into_active_model())
                    .exec_without_returning(txn)
                    .await?;
                Ok(model)
            }
            Some(mut model) => {
                // Absorbed during the cool-off: counted, and its lead told once if it was
                // not among those the incident already reached.
                model.failures_during_cool_off += 1;
                let mut leads: Vec<String> =
                    serde_json::from_str(&model.notified_lead_ids).unwrap_or_default();
                let lead = lead_key(&report.org_id, &report.lead_id);
                if !report.lead_id.is_empty() && !leads.contains(&lead) {
                    leads.push(lead);
                    notices.push(NewNotice {
                        org_id: report.org_id.clone(),
                        lead_id: report.lead_id.clone(),
                        kind: "incident_opened",
                        credential_id: report.credential_id.clone(),
                        incident_id: id.to_owned(),
                        runs: vec![report.run_id.clone()],
                    });
                }
                model.notified_lead_ids = json(&leads);
                incident::Entity::update_many()
                    .col_expr(
                        incident::Column::FailuresDuringCoolOff,
                        Expr::value(model.failures_during_cool_off),
                    )
                    .col_expr(
                        incident::Column::NotifiedLeadIds,
                        Expr::value(model.notified_lead_ids.clone()),
                    )
                    .filter(incident::Column::Id.eq(id))
                    .exec(txn)
                    .await?;
                Ok(model)
            }
        }
    }

    /// Inserts a notice under the next `seq`. Taking the counter row's lock here makes
    /// notices commit in `seq` order.
    async fn insert_notice(
        &self,
        txn: &DatabaseTransaction,
        n: &NewNotice,
        state: &CredentialState,
        now: i64,
    ) -> Result<()> {
        // The lead's own sequence: notices to different leads never wait on each other.
        let name = notice_counter(&n.org_id, &n.lead_id);
        counter::Entity::insert(
            counter::Model {
                name: name.clone(),
                value: 0,
            }
            .into_active_model(),
        )
        .on_conflict(
            OnConflict::column(counter::Column::Name)
                .do_nothing()
                .to_owned(),
        )
        .exec_without_returning(txn)
        .await?;
        counter::Entity::update_many()
            .col_expr(
                counter::Column::Value,
                Expr::col(counter::Column::Value).add(Expr::value(1i64)),
            )
            .filter(counter::Column::Name.eq(name.as_str()))
            .exec(txn)
            .await?;
        let seq = counter::Entity::find_by_id(name.clone())
            .one(txn)
            .await?
            .map(|c| c.value)
            .ok_or_else(|| DbErr::RecordNotFound(format!("counters.{name}")))?;
        let cooling = state.cooling_off_for_seconds(now);
        let quarantined = state.quarantined_for_seconds(now);
        let runs = n.runs.join(", ");
        let (cooling, quarantined, message) = match n.kind {
            "incident_opened" => (
                cooling,
                0,
                format!(
                    "credential {} cooling off after repeated backend errors, {cooling} s; runs failed: {runs}",
                    n.credential_id
                ),
            ),
            _ => (
                0,
                quarantined,
                format!(
                    "credential {} quarantined as exhausted (spent), {quarantined} s; run failed: {runs}",
                    n.credential_id
                ),
            ),
        };
        notice::Entity::insert(
            notice::Model {
                seq,
                id: uuid::Uuid::now_v7().to_string(),
                org_id: n.org_id.clone(),
                lead_id: n.lead_id.clone(),
                kind: n.kind.to_owned(),
                credential_id: n.credential_id.clone(),
                incident_id: n.incident_id.clone(),
                affected_run_ids: json(&n.runs),
                message,
                cooling_off_for_seconds: cooling as i32,
                quarantined_for_seconds: quarantined as i32,
                created_at_ms: now,
                pruned: false,
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        Ok(())
    }

    /// Owes the run store the durable outcome of this run (keyed by the turn).
    async fn owe_mark_backend_error(
        &self,
        txn: &DatabaseTransaction,
        report: &Report,
        incident_id: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        use runplane_proto::runstore::v1 as runstore_pb;
        let request = runstore_pb::MarkBackendErrorRequest {
            run_id: report.run_id.clone(),
            idempotency_key: report.turn_id.clone(),
            kind: if report.outcome == credentials_pb::TurnOutcome::BackendExhausted {
                runstore_pb::BackendErrorKind::Exhausted
            } else {
                runstore_pb::BackendErrorKind::Error
            } as i32,
            reason: report.reason.clone(),
            credential_id: report.credential_id.clone(),
            incident_id: incident_id.unwrap_or_default().to_owned(),
            turn_id: report.turn_id.clone(),
        };
        let mut row = runplane_db::outbox::row(
            OUTBOX_MARK_BACKEND_ERROR,
            report.turn_id.clone(),
            request.encode_to_vec(),
            now * 1000,
        );
        row.traceparent = runplane_grpc::trace_context::current_traceparent().unwrap_or_default();
        Ok(runplane_db::outbox::enqueue(txn, row).await?)
    }

    /// The policy state of each of `ids` as of now (expired cool-offs and quarantines
    /// settled in the copy, not written), with its open incident.
    pub async fn states(
        &self,
        ids: &[String],
    ) -> Result<HashMap<String, (CredentialState, Option<incident::Model>)>> {
        let now = self.now_ms();
        let rows = credential::Entity::find()
            .filter(credential::Column::CredentialId.is_in(ids.iter().cloned()))
            .all(&self.db)
            .await?;
        let open_ids: Vec<String> = rows
            .iter()
            .filter(|r| r.cool_off_until_ms > now)
            .filter_map(|r| r.open_incident_id.clone())
            .collect();
        let mut incidents: HashMap<String, incident::Model> = if open_ids.is_empty() {
            HashMap::new()
        } else {
            incident::Entity::find()
                .filter(incident::Column::Id.is_in(open_ids))
                .all(&self.db)
                .await?
                .into_iter()
                .map(|i| (i.id.clone(), i))
                .collect()
        };
        let mut out = HashMap::new();
        for row in rows {
            let mut state = state_of(&row);
            state.settle(now);
            let open = state
                .open_incident
                .as_ref()
                .and_then(|id| incidents.remove(id));
            out.insert(row.credential_id.clone(), (state, open));
        }
        Ok(out)
    }

    /// A page of incidents, newest first, after `(opened_at_ms, id)`.
    pub async fn incidents(
        &self,
        credential_id: Option<&str>,
        state: credentials_pb::IncidentState,
        after: Option<(i64, String)>,
        limit: u64,
    ) -> Result<Vec<incident::Model>> {
        let now = self.now_ms();
        let mut query = incident::Entity::find();
        if let Some(c) = credential_id {
            query = query.filter(incident::Column::CredentialId.eq(c));
        }
        match state {
            credentials_pb::IncidentState::Open => {
                query = query
                    .filter(incident::Column::State.eq("open"))
                    .filter(incident::Column::CoolOffEndsAtMs.gt(now));
            }
            credentials_pb::IncidentState::Closed => {
                query = query.filter(
                    sea_orm::Condition::any()
                        .add(incident::Column::State.eq("closed"))
                        .add(incident::Column::CoolOffEndsAtMs.lte(now)),
                );
            }
            credentials_pb::IncidentState::Unspecified => {}
        }
        if let Some((at, id)) = after {
            query = query.filter(
                sea_orm::Condition::any()
                    .add(incident::Column::OpenedAtMs.lt(at))
                    .add(
                        sea_orm::Condition::all()
                            .add(incident::Column::OpenedAtMs.eq(at))
                            .add(incident::Column::Id.lt(id)),
                    ),
            );
        }
        Ok(query
            .order_by(incident::Column::OpenedAtMs, Order::Desc)
            .order_by(incident::Column::Id, Order::Desc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// The notices of `lead_id` of `org_id` after `seq`, oldest first (pruned ones
    /// included, bodiless).
    pub async fn notices_after(
        &self,
        org_id: &str,
        lead_id: &str,
        after_seq: i64,
        limit: u64,
    ) -> Result<Vec<notice::Model>> {
        Ok(notice::Entity::find()
            .filter(notice::Column::OrgId.eq(org_id))
            .filter(notice::Column::LeadId.eq(lead_id))
            .filter(notice::Column::Seq.gt(after_seq))
            .order_by(notice::Column::Seq, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    /// The last notice seq issued to `lead_id` of `org_id`.
    pub async fn last_notice_seq(&self, org_id: &str, lead_id: &str) -> Result<i64> {
        Ok(counter::Entity::find_by_id(notice_counter(org_id, lead_id))
            .one(&self.db)
            .await?
            .map_or(0, |c| c.value))
    }

    /// The last notice sequence of each lead named by its [`notice_key`] (leads with no
    /// notice yet are left out): what the notice watchers' re-check compares with.
    pub async fn notice_seqs(&self, keys: Vec<String>) -> Result<Vec<(String, i64)>> {
        Ok(counter::Entity::find()
            .filter(counter::Column::Name.is_in(keys))
            .all(&self.db)
            .await?
            .into_iter()
            .map(|c| (c.name, c.value))
            .collect())
    }

    /// Removes the bodies of notices created before `before_ms`, keeping the rows so a
    /// watcher behind them learns how many it missed.
    pub async fn prune_notices(&self, before_ms: i64) -> Result<u64> {
        let done = notice::Entity::update_many()
            .col_expr(notice::Column::Pruned, Expr::value(true))
            .col_expr(notice::Column::Message, Expr::value(""))
            .col_expr(notice::Column::AffectedRunIds, Expr::value("[]"))
            .filter(notice::Column::CreatedAtMs.lt(before_ms))
            .filter(notice::Column::Pruned.eq(false))
            .exec(&self.db)
            .await?;
        Ok(done.rows_affected)
    }
}

/// The counter row of the notice sequence of `lead_id` of `org_id`. `/` is in no name,
/// so two (org, lead) pairs never share a row.
fn notice_counter(org_id: &str, lead_id: &str) -> String {
    format!("notice_seq:{org_id}/{lead_id}")
}

/// What a lead's notice watchers wait on: its notice counter's name, so the re-check
/// reads the counters by the keys it is given.
pub fn notice_key(org_id: &str, lead_id: &str) -> String {
    notice_counter(org_id, lead_id)
}

/// A lead as an incident's `notified_lead_ids` names it: a lead id is unique only
/// within its org.
fn lead_key(org_id: &str, lead_id: &str) -> String {
    format!("{org_id}/{lead_id}")
}

/// `credential_health → run_store.mark_backend_error`.
pub const OUTBOX_MARK_BACKEND_ERROR: &str = "run_store.mark_backend_error";

#[derive(Debug, Clone)]
struct NewNotice {
    org_id: String,
    lead_id: String,
    kind: &'static str,
    credential_id: String,
    incident_id: String,
    runs: Vec<String>,
}

/// One notice per (org, lead) among the failures that opened an incident, naming that
/// lead's runs. Failures without a lead are counted but nobody is told of them.
fn incident_notices(
    credential_id: &str,
    incident_id: &str,
    opening: &[Evidence],
) -> Vec<NewNotice> {
    let mut by_lead: Vec<NewNotice> = Vec::new();
    for e in opening {
        match by_lead
            .iter_mut()
            .find(|n| n.org_id == e.org_id && n.lead_id == e.lead_id)
        {
            Some(n) => n.runs.push(e.run_id.clone()),
            None => by_lead.push(NewNotice {
                org_id: e.org_id.clone(),
                lead_id: e.lead_id.clone(),
                kind: "incident_opened",
                credential_id: credential_id.to_owned(),
                incident_id: incident_id.to_owned(),
                runs: vec![e.run_id.clone()],
            }),
        }
    }
    by_lead.retain(|n| !n.lead_id.is_empty());
    by_lead
}

impl NewNotice {
    fn lead(&self) -> String {
        lead_key(&self.org_id, &self.lead_id)
    }
}

fn state_of(row: &credential::Model) -> CredentialState {
    CredentialState {
        evidence: serde_json::from_str(&row.evidence).unwrap_or_default(),
        cool_off_until_ms: row.cool_off_until_ms,
        open_incident: row.open_incident_id.clone(),
        quarantine_until_ms: row.quarantine_until_ms,
        last_seen_ms: row.last_seen_ms,
    }
}

fn json(v: &[String]) -> String {
    serde_json::to_string(v).expect("serialisable")
}

pub fn outcome_name(o: credentials_pb::TurnOutcome) -> &'static str {
    match o {
        credentials_pb::TurnOutcome::BackendError => "backend_error",
        credentials_pb::TurnOutcome::BackendExhausted => "backend_exhausted",
        _ => "other",
    }
}

/// An incident as the API shows it; an open row whose cool-off passed reads closed.
pub fn incident_view(i: &incident::Model, now_ms: i64) -> credentials_pb::Incident {
    let open = i.state == "open" && i.cool_off_ends_at_ms > now_ms;
    credentials_pb::Incident {
        id: i.id.clone(),
        credential_id: i.credential_id.clone(),
        state: if open {
            credentials_pb::IncidentState::Open
        } else {
            credentials_pb::IncidentState::Closed
        } as i32,
        opening_run_ids: serde_json::from_str(&i.opening_run_ids).unwrap_or_default(),
        failures_during_cool_off: u32::try_from(i.failures_during_cool_off).unwrap_or(0),
        notified_lead_ids: serde_json::from_str(&i.notified_lead_ids).unwrap_or_default(),
        opened_at: Some(timestamp(i.opened_at_ms)),
        cool_off_ends_at: Some(timestamp(i.cool_off_ends_at_ms)),
    }
}
