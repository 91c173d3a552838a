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
}

pub fn outcome_name(o: credentials_pb::TurnOutcome) -> &'static str {
    match o {
        credentials_pb::TurnOutcome::BackendError => "backend_error",
        credentials_pb::TurnOutcome::BackendExhausted => "backend_exhausted",
        _ => "other",
    }
}
