//! Retention: what an ended run leaves behind is deleted once its time is up.
//!
//! Events go first, in chunks by sequence (each chunk one short transaction that also
//! moves `events_pruned_through`, so a watcher learns what is gone), either at
//! `event_retention_seconds` or with the run. A run whose events are gone and whose
//! retention passed is deleted with its batch keys, steering messages, keys and keyed
//! answers in one transaction; its receipt stays, as the audit record. Only ended runs
//! are touched, so no append ever waits on a sweep, and every statement is bounded.
//! Replicas may sweep at once: each delete is idempotent and the mark only moves
//! forward.

use std::collections::BTreeMap;

use super::*;

/// Most events one transaction deletes.
const EVENTS_PER_CHUNK: i64 = 2000;
/// Most events one pass deletes, whatever the runs hold.
const EVENTS_PER_PASS: u64 = 20_000;
/// Most runs one pass deletes (and most whose events it starts on).
const RUNS_PER_PASS: u64 = 200;
/// Most delivered outbox rows one pass deletes.
const OUTBOX_PER_PASS: u64 = 1000;

/// How long ended runs and their events are kept, in microseconds from their end.
#[derive(Debug, Clone, PartialEq)]
pub struct Retention {
    pub runs_us: i64,
    /// Profiles whose runs are kept for their own time.
    pub runs_by_profile: BTreeMap<String, i64>,
    /// Events of ended runs; `None`: as long as their run.
    pub events_us: Option<i64>,
}

/// What one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub events: u64,
    pub runs: u64,
    pub outbox: u64,
}

impl Store {
    /// One retention pass: the events that are due (up to [`EVENTS_PER_PASS`]), then the
    /// runs that are due (up to [`RUNS_PER_PASS`]), then delivered outbox rows older
    /// than the shortest run retention.
    pub async fn sweep_retention(&self, retention: &Retention) -> Result<Swept> {
        let now = self.now_us();
        let mut swept = Swept::default();
        let mut budget = EVENTS_PER_PASS;
        if let Some(events_us) = retention.events_us {
            let due: Vec<(String, i64, i64)> = run::Entity::find()
                .select_only()
                .column(run::Column::Id)
                .column(run::Column::LastSequence)
                .column(run::Column::EventsPrunedThrough)
                .filter(run::Column::EndedAtUs.lt(now.saturating_sub(events_us)))
                .filter(sea_orm::sea_query::ExprTrait::lt(
                    Expr::col(run::Column::EventsPrunedThrough),
                    Expr::col(run::Column::LastSequence),
                ))
                .order_by(run::Column::EndedAtUs, Order::Asc)
                .limit(RUNS_PER_PASS)
                .into_tuple()
                .all(&self.db)
                .await?;
            for (run_id, last, pruned) in due {
                if budget == 0 {
                    return Ok(swept);
                }
                let deleted = self
                    .prune_events(&run_id, pruned, last, &mut budget)
                    .await?;
                swept.events += deleted;
            }
        }
        for run_id in self.runs_due(retention, now).await? {
            let run = match run::Entity::find_by_id(run_id.clone())
                .one(&self.db)
                .await?
            {
                Some(run) => run,
                None => continue,
            };
            swept.events += self
                .prune_events(
                    &run_id,
                    run.events_pruned_through,
                    run.last_sequence,
                    &mut budget,
                )
                .await?;
            if budget == 0 {
                break;
            }
            swept.runs += self.delete_run(&run_id).await?;
        }
        let oldest_kept = retention
            .runs_by_profile
            .values()
            .fold(retention.runs_us, |a, b| a.min(*b));
        swept.outbox = runplane_db::outbox::prune_delivered(
            &self.db,
            now.saturating_sub(oldest_kept),
            OUTBOX_PER_PASS,
        )
        .await?;
        Ok(swept)
    }

