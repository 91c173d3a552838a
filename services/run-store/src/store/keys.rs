//! Run keys: issuing them, authenticating runners, and Hello.

use super::attempts::{attempt_of, current_attempt};
use super::*;

/// What a run key is issued for: one generation of one sandbox, made for one attempt.
#[derive(Debug, Clone, Copy)]
pub struct KeyFor<'a> {
    pub sandbox_id: &'a str,
    pub generation: u64,
    /// 0: the run's current attempt.
    pub attempt: u32,
    /// The node the sandbox runs on, for the attempt's record.
    pub node_id: &'a str,
}

impl Store {
    /// Mints the key of one sandbox generation. Returns the key row and the secret,
    /// which exists only in this answer.
    pub async fn issue_run_key(
        &self,
        run_id: &str,
        for_: &KeyFor<'_>,
        idempotency_key: &str,
    ) -> Result<(run_key::Model, String)> {
        let KeyFor {
            sandbox_id,
            generation,
            ..
        } = *for_;
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        let current = current_attempt(&run);
        let attempt = match for_.attempt {
            0 => current,
            n => n,
        };
        if attempt != current {
            return Err(RunStoreError::AttemptSuperseded {
                run_id: run.id.clone(),
                attempt,
                current,
            });
        }
        let now = self.now_us();
        let secret = ids::new_run_key();
        let generation_i = generation as i64;

        let existing = run_key::Entity::find()
            .filter(run_key::Column::RunId.eq(run_id))
            .filter(run_key::Column::IdempotencyKey.eq(idempotency_key))
            .one(&txn)
            .await?;
        if let Some(existing) = existing {
            if existing.sandbox_id != sandbox_id
                || existing.sandbox_generation != generation_i
                || attempt_of(&existing) != attempt
            {
                return Err(RunStoreError::KeyReused {
                    field: "idempotency_key",
                });
            }
            if existing.hello_nonce.is_some() {
                return Err(RunStoreError::RunKeyClaimed);
            }
            if existing.revoked_at_us.is_some() {
                // A newer generation superseded it; this replay is stale.
                return Err(RunStoreError::GenerationStale {
                    requested: generation,
                    current: run.sandbox_generation as u64,
                });
            }
            // The first secret was never used (no Hello) and cannot be shown again: it is
            // replaced under the same key id, so no second live key exists.
            let mut active = existing.clone().into_active_model();
            active.key_hash = sea_orm::Set(ids::secret_hash(&secret));
            let key = active.update(&txn).await?;
            txn.commit().await?;
            return Ok((key, secret));
        }

        if generation_i < run.sandbox_generation {
            return Err(RunStoreError::GenerationStale {
                requested: generation,
                current: run.sandbox_generation as u64,
            });
        }
        if run.retry_at_us > now {
            return Err(RunStoreError::RetryBackoff {
                run_id: run.id.clone(),
                retry_after_ms: ((run.retry_at_us - now) / 1000).max(1) as u64,
            });
        }
        self.start_attempt(&txn, run_id, attempt, sandbox_id, for_.node_id, now)
            .await?;
        // One live key per run: whatever was issued before is superseded.
        revoke_live_keys(&txn, run_id, REVOKED_SUPERSEDED, now).await?;
        let key = run_key::Model {
            key_id: ids::new_key_id(),
            run_id: run_id.to_owned(),
            org_id: run.org_id.clone(),
            key_hash: ids::secret_hash(&secret),
            sandbox_id: sandbox_id.to_owned(),
            sandbox_generation: generation_i,
            idempotency_key: idempotency_key.to_owned(),
            created_at_us: now,
            revoked_reason: None,
            revoked_at_us: None,
            hello_nonce: None,
            hello_at_us: None,
            attempt: i64::from(attempt),
        };
        run_key::Entity::insert(key.clone().into_active_model())
            .exec_without_returning(&txn)
            .await?;
        let mut active = run.clone().into_active_model();
        active.sandbox_generation = sea_orm::Set(generation_i);
        active.sandbox_id = sea_orm::Set(sandbox_id.to_owned());
        active.retry_at_us = sea_orm::Set(0);
        if run.state == RunState::Queued {
            active.state = sea_orm::Set(RunState::Starting);
        }
        active.updated_at_us = sea_orm::Set(now);
        active.update(&txn).await?;
        txn.commit().await?;
        Ok((key, secret))
    }

    /// Checks a runner's key against the run it names.
    ///
    /// An unknown key is `RunKeyInvalid`, a key of another run `RunKeyWrongRun`, a key
    /// superseded by a newer generation `RunKeyRevoked`. A key revoked because its run
    /// ended passes only when `allow_terminal` (SubmitResult answers replays with it);
    /// otherwise the caller learns the run is terminal.
    pub async fn authenticate_runner(
        &self,
        secret: &str,
        run_id: &str,
        allow_terminal: bool,
    ) -> Result<RunnerAuth> {
        self.authenticate_key_hash(&ids::secret_hash(secret), run_id, allow_terminal)
            .await
    }

