//! Attempts: a run outlives its sandbox.
//!
//! A run is on attempt `retries + 1`. Its key for a sandbox is issued for one attempt
//! (`run_keys.attempt`), which gets a row in `run_attempts` then. An ending the profile's
//! retry policy covers ([`crate::domain::retry`]) ends the attempt instead of the run, in
//! the transaction that would have ended the run: the attempt's row records why, an
//! `attempt_ended` event extends the chain, its keys are revoked (`attempt_ended`), and
//! the run is STARTING again with no sandbox, keeping its slot, its steering messages and
//! its deadline, until `retry_at_us` lets dispatch give it the next sandbox.

use super::*;
use crate::domain::retry;
use entities::run_attempt;

/// A key whose attempt ended and was followed by another.
pub const REVOKED_ATTEMPT_ENDED: &str = "attempt_ended";

/// The attempt a run is on.
pub fn current_attempt(run: &run::Model) -> u32 {
    u32::try_from(run.retries.saturating_add(1)).unwrap_or(u32::MAX)
}

/// The attempt a key was issued for (keys from before attempts were recorded: the first).
pub fn attempt_of(key: &run_key::Model) -> u32 {
    u32::try_from(key.attempt.max(1)).unwrap_or(u32::MAX)
}

/// Attempt `number` of `run_id`'s row, if it has one.
async fn attempt_row(
    db: &impl ConnectionTrait,
    run_id: &str,
    number: u32,
) -> Result<Option<run_attempt::Model>> {
    Ok(
        run_attempt::Entity::find_by_id((run_id.to_owned(), i64::from(number)))
            .one(db)
            .await?,
    )
}

/// The row of attempt `number`, begun at `started_at_us` in `sandbox_id` on `node_id`,
/// not ended.
fn begun(
    run_id: &str,
    number: u32,
    sandbox_id: &str,
    node_id: &str,
    started_at_us: i64,
) -> run_attempt::Model {
    run_attempt::Model {
        run_id: run_id.to_owned(),
        number: i64::from(number),
        sandbox_id: sandbox_id.to_owned(),
        node_id: node_id.to_owned(),
        started_at_us,
        ended_at_us: 0,
        end_reason: String::new(),
        end_message: String::new(),
        superseded_verdict: String::new(),
    }
}

impl Store {
    /// Ends the locked run's current attempt with `verdict` and schedules the next, when
    /// its profile's retry policy retries this ending, attempts remain and the next
    /// could start before the deadline. `None`: the run ends instead (the caller finishes
    /// it). All in the caller's transaction.
    pub(super) async fn retry_locked(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        verdict: &Verdict,
    ) -> Result<Option<run::Model>> {
        let policy = self.retry_rules.of(&run.profile);
        let attempt = current_attempt(run);
        if !retry::retries(policy, verdict, attempt) {
            return Ok(None);
        }
        let now = self.now_us();
        let wait = retry::backoff(policy, attempt + 1, rand::random::<f64>());
        let retry_at = now.saturating_add(wait.as_micros().min(i64::MAX as u128) as i64);
        if run
            .deadline_at_us
            .is_some_and(|deadline| retry_at >= deadline)
        {
            return Ok(None);
        }
        self.end_attempt(txn, run, attempt, &verdict.reason, &verdict.message, now)
            .await?;
        let ended = CheckedEvent {
            kind: runstore_pb::EventKind::AttemptEnded as i32,
            text: String::new(),
            data: serde_json::json!({
                "attempt": attempt,
                "sandbox_id": run.sandbox_id,
                "reason": verdict.reason,
                "message": verdict.message,
                "retry_at": runplane_clock::to_timestamp(retry_at).to_string(),
            })
            .to_string(),
            check: false,
            name: "attempt_ended".into(),
            observed_at_us: None,
        };
        let events = [ended];
        let digest = crate::domain::validate::batch_digest(&events);
        self.append_locked(
            txn,
            run,
            &format!("attempt-ended:{attempt}"),
            &digest,
            &events,
        )
        .await?;
        revoke_live_keys(txn, &run.id, REVOKED_ATTEMPT_ENDED, now).await?;
        // A stream hand-off queued for this attempt's runner names a lease the next
        // attempt replaces with a fresh one: it is settled here, not delivered to the
        // next runner. Steers and interrupts stay for it.
        steering_message::Entity::update_many()
            .col_expr(steering_message::Column::AckedAtUs, Expr::value(now))
            .col_expr(
                steering_message::Column::AckOutcome,
                Expr::value(REVOKED_ATTEMPT_ENDED),
            )
            .filter(steering_message::Column::RunId.eq(run.id.as_str()))
            .filter(steering_message::Column::AckedAtUs.is_null())
            .filter(
                steering_message::Column::Kind.eq(runstore_pb::SteeringKind::ResumeStream as i32),
            )
            .exec(txn)
            .await?;
        // The append moved the chain on: read the row it wrote.
        let run = self.lock_run(txn, &run.id).await?;
        let mut active = run.into_active_model();
        active.retries = sea_orm::Set(i64::from(attempt));
        active.retry_at_us = sea_orm::Set(retry_at);
        active.state = sea_orm::Set(RunState::Starting);
        // No sandbox holds the next attempt yet: a guarded FailRun for the old one, and
        // its runner's calls, no longer match.
        active.sandbox_id = sea_orm::Set(String::new());
        active.sandbox_generation = sea_orm::Set(0);
        active.waiting_since_us = sea_orm::Set(0);
        active.waiting_generation = sea_orm::Set(0);
        active.waiting_seq = sea_orm::Set(0);
        active.updated_at_us = sea_orm::Set(now);
        let run = active.update(txn).await?;
        runplane_telemetry::metrics::runs_attempts().add(
            1,
            &[runplane_telemetry::metrics::attr(
                "reason",
                verdict.reason.clone(),
            )],
        );
        tracing::info!(
            run_id = %run.id,
            attempt,
            reason = %verdict.reason,
            retry_in_ms = wait.as_millis() as u64,
            "attempt ended; the next starts after its backoff"
        );
        Ok(Some(run))
    }

