//! Verdicts and endings: results, failures, cancels, deadlines, backend errors and receipts.

use super::*;

impl Store {
    /// Records a runner's verdict (after its final batch, if any). The same verdict
    /// again is a replay; another one on a terminal run is refused with the recorded one.
    pub async fn submit_result(
        &self,
        run_id: &str,
        verdict: &Verdict,
        failure_tail: &str,
        final_batch: Option<(&str, &[CheckedEvent])>,
        signer: &ReceiptSigner,
    ) -> Result<Finished> {
        let txn = self.write_tx().await?;
        let mut run = self.lock_run(&txn, run_id).await?;
        if run.state.is_terminal() {
            if same_verdict(&run, verdict) {
                txn.commit().await?;
                return Ok(Finished {
                    run,
                    made_terminal: false,
                    retried: false,
                });
            }
            return Err(terminal_error(&run));
        }
        if let Some((batch_key, events)) = final_batch {
            let digest = crate::domain::validate::batch_digest(events);
            if self
                .find_batch(&txn, run_id, batch_key, &digest)
                .await?
                .is_none()
            {
                self.append_locked(&txn, &run, batch_key, &digest, events)
                    .await?;
                run = self.lock_run(&txn, run_id).await?;
            }
        }
        // A retried verdict ends the attempt; any other ends the run.
        let (run, retried) = match self.retry_locked(&txn, &run, verdict).await? {
            Some(run) => (run, true),
            None => (
                self.finish_locked(&txn, run, verdict, Some(failure_tail), signer)
                    .await?,
                false,
            ),
        };
        if verdict.outcome == VerdictOutcome::Failed && !failure_tail.is_empty() {
            self.owe_turn_failure(&txn, &run, format!("{}:result", run.id), failure_tail)
                .await?;
        }
        txn.commit().await?;
        Ok(Finished {
            run,
            made_terminal: !retried,
            retried,
        })
    }

    /// Fails a run for a service: one atomic claim that folds in the optional guard.
    /// A replay with the same idempotency key gets the stored answer.
    pub async fn fail_run(
        &self,
        run_id: &str,
        request: &FailRequest<'_>,
        signer: &ReceiptSigner,
    ) -> Result<Keyed<runstore_pb::FailRunOutcome>> {
        let FailRequest {
            reason,
            message,
            idempotency_key,
            guard_generation,
            guard_sandbox,
            request_digest,
        } = *request;
        const METHOD: &str = "FailRun";
        let (txn, run, replayed) = self
            .begin_keyed(run_id, METHOD, idempotency_key, request_digest)
            .await?;
        if let Some(outcome) = replayed {
            txn.commit().await?;
            let outcome = runstore_pb::FailRunOutcome::try_from(outcome)
                .unwrap_or(runstore_pb::FailRunOutcome::Unspecified);
            return Ok(Keyed {
                outcome,
                run,
                replayed: true,
            });
        }
        let (outcome, run) = if run.state.is_terminal() {
            (runstore_pb::FailRunOutcome::AlreadyTerminal, run)
        } else if guard_generation.is_some_and(|g| i64::try_from(g) != Ok(run.sandbox_generation))
            || guard_sandbox.is_some_and(|id| id != run.sandbox_id)
        {
            (runstore_pb::FailRunOutcome::GuardMismatch, run)
        } else {
            let verdict = Verdict::new(VerdictOutcome::Failed, reason, message);
            match self.retry_locked(&txn, &run, &verdict).await? {
                Some(run) => (runstore_pb::FailRunOutcome::AttemptEnded, run),
                None => {
                    let run = self
                        .finish_locked(&txn, run, &verdict, None, signer)
                        .await?;
                    (runstore_pb::FailRunOutcome::MadeTerminal, run)
                }
            }
        };
        self.commit_keyed(
            txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            (outcome as i32).to_be_bytes().to_vec(),
        )
        .await?;
        Ok(Keyed {
            outcome,
            run,
            replayed: false,
        })
    }

