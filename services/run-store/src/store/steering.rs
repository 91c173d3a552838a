//! Steering: queued messages, acknowledgements and polls.

use super::*;

impl Store {
    /// Enqueues a steering message, deduped on (run, idempotency key). `on_terminal`
    /// says whether a terminal run still takes it (an abort does).
    pub async fn enqueue(
        &self,
        run_id: &str,
        kind: runstore_pb::SteeringKind,
        payload: Vec<u8>,
        idempotency_key: &str,
        accept_on_terminal: bool,
        max_pending: Option<u32>,
    ) -> Result<steering_message::Model> {
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let existing = steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::IdempotencyKey.eq(idempotency_key))
            .one(&txn)
            .await?;
        if let Some(existing) = existing {
            if existing.kind != kind as i32 || existing.payload != payload {
                return Err(RunStoreError::KeyReused {
                    field: "idempotency_key",
                });
            }
            txn.commit().await?;
            return Ok(existing);
        }
        if run.state.is_terminal() && !accept_on_terminal {
            return Err(terminal_error(&run));
        }
        // Counted under the run's lock, so concurrent enqueues never pass the bound.
        if let Some(bound) = max_pending {
            let pending = steering_message::Entity::find()
                .filter(steering_message::Column::RunId.eq(run_id))
                .filter(steering_message::Column::AckedAtUs.is_null())
                .count(&txn)
                .await?;
            if pending >= u64::from(bound) {
                return Err(RunStoreError::QuotaExceeded {
                    holder: "run",
                    id: run_id.to_owned(),
                    quota: "run_store.max_queued_steering_messages",
                    limit: bound.into(),
                    what: "steering messages not yet delivered",
                    then: "send it again once its runner has taken some",
                });
            }
        }
        let now = self.now_us();
        let sequence = run.steering_sequence + 1;
        let message = steering_message::Model {
            id: ids::new_message_id(),
            run_id: run_id.to_owned(),
            org_id: run.org_id.clone(),
            sequence,
            kind: kind as i32,
            payload,
            idempotency_key: idempotency_key.to_owned(),
            enqueued_at_us: now,
            acked_at_us: None,
            ack_outcome: None,
            ack_attempts: None,
        };
        steering_message::Entity::insert(message.clone().into_active_model())
            .exec_without_returning(&txn)
            .await?;
        run::Entity::update_many()
            .col_expr(run::Column::SteeringSequence, Expr::value(sequence))
            .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
            .filter(run::Column::Id.eq(run_id))
            .exec(&txn)
            .await?;
        txn.commit().await?;
        Ok(message)
    }

    /// Applies acknowledgements, all or nothing. Every id must name a message of this
    /// run (and so of its org); only a steer may be dropped. A message acknowledged
    /// before stays as it was. A steer newly dropped writes one `steer_undeliverable`
    /// event.
    pub async fn acknowledge(&self, run_id: &str, acks: &[Ack]) -> Result<()> {
        if acks.is_empty() {
            return Ok(());
        }
        let txn = self.write_tx().await?;
        let run = self.lock_run(&txn, run_id).await?;
        let found: HashMap<String, steering_message::Model> = steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::Id.is_in(acks.iter().map(|a| a.message_id.clone())))
            .all(&txn)
            .await?
            .into_iter()
            .map(|m| (m.id.clone(), m))
            .collect();
        for (index, ack) in acks.iter().enumerate() {
            let Some(message) = found.get(&ack.message_id) else {
                return Err(RunStoreError::AckInvalid {
                    index,
                    reason: "no such message for this run".into(),
                });
            };
            if ack.dropped && message.kind != runstore_pb::SteeringKind::Steer as i32 {
                return Err(RunStoreError::AckDropForbidden {
                    index,
                    kind: kind_name(message.kind),
                });
            }
        }
        let now = self.now_us();
        let mut undeliverable = Vec::new();
        for ack in acks {
            let outcome = if ack.dropped {
                "dropped_undeliverable"
            } else {
                "applied"
            };
            let marked = steering_message::Entity::update_many()
                .col_expr(steering_message::Column::AckedAtUs, Expr::value(now))
                .col_expr(steering_message::Column::AckOutcome, Expr::value(outcome))
                .col_expr(
                    steering_message::Column::AckAttempts,
                    Expr::value(ack.attempts.min(i32::MAX as u32) as i32),
                )
                .filter(steering_message::Column::Id.eq(ack.message_id.as_str()))
                .filter(steering_message::Column::AckedAtUs.is_null())
                .exec(&txn)
                .await?;
            if marked.rows_affected == 1 && ack.dropped {
                undeliverable.push(ack);
            }
        }
        if !undeliverable.is_empty() && !run.state.is_terminal() {
            let events: Vec<CheckedEvent> = undeliverable
                .iter()
                .map(|ack| CheckedEvent {
                    kind: runstore_pb::EventKind::SteerUndeliverable as i32,
                    text: String::new(),
                    data: serde_json::json!({
                        "message_id": ack.message_id,
                        "attempts": ack.attempts,
                        "error": ack.error,
                    })
                    .to_string(),
                    check: false,
                    name: "steer_undeliverable".into(),
                    observed_at_us: None,
                })
                .collect();
            let digest = crate::domain::validate::batch_digest(&events);
            // Keyed by the first dropped message: the ack that drops it happens once.
            let key = format!("ack:{}", undeliverable[0].message_id);
            self.append_locked(&txn, &run, &key, &digest, &events)
                .await?;
        }
        txn.commit().await?;
        Ok(())
    }

    /// Messages not yet acknowledged, in enqueue order.
    pub async fn pending_messages(
        &self,
        run_id: &str,
        limit: u64,
    ) -> Result<Vec<steering_message::Model>> {
        Ok(steering_message::Entity::find()
            .filter(steering_message::Column::RunId.eq(run_id))
            .filter(steering_message::Column::AckedAtUs.is_null())
            .order_by(steering_message::Column::Sequence, Order::Asc)
            .limit(limit)
            .all(&self.db)
            .await?)
    }

    pub async fn get_message(&self, id: &str) -> Result<Option<steering_message::Model>> {
        Ok(steering_message::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?)
    }
}
