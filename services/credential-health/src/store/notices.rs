//! Lead notices: written in a report's transaction under a per-lead sequence, read by
//! watchers after a cursor, their bodies pruned past retention.

use sea_orm::sea_query::{Expr, ExprTrait as _, OnConflict};
use sea_orm::{
    ColumnTrait, DatabaseTransaction, DbErr, EntityTrait, IntoActiveModel, Order, QueryFilter,
    QueryOrder, QuerySelect,
};

use super::entities::{counter, notice};
use super::{Result, Store, json};
use crate::domain::policy::{CredentialState, Evidence};

impl Store {
    /// Inserts a notice under the next `seq`. Taking the counter row's lock here makes
    /// notices commit in `seq` order.
    pub(super) async fn insert_notice(
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
        // A shared credential out for the reporting org only says so.
        let scope = match n.affected_orgs.as_slice() {
            [] => String::new(),
            orgs => format!(
                " for org {} only (a shared credential: no other org's runs reported it)",
                orgs.join(", ")
            ),
        };
        let (cooling, quarantined, message) = match n.kind {
            "incident_opened" => (
                cooling,
                0,
                format!(
                    "credential {} cooling off{scope} after repeated backend errors, {cooling} s; runs failed: {runs}",
                    n.credential_id
                ),
            ),
            _ => (
                0,
                quarantined,
                format!(
                    "credential {} quarantined{scope} as exhausted (spent), {quarantined} s; run failed: {runs}",
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
                affected_orgs: json(&n.affected_orgs),
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        Ok(())
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
    /// Deletes the notices whose bodies were pruned before `before_ms` (a watcher behind
    /// them is told of the hole in the lead's sequence), and delivered outbox rows older
    /// than that; returns how many rows went.
    pub async fn delete_pruned(&self, before_ms: i64, limit: u64) -> Result<u64> {
        let old: Vec<(String, String, i64)> = notice::Entity::find()
            .select_only()
            .column(notice::Column::OrgId)
            .column(notice::Column::LeadId)
            .column(notice::Column::Seq)
            .filter(notice::Column::Pruned.eq(true))
            .filter(notice::Column::CreatedAtMs.lt(before_ms))
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut deleted = 0;
        for (org_id, lead_id, seq) in old {
            deleted += notice::Entity::delete_many()
                .filter(notice::Column::OrgId.eq(org_id))
                .filter(notice::Column::LeadId.eq(lead_id))
                .filter(notice::Column::Seq.eq(seq))
                .exec(&self.db)
                .await?
                .rows_affected;
        }
        deleted += runplane_db::outbox::prune_delivered(
            &self.db,
            runplane_clock::ms_to_us(before_ms),
            limit,
        )
        .await?;
        Ok(deleted)
    }

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
pub(super) fn lead_key(org_id: &str, lead_id: &str) -> String {
    format!("{org_id}/{lead_id}")
}

/// A notice a report's transaction is about to write.
#[derive(Debug, Clone)]
pub(super) struct NewNotice {
    pub(super) org_id: String,
    pub(super) lead_id: String,
    pub(super) kind: &'static str,
    pub(super) credential_id: String,
    pub(super) incident_id: String,
    pub(super) runs: Vec<String>,
    /// The orgs the penalty is for; empty: every org.
    pub(super) affected_orgs: Vec<String>,
}

/// One notice per (org, lead) among the failures that opened an incident, naming that
/// lead's runs. Failures without a lead are counted but nobody is told of them.
pub(super) fn incident_notices(
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
                affected_orgs: Vec::new(),
            }),
        }
    }
    by_lead.retain(|n| !n.lead_id.is_empty());
    by_lead
}

impl NewNotice {
    pub(super) fn lead(&self) -> String {
        lead_key(&self.org_id, &self.lead_id)
    }
}
