//! Outage incidents: opened or counted by a report, listed newest first.

use runplane_proto::credentials::v1 as credentials_pb;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, DatabaseTransaction, EntityTrait, IntoActiveModel, Order, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::entities::incident;
use super::notices::{NewNotice, lead_key};
use super::{Report, Result, Store, json};
use crate::domain::policy::CredentialState;
use crate::view::timestamp;

impl Store {
    /// Creates the incident this report opened, or counts the report against the open
    /// one; a lead not yet told about it is added to `notices`.
    pub(super) async fn record_incident(
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
                        affected_orgs: Vec::new(),
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