    /// Ended runs whose retention passed, oldest end first, at most [`RUNS_PER_PASS`].
    async fn runs_due(&self, retention: &Retention, now: i64) -> Result<Vec<String>> {
        let own: Vec<&str> = retention
            .runs_by_profile
            .keys()
            .map(String::as_str)
            .collect();
        let mut due: Vec<String> = run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .filter(run::Column::EndedAtUs.lt(now.saturating_sub(retention.runs_us)))
            .filter(run::Column::Profile.is_not_in(own.iter().copied()))
            .order_by(run::Column::EndedAtUs, Order::Asc)
            .limit(RUNS_PER_PASS)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (profile, kept_us) in &retention.runs_by_profile {
            let left = RUNS_PER_PASS.saturating_sub(due.len() as u64);
            if left == 0 {
                break;
            }
            let of_profile: Vec<String> = run::Entity::find()
                .select_only()
                .column(run::Column::Id)
                .filter(run::Column::Profile.eq(profile.as_str()))
                .filter(run::Column::EndedAtUs.lt(now.saturating_sub(*kept_us)))
                .order_by(run::Column::EndedAtUs, Order::Asc)
                .limit(left)
                .into_tuple()
                .all(&self.db)
                .await?;
            due.extend(of_profile);
        }
        Ok(due)
    }

    /// Deletes `run_id`'s events after `from` through `last`, a chunk per transaction,
    /// while `budget` lasts; returns how many it deleted.
    async fn prune_events(
        &self,
        run_id: &str,
        mut from: i64,
        last: i64,
        budget: &mut u64,
    ) -> Result<u64> {
        let mut deleted = 0;
        while from < last && *budget > 0 {
            let through = last
                .min(from.saturating_add(EVENTS_PER_CHUNK))
                .min(from.saturating_add(i64::try_from(*budget).unwrap_or(i64::MAX)));
            let txn = self.write_tx().await?;
            let events = event::Entity::delete_many()
                .filter(event::Column::RunId.eq(run_id))
                .filter(event::Column::Sequence.lte(through))
                .exec(&txn)
                .await?
                .rows_affected;
            event_batch::Entity::delete_many()
                .filter(event_batch::Column::RunId.eq(run_id))
                .filter(event_batch::Column::LastSequence.lte(through))
                .exec(&txn)
                .await?;
            run::Entity::update_many()
                .col_expr(run::Column::EventsPrunedThrough, Expr::value(through))
                .filter(run::Column::Id.eq(run_id))
                .filter(run::Column::EventsPrunedThrough.lt(through))
                .exec(&txn)
                .await?;
            txn.commit().await?;
            *budget = budget.saturating_sub(u64::try_from(through - from).unwrap_or(0));
            deleted += events;
            from = through;
        }
        Ok(deleted)
    }

    /// Deletes the ended run `run_id` and what is left of it but its receipt, once its
    /// events are gone; returns 1 when this call deleted it.
    async fn delete_run(&self, run_id: &str) -> Result<u64> {
        let txn = self.write_tx().await?;
        let gone = run::Entity::delete_many()
            .filter(run::Column::Id.eq(run_id))
            .filter(run::Column::EndedAtUs.is_not_null())
            .filter(sea_orm::sea_query::ExprTrait::gte(
                Expr::col(run::Column::EventsPrunedThrough),
                Expr::col(run::Column::LastSequence),
            ))
            .exec(&txn)
            .await?
            .rows_affected;
        if gone == 1 {
            event_batch::Entity::delete_many()
                .filter(event_batch::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
            steering_message::Entity::delete_many()
                .filter(steering_message::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
            run_key::Entity::delete_many()
                .filter(run_key::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
            keyed_answer::Entity::delete_many()
                .filter(keyed_answer::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
            run_label::Entity::delete_many()
                .filter(run_label::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
            entities::run_attempt::Entity::delete_many()
                .filter(entities::run_attempt::Column::RunId.eq(run_id))
                .exec(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok(gone)
    }
}
