//! Recording a classified turn failure: the one transaction that changes a credential's
//! policy state and writes what follows from it.

use prost::Message;
use runplane_proto::credentials::v1 as credentials_pb;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, DbErr, EntityTrait, IntoActiveModel, QueryFilter, SqlErr};

use super::entities::{incident, turn_failure};
use super::incidents::incident_view;
use super::notices::{NewNotice, incident_notices, notice_key};
use super::{Changes, Report, Result, Store};
use crate::domain::policy::ErrorEffect;
use crate::error::CredentialHealthError;
use crate::view;

/// How many times a report is retried after losing a compare-and-set to another replica
/// (or the same turn arriving twice at once) before the caller is told to retry.
const CAS_ATTEMPTS: usize = 16;

impl Store {
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
        // On a shared credential the org's own share of it moves, never the whole.
        let key = super::state_key(
            &report.credential_id,
            report.shared.then_some(report.org_id.as_str()),
        );
        let (row, mut state) = self.load(&txn, &key).await?;
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
                        affected_orgs: Vec::new(),
                    });
                }
            }
            _ => {}
        }
        if !self.compare_and_set(&txn, &row, &state).await? {
            txn.rollback().await?;
            return Ok(None);
        }
        // A penalty of one org on a shared credential is every org's once another org's
        // runs are penalised too; until then its notices say whose it is.
        if report.shared && !notices.is_empty() {
            let everyone = if changes.opened_incident || changes.quarantined {
                match self.corroborate(&txn, report, &key, &state, now).await? {
                    Some(everyone) => everyone,
                    None => {
                        txn.rollback().await?;
                        return Ok(None);
                    }
                }
            } else {
                // A failure absorbed by an open incident: whose it is, as stored.
                self.whole_penalised(&txn, &report.credential_id, &state, now)
                    .await?
            };
            if !everyone {
                for n in &mut notices {
                    n.affected_orgs = vec![report.org_id.clone()];
                }
            }
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
}

impl Store {
    /// On shared credential `report.credential_id`, whether another org's share of it is
    /// penalised the same way as `state` (the reporting org's, under `key`): then the
    /// penalty becomes the credential's, for every org, and this returns `Some(true)`.
    /// `None` when another writer changed the credential first.
    async fn corroborate(
        &self,
        txn: &sea_orm::DatabaseTransaction,
        report: &Report,
        key: &str,
        state: &crate::domain::policy::CredentialState,
        now: i64,
    ) -> Result<Option<bool>> {
        let exhausted = report.outcome == credentials_pb::TurnOutcome::BackendExhausted;
        let prefix = super::state_key(&report.credential_id, Some(""));
        let others = super::entities::credential::Entity::find()
            .filter(super::entities::credential::Column::CredentialId.starts_with(&prefix))
            .filter(super::entities::credential::Column::CredentialId.ne(key))
            .all(txn)
            .await?;
        let corroborated = others
            .iter()
            // LIKE's wildcards may match other credentials' rows: the prefix decides.
            .filter(|row| row.credential_id.starts_with(&prefix))
            .map(super::credentials::state_of)
            .any(|mut other| {
                other.settle(now);
                match exhausted {
                    true => other.quarantine_until_ms != 0,
                    false => other.cool_off_until_ms != 0,
                }
            });
        if !corroborated {
            return Ok(Some(false));
        }
        let (row, mut whole) = self.load(txn, &report.credential_id).await?;
        whole.settle(now);
        if exhausted {
            whole.quarantine_until_ms = whole.quarantine_until_ms.max(state.quarantine_until_ms);
        } else if whole.cool_off_until_ms == 0 {
            whole.cool_off_until_ms = state.cool_off_until_ms;
            whole.open_incident = state.open_incident.clone();
        }
        Ok(self
            .compare_and_set(txn, &row, &whole)
            .await?
            .then_some(true))
    }
}

impl Store {
    /// Whether the credential's own state carries `org_state`'s incident.
    async fn whole_penalised(
        &self,
        txn: &sea_orm::DatabaseTransaction,
        credential_id: &str,
        org_state: &crate::domain::policy::CredentialState,
        now: i64,
    ) -> Result<bool> {
        let whole = super::entities::credential::Entity::find_by_id(credential_id.to_owned())
            .one(txn)
            .await?;
        Ok(whole.is_some_and(|row| {
            let mut whole = super::credentials::state_of(&row);
            whole.settle(now);
            whole.open_incident.is_some() && whole.open_incident == org_state.open_incident
        }))
    }
}

pub fn outcome_name(o: credentials_pb::TurnOutcome) -> &'static str {
    match o {
        credentials_pb::TurnOutcome::BackendError => "backend_error",
        credentials_pb::TurnOutcome::BackendExhausted => "backend_exhausted",
        _ => "other",
    }
}