    /// Records the end of attempt `number` (its row written now if its key predates
    /// attempts), unless it has one already.
    pub(super) async fn end_attempt(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        number: u32,
        reason: &str,
        message: &str,
        now: i64,
    ) -> Result<()> {
        let ended = |row: run_attempt::Model| {
            let mut active = row.into_active_model();
            active.ended_at_us = sea_orm::Set(now);
            active.end_reason = sea_orm::Set(reason.to_owned());
            active.end_message = sea_orm::Set(message.to_owned());
            active
        };
        match attempt_row(txn, &run.id, number).await? {
            Some(row) if row.ended_at_us > 0 => {}
            Some(row) => {
                ended(row).update(txn).await?;
            }
            // An attempt that never got a sandbox (a run cancelled in its backoff) has
            // nothing to record.
            None if run.sandbox_id.is_empty() => {}
            None => {
                let started = run.started_at_us.unwrap_or(run.created_at_us);
                let row = begun(&run.id, number, &run.sandbox_id, "", started);
                run_attempt::Entity::insert(ended(row))
                    .exec_without_returning(txn)
                    .await?;
            }
        }
        Ok(())
    }

    /// Writes attempt `number`'s row when its first key is issued.
    pub(super) async fn start_attempt(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        number: u32,
        sandbox_id: &str,
        node_id: &str,
        now: i64,
    ) -> Result<()> {
        if attempt_row(txn, run_id, number).await?.is_none() {
            let row = begun(run_id, number, sandbox_id, node_id, now);
            run_attempt::Entity::insert(row.into_active_model())
                .exec_without_returning(txn)
                .await?;
        }
        Ok(())
    }

    /// Appends the `attempt_started` event of a later attempt's first Hello.
    pub(super) async fn note_attempt_started(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        key: &run_key::Model,
    ) -> Result<()> {
        let attempt = attempt_of(key);
        let node_id = attempt_row(txn, &run.id, attempt)
            .await?
            .map(|a| a.node_id)
            .unwrap_or_default();
        let started = CheckedEvent {
            kind: runstore_pb::EventKind::AttemptStarted as i32,
            text: String::new(),
            data: serde_json::json!({
                "attempt": attempt,
                "sandbox_id": key.sandbox_id,
                "node_id": node_id,
            })
            .to_string(),
            check: false,
            name: "attempt_started".into(),
            observed_at_us: None,
        };
        let events = [started];
        let digest = crate::domain::validate::batch_digest(&events);
        self.append_locked(
            txn,
            run,
            &format!("attempt-started:{attempt}"),
            &digest,
            &events,
        )
        .await?;
        Ok(())
    }

    /// The run's attempts, oldest first.
    pub async fn attempts(&self, run_id: &str) -> Result<Vec<run_attempt::Model>> {
        self.attempts_in(&self.db, run_id).await
    }

    pub(super) async fn attempts_in(
        &self,
        db: &impl ConnectionTrait,
        run_id: &str,
    ) -> Result<Vec<run_attempt::Model>> {
        Ok(run_attempt::Entity::find()
            .filter(run_attempt::Column::RunId.eq(run_id))
            .order_by(run_attempt::Column::Number, Order::Asc)
            .all(db)
            .await?)
    }

    /// Why attempt `number` of `run_id` ended; empty when it has not, or is unknown.
    pub(super) async fn attempt_end_reason(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        number: u32,
    ) -> Result<String> {
        Ok(attempt_row(txn, run_id, number)
            .await?
            .map(|a| a.end_reason)
            .unwrap_or_default())
    }

    /// A verdict from the runner of an attempt that has ended. Its own replay (the
    /// verdict that ended the attempt and started the next) is answered with the run as
    /// it is now; any other is refused `ATTEMPT_SUPERSEDED` and kept on the attempt's row.
    pub async fn superseded_verdict(&self, secret: &str, verdict: &Verdict) -> Result<run::Model> {
        let key = run_key::Entity::find()
            .filter(run_key::Column::KeyHash.eq(ids::secret_hash(secret)))
            .one(&self.db)
            .await?
            .ok_or(RunStoreError::RunKeyInvalid)?;
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, &key.run_id).await?;
        let attempt = attempt_of(&key);
        let row = attempt_row(&txn, &run.id, attempt).await?;
        let said = format!("{} {}", verdict.outcome, verdict.reason);
        if let Some(row) = row {
            if row.end_reason == verdict.reason && row.superseded_verdict.is_empty() {
                txn.commit().await?;
                return Ok(run);
            }
            if row.superseded_verdict.is_empty() {
                let mut active = row.into_active_model();
                active.superseded_verdict = sea_orm::Set(said.clone());
                active.update(&txn).await?;
            }
        }
        txn.commit().await?;
        tracing::warn!(
            run_id = %run.id,
            attempt,
            current_attempt = current_attempt(&run),
            verdict = %said,
            "a verdict from an attempt that had ended was refused"
        );
        Err(RunStoreError::AttemptSuperseded {
            run_id: run.id.clone(),
            attempt,
            current: current_attempt(&run),
        })
    }
}
