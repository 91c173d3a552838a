//! Each credential's outage-policy state, read and written under compare-and-set.

use std::collections::HashMap;

use sea_orm::sea_query::{Expr, OnConflict};
use sea_orm::{ColumnTrait, DatabaseTransaction, DbErr, EntityTrait, IntoActiveModel, QueryFilter};

use super::entities::{credential, incident};
use super::{Result, Store};
use crate::domain::policy::CredentialState;

impl Store {
    /// The credential's row (created when first seen) and its policy state.
    pub(super) async fn load(
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
    pub(super) async fn compare_and_set(
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
}

impl Store {
    /// Each org's own penalty on each of `credential_ids` (shared credentials' shares,
    /// `state_key`), as of now, only where one is in force: credential → [(org, state)].
    pub async fn org_penalties(
        &self,
        credential_ids: &[String],
    ) -> Result<HashMap<String, Vec<(String, CredentialState)>>> {
        let now = self.now_ms();
        let mut out: HashMap<String, Vec<(String, CredentialState)>> = HashMap::new();
        let rows = credential::Entity::find()
            .filter(credential::Column::CredentialId.contains("@"))
            .filter(
                sea_orm::Condition::any()
                    .add(credential::Column::CoolOffUntilMs.gt(now))
                    .add(credential::Column::QuarantineUntilMs.gt(now)),
            )
            .all(&self.db)
            .await?;
        for row in rows {
            let Some((credential, org)) = row.credential_id.split_once('@') else {
                continue;
            };
            if !credential_ids.iter().any(|c| c == credential) {
                continue;
            }
            let mut state = state_of(&row);
            state.settle(now);
            out.entry(credential.to_owned())
                .or_default()
                .push((org.to_owned(), state));
        }
        for shares in out.values_mut() {
            shares.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Ok(out)
    }
}

/// The policy state a credential row holds.
pub(super) fn state_of(row: &credential::Model) -> CredentialState {
    CredentialState {
        evidence: serde_json::from_str(&row.evidence).unwrap_or_default(),
        cool_off_until_ms: row.cool_off_until_ms,
        open_incident: row.open_incident_id.clone(),
        quarantine_until_ms: row.quarantine_until_ms,
        last_seen_ms: row.last_seen_ms,
    }
}