    /// As [`Store::authenticate_runner`], from the key's SHA-256 (hex).
    pub async fn authenticate_key_hash(
        &self,
        key_hash: &str,
        run_id: &str,
        allow_terminal: bool,
    ) -> Result<RunnerAuth> {
        let key = run_key::Entity::find()
            .filter(run_key::Column::KeyHash.eq(key_hash))
            .one(&self.db)
            .await?
            .ok_or(RunStoreError::RunKeyInvalid)?;
        if key.run_id != run_id {
            return Err(RunStoreError::RunKeyWrongRun);
        }
        let run = self.get_run(run_id).await?;
        match key.revoked_reason.as_deref() {
            None => {}
            Some(super::attempts::REVOKED_ATTEMPT_ENDED) => {
                return Err(RunStoreError::AttemptSuperseded {
                    run_id: run.id.clone(),
                    attempt: super::attempts::attempt_of(&key),
                    current: super::attempts::current_attempt(&run),
                });
            }
            Some(REVOKED_TERMINAL) if allow_terminal => {}
            Some(REVOKED_TERMINAL) => return Err(terminal_error(&run)),
            Some(_) => return Err(RunStoreError::RunKeyRevoked),
        }
        if !allow_terminal && run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        Ok(RunnerAuth { key, run })
    }

    /// Claims the key for the runner instance `nonce`. The same nonce gets the same
    /// claim time back; another nonce on a claimed key is refused.
    pub async fn hello(&self, key_id: &str, run_id: &str, nonce: &str) -> Result<Hello> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let key = run_key::Entity::find_by_id(key_id.to_owned())
            .one(&txn)
            .await?
            .ok_or(RunStoreError::RunKeyInvalid)?;
        if let (Some(claimed), Some(at)) = (&key.hello_nonce, key.hello_at_us) {
            if claimed == nonce {
                let previous = self.previous_reason(&txn, &run, &key).await?;
                txn.commit().await?;
                return Ok(Hello {
                    run,
                    claimed_at_us: at,
                    attempt: attempt_of(&key),
                    previous_attempt_reason: previous,
                });
            }
            return Err(RunStoreError::HelloNonceMismatch);
        }
        if key.revoked_at_us.is_some() {
            return Err(if key.revoked_reason.as_deref() == Some(REVOKED_TERMINAL) {
                terminal_error(&run)
            } else {
                RunStoreError::RunKeyRevoked
            });
        }
        if run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        let now = self.now_us();
        let claimed = run_key::Entity::update_many()
            .col_expr(run_key::Column::HelloNonce, Expr::value(nonce))
            .col_expr(run_key::Column::HelloAtUs, Expr::value(now))
            .filter(run_key::Column::KeyId.eq(key_id))
            .filter(run_key::Column::HelloNonce.is_null())
            .exec(&txn)
            .await?;
        if claimed.rows_affected != 1 {
            return Err(RunStoreError::HelloNonceMismatch);
        }
        let run = if attempt_of(&key) > 1 && run.state != RunState::Running {
            // A later attempt's runner: its start extends the one chain.
            self.note_attempt_started(&txn, &run, &key).await?;
            self.lock_run(&txn, run_id).await?
        } else {
            run
        };
        let mut active = run.clone().into_active_model();
        if run.state != RunState::Running {
            active.state = sea_orm::Set(RunState::Running);
        }
        let first_start = run.started_at_us.is_none();
        if first_start {
            active.started_at_us = sea_orm::Set(Some(now));
        }
        active.updated_at_us = sea_orm::Set(now);
        let run = active.update(&txn).await?;
        if first_start {
            self.owe_webhooks(&txn, &run, "run.started", now).await?;
        }
        let previous = self.previous_reason(&txn, &run, &key).await?;
        txn.commit().await?;
        Ok(Hello {
            run,
            claimed_at_us: now,
            attempt: attempt_of(&key),
            previous_attempt_reason: previous,
        })
    }

    /// Why the attempt before `key`'s ended; empty for the first.
    async fn previous_reason(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        key: &run_key::Model,
    ) -> Result<String> {
        match attempt_of(key) {
            1 => Ok(String::new()),
            n => self.attempt_end_reason(txn, &run.id, n - 1).await,
        }
    }
}

/// What Hello answers: the run as of the claim, when the key was claimed, and which
/// attempt the runner is.
#[derive(Debug, Clone)]
pub struct Hello {
    pub run: run::Model,
    pub claimed_at_us: i64,
    pub attempt: u32,
    pub previous_attempt_reason: String,
}
