//! Admission: counting active runs and claiming slots per credential.

use super::*;

impl Store {
    /// Moves queued runs to STARTING, oldest first, while their credential has a free
    /// slot: `capacity` (None: no limit) minus its runs in STARTING or RUNNING. Runs passed
    /// over get a `waiting_reason`. One transaction holds a lock per credential for the
    /// count and the claims, taken in id order so two claimers never deadlock: a second
    /// replica's claim waits, then counts what the first one claimed.
    pub async fn claim_slots(
        &self,
        capacity: Option<&HashMap<String, SlotLimit>>,
        max_runs: u64,
    ) -> Result<Vec<run::Model>> {
        let txn = self.write_tx().await?;
        // Oldest first; a bounded window of the queue per call.
        let queued = run::Entity::find()
            .filter(run::Column::State.eq(RunState::Queued))
            .order_by(run::Column::CreatedAtUs, Order::Asc)
            .order_by(run::Column::Id, Order::Asc)
            .limit(max_runs.saturating_mul(4).max(100))
            .all(&txn)
            .await?;
        let mut credentials: Vec<&str> = queued.iter().map(|r| r.credential_id.as_str()).collect();
        credentials.sort_unstable();
        credentials.dedup();
        let mut free: HashMap<String, i64> = HashMap::new();
        if let Some(capacity) = capacity {
            if self.postgres {
                for credential in &credentials {
                    txn.execute_raw(sea_orm::Statement::from_sql_and_values(
                        sea_orm::DbBackend::Postgres,
                        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                        [format!("runplane.slots:{credential}").into()],
                    ))
                    .await?;
                }
            }
            let active: Vec<(String, i64)> = run::Entity::find()
                .select_only()
                .column(run::Column::CredentialId)
                .column_as(run::Column::Id.count(), "n")
                .filter(run::Column::State.is_in(RunState::ACTIVE))
                .filter(run::Column::CredentialId.is_in(credentials.iter().map(|c| c.to_string())))
                .group_by(run::Column::CredentialId)
                .into_tuple()
                .all(&txn)
                .await?;
            let active: HashMap<String, i64> = active.into_iter().collect();
            for credential in &credentials {
                let limit = capacity.get(*credential);
                let slots = match limit {
                    Some(l) if l.unavailable.is_empty() => i64::from(l.capacity),
                    _ => 0,
                };
                free.insert(
                    credential.to_string(),
                    slots - active.get(*credential).copied().unwrap_or(0),
                );
            }
        }
        let now = self.now_us();
        let mut claimed = Vec::new();
        for run in queued {
            let why = match capacity {
                _ if claimed.len() as u64 >= max_runs => None,
                None => Some(String::new()),
                Some(capacity) => {
                    let left = free.get_mut(&run.credential_id).expect("counted above");
                    if *left > 0 {
                        *left -= 1;
                        Some(String::new())
                    } else {
                        Some(waiting_reason(
                            &run.credential_id,
                            capacity.get(&run.credential_id),
                            *left,
                        ))
                    }
                }
            };
            let Some(why) = why else { break };
            if why.is_empty() {
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
                    let mut run = run;
                    run.state = RunState::Starting;
                    run.waiting_reason.clear();
                    run.updated_at_us = now;
                    claimed.push(run);
                }
            } else if run.waiting_reason != why {
                run::Entity::update_many()
                    .col_expr(run::Column::WaitingReason, Expr::value(why))
                    .filter(run::Column::Id.eq(run.id.as_str()))
                    .filter(run::Column::State.eq(RunState::Queued))
                    .exec(&txn)
                    .await?;
            }
        }
        txn.commit().await?;
        Ok(claimed)
    }
}