    /// Ends a QUEUED run as cancelled (an interrupt before any sandbox existed).
    pub async fn cancel_queued(
        &self,
        run_id: &str,
        reason: &str,
        signer: &ReceiptSigner,
    ) -> Result<Option<run::Model>> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if run.state != RunState::Queued {
            return Ok(None);
        }
        let verdict = Verdict::new(VerdictOutcome::Cancelled, "interrupted", reason);
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        txn.commit().await?;
        Ok(Some(run))
    }

    /// Cancels a run for an operator through the guarded terminal path. A replay of the
    /// cancel that won (same idempotency key) gets the run back with `made_terminal`
    /// false; any other cancel of a terminal run is refused with its recorded verdict.
    pub async fn cancel_run(
        &self,
        run_id: &str,
        message: &str,
        idempotency_key: &str,
        request_digest: &str,
        signer: &ReceiptSigner,
    ) -> Result<Finished> {
        const METHOD: &str = "CancelRun";
        let (txn, run, replayed) = self
            .begin_keyed(run_id, METHOD, idempotency_key, request_digest)
            .await?;
        if replayed.is_some() {
            txn.commit().await?;
            return Ok(Finished {
                run,
                made_terminal: false,
                retried: false,
            });
        }
        if run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        let verdict = Verdict::new(VerdictOutcome::Cancelled, REASON_CANCELLED, message);
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        self.commit_keyed(
            txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            Vec::new(),
        )
        .await?;
        Ok(Finished {
            run,
            made_terminal: true,
            retried: false,
        })
    }

    /// Live runs whose deadline has passed, soonest first: one bounded read on the
    /// deadline index.
    pub async fn past_deadline(&self, limit: u64) -> Result<Vec<String>> {
        Ok(run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .filter(run::Column::DeadlineAtUs.lte(self.now_us()))
            // A pause that holds the deadline stops its clock (ResumeRun moves it on).
            .filter(
                sea_orm::Condition::any()
                    .add(run::Column::PausedAtUs.eq(0))
                    .add(run::Column::PauseHoldsDeadline.eq(0)),
            )
            .filter(run::Column::State.is_in(RunState::LIVE))
            .order_by(run::Column::DeadlineAtUs, Order::Asc)
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?)
    }

    /// Ends `run_id` as `deadline_exceeded` if it is still live and past its deadline
    /// under the run's lock, so of several replicas sweeping at once exactly one ends it
    /// and the others find it terminal. `None` when nothing changed.
    pub async fn expire(&self, run_id: &str, signer: &ReceiptSigner) -> Result<Option<run::Model>> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let now = self.now_us();
        let held = run.paused_at_us > 0 && run.pause_holds_deadline != 0;
        if run.state.is_terminal() || held || run.deadline_at_us.is_none_or(|d| d > now) {
            return Ok(None);
        }
        let limit_s = (run.deadline_at_us.unwrap_or(now) - run.created_at_us) / 1_000_000;
        let verdict = Verdict::new(
            VerdictOutcome::Failed,
            REASON_DEADLINE_EXCEEDED,
            format!("the run outlived its {limit_s} s deadline"),
        );
        let run = self
            .finish_locked(&txn, run, &verdict, None, signer)
            .await?;
        txn.commit().await?;
        Ok(Some(run))
    }

    /// Records the durable backend-error outcome: from a live run it ends the run, from
    /// a succeeded or failed one it changes only the state and the outcome.
    #[allow(clippy::too_many_arguments)]
    pub async fn mark_backend_error(
        &self,
        run_id: &str,
        idempotency_key: &str,
        request_digest: &str,
        outcome_json: &str,
        reason: &str,
        signer: &ReceiptSigner,
    ) -> Result<Keyed<runstore_pb::MarkBackendErrorOutcome>> {
        const METHOD: &str = "MarkBackendError";
        let (txn, run, replayed) = self
            .begin_keyed(run_id, METHOD, idempotency_key, request_digest)
            .await?;
        if let Some(outcome) = replayed {
            txn.commit().await?;
            let outcome = runstore_pb::MarkBackendErrorOutcome::try_from(outcome)
                .unwrap_or(runstore_pb::MarkBackendErrorOutcome::Unspecified);
            return Ok(Keyed {
                outcome,
                run,
                replayed: true,
            });
        }
        let now = self.now_us();
        let (outcome, run) = match run.state {
            RunState::BackendError => (runstore_pb::MarkBackendErrorOutcome::AlreadyMarked, run),
            RunState::Queued | RunState::Cancelled => {
                return Err(RunStoreError::VerdictConflict(format!(
                    "a {} run cannot carry a backend error",
                    run.state
                )));
            }
            RunState::Starting | RunState::Running => {
                let verdict = Verdict::new(VerdictOutcome::Failed, "backend_error", reason);
                let run = self
                    .finish_locked(&txn, run, &verdict, None, signer)
                    .await?;
                let mut active = run.into_active_model();
                active.state = sea_orm::Set(RunState::BackendError);
                active.backend_error = sea_orm::Set(Some(outcome_json.to_owned()));
                active.updated_at_us = sea_orm::Set(now);
                let run = active.update(&txn).await?;
                // After the run's own end event (its run.failed may carry this very
                // transaction's time), so deliveries go out in that order.
                let at = run.ended_at_us.map_or(now, |ended| ended + 1).max(now);
                self.owe_webhooks(&txn, &run, "run.backend_error", at)
                    .await?;
                (runstore_pb::MarkBackendErrorOutcome::Marked, run)
            }
            _ => {
                // Done already (succeeded or failed): the receipt stays as sealed; the
                // roster records what the run really died of.
                let mut active = run.into_active_model();
                active.state = sea_orm::Set(RunState::BackendError);
                active.backend_error = sea_orm::Set(Some(outcome_json.to_owned()));
                active.updated_at_us = sea_orm::Set(now);
                let run = active.update(&txn).await?;
                // After the run's own end event (its run.failed may carry this very
                // transaction's time), so deliveries go out in that order.
                let at = run.ended_at_us.map_or(now, |ended| ended + 1).max(now);
                self.owe_webhooks(&txn, &run, "run.backend_error", at)
                    .await?;
                (runstore_pb::MarkBackendErrorOutcome::Marked, run)
            }
        };
        self.commit_keyed(
            txn,
            run_id,
            METHOD,
            idempotency_key,
            request_digest,
            (outcome as i32).to_be_bytes().to_vec(),
        )
        .await?;
        Ok(Keyed {
            outcome,
            run,
            replayed: false,
        })
    }

    /// A keyed call's start: its write transaction, the run locked in it, and the outcome
    /// stored for `idempotency_key` when this call replays one already answered (the same
    /// key with another request is refused).
    pub(super) async fn begin_keyed(
        &self,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
    ) -> Result<(DatabaseTransaction, run::Model, Option<i32>)> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let replayed = self
            .keyed_answer(&txn, run_id, method, idempotency_key, request_digest)
            .await?
            .map(|answer| stored_outcome(&answer));
        Ok((txn, run, replayed))
    }

    async fn keyed_answer(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
    ) -> Result<Option<Vec<u8>>> {
        let Some(answer) = keyed_answer::Entity::find_by_id((
            run_id.to_owned(),
            method.to_owned(),
            idempotency_key.to_owned(),
        ))
        .one(txn)
        .await?
        else {
            return Ok(None);
        };
        if answer.request_digest != request_digest {
            return Err(RunStoreError::KeyReused {
                field: "idempotency_key",
            });
        }
        Ok(Some(answer.answer))
    }

    /// A keyed call's end: stores `answer` under its key, then commits.
    pub(super) async fn commit_keyed(
        &self,
        txn: DatabaseTransaction,
        run_id: &str,
        method: &str,
        idempotency_key: &str,
        request_digest: &str,
        answer: Vec<u8>,
    ) -> Result<()> {
        keyed_answer::Entity::insert(
            keyed_answer::Model {
                run_id: run_id.to_owned(),
                method: method.to_owned(),
                idempotency_key: idempotency_key.to_owned(),
                request_digest: request_digest.to_owned(),
                answer,
                created_at_us: self.now_us(),
            }
            .into_active_model(),
        )
        .exec_without_returning(&txn)
        .await?;
        txn.commit().await?;
        Ok(())
    }

    /// Makes a locked, live run terminal with `verdict`: revokes its keys and seals its
    /// receipt, all in the caller's transaction.
    pub(super) async fn finish_locked(
        &self,
        txn: &DatabaseTransaction,
        run: run::Model,
        verdict: &Verdict,
        failure_tail: Option<&str>,
        signer: &ReceiptSigner,
    ) -> Result<run::Model> {
        let now = self.now_us();
        let mut active = run.clone().into_active_model();
        active.state = sea_orm::Set(verdict.outcome.run_state());
        active.verdict_outcome = sea_orm::Set(Some(verdict.outcome));
        active.verdict_reason = sea_orm::Set(Some(verdict.reason.clone()));
        active.verdict_exit_code = sea_orm::Set(verdict.exit_code);
        active.verdict_signal = sea_orm::Set(verdict.signal);
        active.verdict_message = sea_orm::Set(Some(verdict.message.clone()));
        // An ended run's pause is over: the pause sweep no longer reads it.
        active.pause_ends_at_us = sea_orm::Set(0);
        active.failure_tail =
            sea_orm::Set(failure_tail.filter(|t| !t.is_empty()).map(str::to_owned));
        active.ended_at_us = sea_orm::Set(Some(now));
        active.updated_at_us = sea_orm::Set(now);
        let run = active.update(txn).await?;
        self.end_attempt(
            txn,
            &run,
            super::attempts::current_attempt(&run),
            &verdict.reason,
            &verdict.message,
            now,
        )
        .await?;

        revoke_live_keys(txn, &run.id, REVOKED_TERMINAL, now).await?;

        let checks = event::Entity::find()
            .filter(event::Column::RunId.eq(run.id.as_str()))
            .filter(event::Column::IsCheck.eq(true))
            .order_by(event::Column::Sequence, Order::Asc)
            .all(txn)
            .await?;
        let attempts = self.attempts_in(txn, &run.id).await?;
        let body = runstore_pb::ReceiptBody {
            run_id: run.id.clone(),
            org_id: run.org_id.clone(),
            verdict: run.verdict().as_ref().map(runstore_pb::Verdict::from),
            event_count: run.last_sequence as u64,
            check_events: checks
                .into_iter()
                .map(|e| runstore_pb::CheckEventRef {
                    sequence: e.sequence as u64,
                    digest: e.digest,
                    name: e.name,
                })
                .collect(),
            chain_head: run.chain_head.clone(),
            sealed_at: Some(runplane_clock::to_timestamp(now)),
            key_id: String::new(),
            attempts: attempts
                .into_iter()
                .map(|a| runstore_pb::AttemptRef {
                    number: u32::try_from(a.number).unwrap_or(u32::MAX),
                    sandbox_id: a.sandbox_id,
                    node_id: a.node_id,
                    end_reason: a.end_reason,
                })
                .collect(),
        };
        let sealed = signer.seal(body);
        receipt::Entity::insert(
            receipt::Model {
                run_id: run.id.clone(),
                signed_payload: sealed.signed_payload,
                signature: sealed.signature,
                key_id: sealed.key_id,
                sealed_at_us: now,
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        if let Some(event) = crate::domain::webhook::event_of(run.state) {
            self.owe_webhooks(txn, &run, event, now).await?;
        }
        Ok(run)
    }

    pub async fn receipt(&self, run_id: &str) -> Result<Option<runstore_pb::Receipt>> {
        Ok(receipt::Entity::find_by_id(run_id.to_owned())
            .one(&self.db)
            .await?
            .map(|r| runstore_pb::Receipt {
                body: runstore_pb::ReceiptBody::decode(r.signed_payload.as_slice()).ok(),
                signed_payload: r.signed_payload,
                signature: r.signature,
                key_id: r.key_id,
            }))
    }
}
