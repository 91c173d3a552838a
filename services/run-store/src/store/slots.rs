//! Admission: claiming slots for queued runs by fair share (`domain::share`).

use runplane_config::TenancyConfig;

use super::*;
use crate::domain::share::{self, Queue, Waiting};
use entities::org_share;

impl Store {
    /// Moves queued runs to STARTING while their credential has a free slot and their
    /// org is under its quota: the orgs waiting on a credential share its slots by
    /// weighted fair share, and an org's own runs start by priority, then age. Runs
    /// passed over say why (`waiting_reason`). `capacity` None: no capacity applies.
    ///
    /// The reads are grouped counts of the queue and of the active runs per credential
    /// and org, whatever the queue holds, then the next runs of the orgs that start.
    /// One transaction holds one lock for the counts, the passes and the claims, so a
    /// second replica's claim waits, then counts what the first one claimed and moves
    /// on from its passes.
    pub async fn claim_slots(
        &self,
        capacity: Option<&HashMap<String, SlotLimit>>,
        tenancy: &TenancyConfig,
        max_runs: u64,
    ) -> Result<Vec<run::Model>> {
        let txn = self.write_tx().await?;
        if self.postgres {
            txn.execute_raw(sea_orm::Statement::from_sql_and_values(
                sea_orm::DbBackend::Postgres,
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                ["runplane.slots".into()],
            ))
            .await?;
        }
        let waiting: Vec<(String, String, i64, i64)> = run::Entity::find()
            .select_only()
            .column(run::Column::CredentialId)
            .column(run::Column::OrgId)
            .column_as(run::Column::Id.count(), "n")
            .column_as(run::Column::CreatedAtUs.min(), "oldest")
            .filter(run::Column::State.eq(RunState::Queued))
            .group_by(run::Column::CredentialId)
            .group_by(run::Column::OrgId)
            .into_tuple()
            .all(&txn)
            .await?;
        if waiting.is_empty() {
            txn.commit().await?;
            return Ok(Vec::new());
        }
        let active: Vec<(String, String, i64)> = run::Entity::find()
            .select_only()
            .column(run::Column::CredentialId)
            .column(run::Column::OrgId)
            .column_as(run::Column::Id.count(), "n")
            .filter(run::Column::State.is_in(RunState::ACTIVE))
            .group_by(run::Column::CredentialId)
            .group_by(run::Column::OrgId)
            .into_tuple()
            .all(&txn)
            .await?;
        let mut credentials: Vec<String> = waiting.iter().map(|w| w.0.clone()).collect();
        credentials.sort_unstable();
        credentials.dedup();
        let mut queue = Queue {
            capacity,
            ..Default::default()
        };
        for share in org_share::Entity::find()
            .filter(org_share::Column::CredentialId.is_in(credentials))
            .all(&txn)
            .await?
        {
            match share.org_id.is_empty() {
                true => queue.virtual_times.insert(share.credential_id, share.pass),
                false => queue
                    .passes
                    .insert((share.credential_id, share.org_id), share.pass),
            };
        }
        queue.waiting = waiting
            .into_iter()
            .map(|(credential_id, org_id, n, oldest_us)| Waiting {
                credential_id,
                org_id,
                queued: u32::try_from(n).unwrap_or(u32::MAX),
                oldest_us,
            })
            .collect();
        queue.active = active
            .into_iter()
            .map(|(c, o, n)| ((c, o), u32::try_from(n).unwrap_or(u32::MAX)))
            .collect();
        let plan = share::plan(&queue, tenancy, u32::try_from(max_runs).unwrap_or(u32::MAX));

        let now = self.now_us();
        let mut claimed = Vec::new();
        for grant in &plan.grants {
            // Without their spec: the claim's answer is a list of many runs.
            let next = basic(run::Entity::find())
                .filter(run::Column::State.eq(RunState::Queued))
                .filter(run::Column::CredentialId.eq(grant.credential_id.as_str()))
                .filter(run::Column::OrgId.eq(grant.org_id.as_str()))
                .order_by(run::Column::Priority, Order::Desc)
                .order_by(run::Column::CreatedAtUs, Order::Asc)
                .order_by(run::Column::Id, Order::Asc)
                .limit(u64::from(grant.runs))
                .all(&txn)
                .await?;
            for mut run in next {
                // Compare-and-set: a cancel that took the run first keeps it.
                let done = run::Entity::update_many()
                    .col_expr(run::Column::State, Expr::value(RunState::Starting))
                    .col_expr(run::Column::WaitingReason, Expr::value(""))
                    .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
                    .filter(run::Column::Id.eq(run.id.as_str()))
                    .filter(run::Column::State.eq(RunState::Queued))
                    .exec(&txn)
                    .await?;
                if done.rows_affected == 1 {
                    run.state = RunState::Starting;
                    run.waiting_reason.clear();
                    run.updated_at_us = now;
                    claimed.push(run);
                }
            }
        }
        for ((credential_id, org_id), pass) in &plan.passes {
            org_share::Entity::insert(
                org_share::Model {
                    credential_id: credential_id.clone(),
                    org_id: org_id.clone(),
                    pass: *pass,
                }
                .into_active_model(),
            )
            .on_conflict(
                sea_orm::sea_query::OnConflict::columns([
                    org_share::Column::CredentialId,
                    org_share::Column::OrgId,
                ])
                .update_column(org_share::Column::Pass)
                .to_owned(),
            )
            .exec_without_returning(&txn)
            .await?;
        }
        // Why the rest waits, one statement per credential, per org out of a shared
        // credential and per org at quota; only the runs whose reason changes are written.
        let at_quota: Vec<&String> = plan.org_reasons.keys().collect();
        for (credential_id, why) in &plan.credential_reasons {
            run::Entity::update_many()
                .col_expr(run::Column::WaitingReason, Expr::value(why.as_str()))
                .filter(run::Column::State.eq(RunState::Queued))
                .filter(run::Column::CredentialId.eq(credential_id.as_str()))
                .filter(run::Column::OrgId.is_not_in(at_quota.iter().map(|o| o.as_str())))
                .filter(run::Column::WaitingReason.ne(why.as_str()))
                .exec(&txn)
                .await?;
        }
        for ((credential_id, org_id), why) in &plan.pair_reasons {
            run::Entity::update_many()
                .col_expr(run::Column::WaitingReason, Expr::value(why.as_str()))
                .filter(run::Column::State.eq(RunState::Queued))
                .filter(run::Column::CredentialId.eq(credential_id.as_str()))
                .filter(run::Column::OrgId.eq(org_id.as_str()))
                .filter(run::Column::WaitingReason.ne(why.as_str()))
                .exec(&txn)
                .await?;
        }
        for (org_id, why) in &plan.org_reasons {
            run::Entity::update_many()
                .col_expr(run::Column::WaitingReason, Expr::value(why.as_str()))
                .filter(run::Column::State.eq(RunState::Queued))
                .filter(run::Column::OrgId.eq(org_id.as_str()))
                .filter(run::Column::WaitingReason.ne(why.as_str()))
                .exec(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok(claimed)
    }
}
