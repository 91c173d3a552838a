//! Events: appends with their chain and batch keys, and reads.

use super::*;

impl Store {
    /// A runner's AppendEvents: checks its key (`secret`) as [`Store::authenticate_runner`]
    /// does for a live run, then appends as [`Store::append_events`] does.
    ///
    /// On Postgres the plain case is one statement (see [`append`]); anything else, and
    /// SQLite, takes the checked path, which gives every refusal and replay its answer.
    pub async fn append_for_runner(
        &self,
        secret: &str,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let key_hash = ids::secret_hash(secret);
        if let Some(appended) = self
            .append_in_one_statement(&key_hash, run_id, batch_key, events)
            .await?
        {
            return Ok(appended);
        }
        self.authenticate_key_hash(&key_hash, run_id, false).await?;
        self.append_events(run_id, batch_key, events).await
    }

    /// The one-statement append from the tip this replica remembers (or reads); `None`
    /// when it wrote nothing and the checked path must decide.
    pub(super) async fn append_in_one_statement(
        &self,
        key_hash: &str,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Option<Appended>> {
        // The outbox row of a failed turn is written by the checked path.
        let owes_report = self.report_failures && events.iter().any(|e| e.kind == TURN_FAILED);
        if !self.postgres || owes_report {
            return Ok(None);
        }
        let pool = self.db.get_postgres_connection_pool();
        let from = match self.tips.get(run_id) {
            Some(tip) => tip,
            None => match append::read_tip(pool, run_id).await? {
                Some(tip) => tip,
                None => return Ok(None),
            },
        };
        let rows = chain_rows(run_id, &from, events, self.now_us());
        let Some(last) = rows.last() else {
            return Ok(None);
        };
        let appended = Appended {
            first_sequence: (from.last_sequence + 1) as u64,
            last_sequence: last.sequence as u64,
            chain_head: last.digest.clone(),
        };
        let batch = append::Chained {
            bytes: stored_bytes(events),
            key_hash: key_hash.to_owned(),
            run_id: run_id.to_owned(),
            batch_key: batch_key.to_owned(),
            batch_digest: crate::domain::validate::batch_digest(events),
            from_sequence: from.last_sequence,
            rows,
        };
        if !self
            .append_groups(pool, self.event_quota)
            .append(batch)
            .await
        {
            self.tips.forget(run_id);
            return Ok(None);
        }
        self.remember_tip(run_id, &appended);
        runplane_telemetry::metrics::events_appended().add(events.len() as u64, &[]);
        Ok(Some(appended))
    }

    pub(super) fn append_groups(
        &self,
        pool: &sea_orm::sqlx::PgPool,
        quota: EventQuota,
    ) -> &append::AppendGroups {
        self.groups.get_or_init(|| {
            let clock = self.clock.clone();
            append::AppendGroups::start(&self.tasks, pool.clone(), quota, move || clock.now_us())
        })
    }

    /// Remembers a committed append's end as the run's tip, for its next append.
    pub(super) fn remember_tip(&self, run_id: &str, appended: &Appended) {
        if self.postgres {
            self.tips.remember(
                run_id,
                append::ChainTip {
                    last_sequence: appended.last_sequence as i64,
                    head: appended.chain_head.clone(),
                },
            );
        }
    }

    /// Appends a batch, deduped on its key inside the transaction: a replay writes
    /// nothing and gets the first answer; the same key with other events is refused.
    pub async fn append_events(
        &self,
        run_id: &str,
        batch_key: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let digest = crate::domain::validate::batch_digest(events);
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        if let Some(done) = self.find_batch(&txn, run_id, batch_key, &digest).await? {
            txn.commit().await?;
            return Ok(done);
        }
        if run.state.is_terminal() {
            return Err(terminal_error(&run));
        }
        self.check_event_quota(&run, events)?;
        let appended = self
            .append_locked(&txn, &run, batch_key, &digest, events)
            .await?;
        txn.commit().await?;
        self.remember_tip(run_id, &appended);
        runplane_telemetry::metrics::events_appended().add(events.len() as u64, &[]);
        Ok(appended)
    }

    /// Refuses a runner's batch that would take `run` past its [`EventQuota`].
    fn check_event_quota(&self, run: &run::Model, events: &[CheckedEvent]) -> Result<()> {
        let quota = self.event_quota;
        let refused =
            |quota: &'static str, limit: i64, what: &'static str| RunStoreError::QuotaExceeded {
                holder: "run",
                id: run.id.clone(),
                quota,
                limit: limit as u64,
                what,
                then: "this run stores no more events; its runner counts the rest in one \
                       events_lost event with its verdict",
            };
        if run.last_sequence + events.len() as i64 > quota.max_events {
            return Err(refused(
                "run_store.max_events_per_run",
                quota.max_events,
                "events stored at most",
            ));
        }
        if run.event_bytes + stored_bytes(events) > quota.max_bytes {
            return Err(refused(
                "run_store.max_event_bytes_per_run",
                quota.max_bytes,
                "bytes of events stored at most",
            ));
        }
        Ok(())
    }

    pub(super) async fn find_batch(
        &self,
        txn: &DatabaseTransaction,
        run_id: &str,
        batch_key: &str,
        digest: &str,
    ) -> Result<Option<Appended>> {
        let Some(batch) =
            event_batch::Entity::find_by_id((run_id.to_owned(), batch_key.to_owned()))
                .one(txn)
                .await?
        else {
            return Ok(None);
        };
        if batch.batch_digest != digest {
            return Err(RunStoreError::KeyReused { field: "batch_key" });
        }
        Ok(Some(Appended {
            first_sequence: batch.first_sequence as u64,
            last_sequence: batch.last_sequence as u64,
            chain_head: batch.chain_head,
        }))
    }

    /// Writes `events` after the run's last one, extending the chain, and the batch row;
    /// the caller holds the run lock and commits. Returns the new head.
    pub(super) async fn append_locked(
        &self,
        txn: &DatabaseTransaction,
        run: &run::Model,
        batch_key: &str,
        digest: &str,
        events: &[CheckedEvent],
    ) -> Result<Appended> {
        let now = self.now_us();
        let from = append::ChainTip {
            last_sequence: run.last_sequence,
            head: run.chain_head.clone(),
        };
        let rows = chain_rows(&run.id, &from, events, now);
        let (sequence, head) = rows
            .last()
            .map_or((from.last_sequence, from.head.clone()), |r| {
                (r.sequence, r.digest.clone())
            });
        // Insert in chunks: a statement has a bounded number of parameters.
        let mut rows = rows
            .into_iter()
            .map(IntoActiveModel::into_active_model)
            .peekable();
        while rows.peek().is_some() {
            let chunk: Vec<_> = rows.by_ref().take(500).collect();
            event::Entity::insert_many(chunk)
                .exec_without_returning(txn)
                .await?;
        }
        for (i, e) in events.iter().enumerate() {
            if e.kind == TURN_FAILED {
                let sequence = run.last_sequence + 1 + i as i64;
                self.owe_turn_failure(txn, run, format!("{}:{sequence}", run.id), &e.text)
                    .await?;
            }
        }
        let appended = Appended {
            first_sequence: (run.last_sequence + 1) as u64,
            last_sequence: sequence as u64,
            chain_head: head.clone(),
        };
        event_batch::Entity::insert(
            event_batch::Model {
                run_id: run.id.clone(),
                batch_key: batch_key.to_owned(),
                batch_digest: digest.to_owned(),
                first_sequence: appended.first_sequence as i64,
                last_sequence: sequence,
                chain_head: head.clone(),
            }
            .into_active_model(),
        )
        .exec_without_returning(txn)
        .await?;
        run::Entity::update_many()
            .col_expr(run::Column::LastSequence, Expr::value(sequence))
            .col_expr(
                run::Column::EventBytes,
                Expr::value(run.event_bytes + stored_bytes(events)),
            )
            .col_expr(run::Column::ChainHead, Expr::value(head))
            .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
            .filter(run::Column::Id.eq(run.id.as_str()))
            .exec(txn)
            .await?;
        Ok(appended)
    }

    /// Events after `after`, in order, at most `limit`.
    pub async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: u64,
    ) -> Result<Vec<event::Model>> {
        Ok(event::Entity::find()
            .filter(event::Column::RunId.eq(run_id))
            .filter(event::Column::Sequence.gt(after as i64))
            .order_by(event::Column::Sequence, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    pub async fn count_events(&self, run_id: &str) -> Result<u64> {
        Ok(event::Entity::find()
            .filter(event::Column::RunId.eq(run_id))
            .count(&self.db)
            .await?)
    }
}
