//! Pauses: an operator's PauseRun and ResumeRun, and the end of a pause held too long.
//! The run store only records the pause; the sandbox reconciler asks which runs are
//! paused (`ListRuns.paused_only`) and suspends or restores their sandboxes.

use super::*;

/// What a pause of a run of one profile may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseRule {
    /// How long the pause may last before the run ends `paused_too_long`.
    pub max_us: i64,
    /// Whether paused time counts toward the run's deadline.
    pub counts_toward_deadline: bool,
}

/// A pause or resume call's effect.
#[derive(Debug, Clone)]
pub struct Paused {
    /// The run after the call.
    pub run: run::Model,
    /// Whether this call changed it (false: a replay, or already so).
    pub changed: bool,
}

/// A keyed change opened by [`Store::open_keyed`].
enum Opened {
    /// The key was used before: the run as it is now.
    Replayed(run::Model),
    /// The run, locked for the transaction.
    Open(DatabaseTransaction, run::Model),
}

/// Why a run ends when its pause outlived its profile's `max_pause_seconds`.
pub const REASON_PAUSED_TOO_LONG: &str = "paused_too_long";

impl Store {
    /// Pauses a live run under its lock: `paused_at_us` now, the pause's end by `rule`,
    /// and `run.paused` owed to the webhooks, in one transaction with the call's key. A
    /// replay of the key, or a run already paused, changes nothing.
    pub async fn pause_run(
        &self,
        run_id: &str,
        idempotency_key: &str,
        request_digest: &str,
        rule: PauseRule,
    ) -> Result<Paused> {
        const METHOD: &str = "PauseRun";
        let (txn, run) = match self
            .open_keyed(run_id, METHOD, idempotency_key, request_digest)
            .await?
        {
            Opened::Replayed(run) => {
                return Ok(Paused {
                    run,
                    changed: false,
                });
            }
            Opened::Open(txn, run) => (txn, run),
        };
        let (run, changed) = if run.paused_at_us > 0 {
            (run, false)
        } else {
            let now = self.now_us();
            let mut active = run.into_active_model();
            active.paused_at_us = sea_orm::Set(now);
            active.pause_ends_at_us = sea_orm::Set(now.saturating_add(rule.max_us));
            active.pause_holds_deadline = sea_orm::Set(i64::from(!rule.counts_toward_deadline));
            active.updated_at_us = sea_orm::Set(now);
            let run = active.update(&txn).await?;
            self.owe_webhooks_of(&txn, &run, "run.paused", now, Some(now))
                .await?;
            (run, true)
        };
        self.commit_keyed(
            txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            Vec::new(),
        )
        .await?;
        Ok(Paused { run, changed })
    }

    /// Resumes a paused run under its lock: the pause cleared, its deadline moved on by
    /// the pause's length when the pause held it, and `run.resumed` owed, in one
    /// transaction with the call's key. A replay of the key, or a run not paused, changes
    /// nothing.
    pub async fn resume_run(
        &self,
        run_id: &str,
        idempotency_key: &str,
        request_digest: &str,
    ) -> Result<Paused> {
        const METHOD: &str = "ResumeRun";
        let (txn, run) = match self
            .open_keyed(run_id, METHOD, idempotency_key, request_digest)
            .await?
        {
            Opened::Replayed(run) => {
                return Ok(Paused {
                    run,
                    changed: false,
                });
            }
            Opened::Open(txn, run) => (txn, run),
        };
        let (run, changed) = if run.paused_at_us == 0 {
            (run, false)
        } else {
            let now = self.now_us();
            let paused_at = run.paused_at_us;
            let held = run.pause_holds_deadline != 0;
            let deadline = run.deadline_at_us;
            let mut active = run.into_active_model();
            if held && let Some(deadline) = deadline {
                let paused_for = now.saturating_sub(paused_at).max(0);
                active.deadline_at_us = sea_orm::Set(Some(deadline.saturating_add(paused_for)));
            }
            active.paused_at_us = sea_orm::Set(0);
            active.pause_ends_at_us = sea_orm::Set(0);
            active.pause_holds_deadline = sea_orm::Set(0);
            active.updated_at_us = sea_orm::Set(now);
            let run = active.update(&txn).await?;
            self.owe_webhooks_of(&txn, &run, "run.resumed", now, Some(paused_at))
                .await?;
            (run, true)
        };
        self.commit_keyed(
            txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            Vec::new(),
        )
        .await?;
        Ok(Paused { run, changed })
    }

    /// Opens a keyed change of a live run under its lock: a replay of the key is
    /// answered with the run as it is (committed, nothing written); a terminal run is
    /// refused `RUN_TERMINAL`.
    async fn open_keyed(
        &self,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
    ) -> Result<Opened> {
        let (txn, run, replayed) = self
            .begin_keyed(run_id, method, idempotency_key, request_digest)
            .await?;
        if replayed.is_some() {
            txn.commit().await?;
            return Ok(Opened::Replayed(run));
        }
        if run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        Ok(Opened::Open(txn, run))
    }

    /// Live runs whose pause has lasted past its end, soonest first: one bounded read on
    /// the pause-end index.
    pub async fn past_pause(&self, limit: u64) -> Result<Vec<String>> {
        Ok(run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .filter(run::Column::PauseEndsAtUs.gt(0))
            .filter(run::Column::PauseEndsAtUs.lte(self.now_us()))
            .filter(run::Column::State.is_in(RunState::LIVE))
            .order_by(run::Column::PauseEndsAtUs, Order::Asc)
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?)
    }

    /// Ends `run_id` FAILED `paused_too_long` if it is still live, paused and past its
    /// pause's end under the run's lock, so of several replicas sweeping at once exactly
    /// one ends it. `None` when nothing changed.
    pub async fn end_pause(
        &self,
        run_id: &str,
        signer: &ReceiptSigner,
    ) -> Result<Option<run::Model>> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let now = self.now_us();
        if run.state.is_terminal()
            || run.paused_at_us == 0
            || run.pause_ends_at_us == 0
            || run.pause_ends_at_us > now
        {
            return Ok(None);
        }
        let paused_s = (run.pause_ends_at_us - run.paused_at_us) / 1_000_000;
        let verdict = Verdict::new(
            VerdictOutcome::Failed,
            REASON_PAUSED_TOO_LONG,
            format!("the run stayed paused past its {paused_s} s limit"),
        );
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        txn.commit().await?;
        Ok(Some(run))
    }
}
