//! Creating, finding, listing and versioning runs.

use super::*;

impl Store {
    /// Creates the run, or returns the one this org already created with the same
    /// client request id (`false`). A reused id with another body is refused.
    pub async fn create_run(&self, new: NewRun) -> Result<(run::Model, bool)> {
        if let Some(existing) = self
            .find_by_request(&new.org_id, &new.client_request_id)
            .await?
        {
            return same_request(existing, &new.request_digest).map(|r| (r, false));
        }
        let now = self.now_us();
        let id = ids::new_run_id();
        let model = run::Model {
            chain_head: chain::genesis(&id),
            id,
            org_id: new.org_id.clone(),
            lead_id: new.lead_id,
            client_request_id: new.client_request_id.clone(),
            request_digest: new.request_digest.clone(),
            state: RunState::Queued,
            credential_id: new.credential_id,
            profile: new.profile,
            command: new.command,
            args: serde_json::to_string(&new.args).expect("strings serialise"),
            labels: serde_json::to_string(&new.labels).expect("strings serialise"),
            sandbox_generation: 0,
            last_sequence: 0,
            steering_sequence: 0,
            verdict_outcome: None,
            verdict_reason: None,
            verdict_exit_code: None,
            verdict_signal: None,
            verdict_message: None,
            failure_tail: None,
            backend_error: None,
            traceparent: runplane_grpc::trace_context::current_traceparent().unwrap_or_default(),
            sandbox_id: String::new(),
            deadline_at_us: new.max_duration_us.map(|d| now.saturating_add(d)),
            waiting_reason: String::new(),
            priority: new.priority,
            events_pruned_through: 0,
            event_bytes: 0,
            waiting_since_us: 0,
            waiting_generation: 0,
            waiting_seq: 0,
            paused_at_us: 0,
            pause_ends_at_us: 0,
            pause_holds_deadline: 0,
            retries: 0,
            retry_at_us: 0,
            created_at_us: now,
            started_at_us: None,
            ended_at_us: None,
            updated_at_us: now,
        };
        match self.insert_under_quota(&model, new.max_queued).await? {
            Ok(()) => Ok((model, true)),
            // A concurrent create with the same id won the unique index; answer with its run.
            Err(e) if is_unique_violation(&e) => {
                let existing = self
                    .find_by_request(&new.org_id, &new.client_request_id)
                    .await?
                    .ok_or(RunStoreError::Storage(e))?;
                same_request(existing, &new.request_digest).map(|r| (r, false))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Inserts `run` unless its org already has `max_queued` runs queued. One lock per
    /// org holds the count and the insert together, so concurrent creates of one org
    /// never pass the quota (SQLite holds the database's write lock already).
    async fn insert_under_quota(
        &self,
        run: &run::Model,
        max_queued: Option<u32>,
    ) -> Result<std::result::Result<(), sea_orm::DbErr>> {
        let txn = self.write_tx().await?;
        if let Some(quota) = max_queued {
            if self.postgres {
                txn.execute_raw(sea_orm::Statement::from_sql_and_values(
                    sea_orm::DbBackend::Postgres,
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                    [format!("runplane.queued:{}", run.org_id).into()],
                ))
                .await?;
            }
            let queued = run::Entity::find()
                .filter(run::Column::State.eq(RunState::Queued))
                .filter(run::Column::OrgId.eq(run.org_id.as_str()))
                .count(&txn)
                .await?;
            if queued >= u64::from(quota) {
                return Err(RunStoreError::QuotaExceeded {
                    holder: "org",
                    id: run.org_id.clone(),
                    quota: "run_store.tenancy.max_queued_runs",
                    limit: quota.into(),
                    what: "runs queued",
                    then: "create it again once some have started",
                });
            }
        }
        // The insert's own failure (a concurrent create with the same id) is the
        // caller's to read.
        if let Err(e) = run::Entity::insert(run.clone().into_active_model())
            .exec_without_returning(&txn)
            .await
        {
            return Ok(Err(e));
        }
        let labels: std::collections::BTreeMap<String, String> =
            serde_json::from_str(&run.labels).unwrap_or_default();
        if !labels.is_empty() {
            run_label::Entity::insert_many(labels.into_iter().map(|(key, value)| {
                run_label::Model {
                    run_id: run.id.clone(),
                    key,
                    value,
                }
                .into_active_model()
            }))
            .exec_without_returning(&txn)
            .await?;
        }
        txn.commit().await?;
        Ok(Ok(()))
    }

    /// The run this org already created with `request_id`, if any; a reused id with
    /// another body is refused.
    pub async fn existing_run(
        &self,
        org: &str,
        request_id: &str,
        request_digest: &str,
    ) -> Result<Option<run::Model>> {
        match self.find_by_request(org, request_id).await? {
            Some(run) => same_request(run, request_digest).map(Some),
            None => Ok(None),
        }
    }

    pub(super) async fn find_by_request(
        &self,
        org: &str,
        request_id: &str,
    ) -> Result<Option<run::Model>> {
        Ok(run::Entity::find()
            .filter(run::Column::OrgId.eq(org))
            .filter(run::Column::ClientRequestId.eq(request_id))
            .one(&self.db)
            .await?)
    }

    pub async fn get_run(&self, run_id: &str) -> Result<run::Model> {
        run::Entity::find_by_id(run_id.to_owned())
            .one(&self.db)
            .await?
            .ok_or_else(|| RunStoreError::RunNotFound {
                run_id: run_id.to_owned(),
            })
    }

    /// The stored versions of `run_ids` (those that exist), for the watchers' re-check.
    pub async fn versions(
        &self,
        run_ids: Vec<String>,
    ) -> Result<Vec<(String, crate::changes::Version)>> {
        let rows: Vec<(String, i64, i64)> = run::Entity::find()
            .select_only()
            .column(run::Column::Id)
            .column(run::Column::LastSequence)
            .column(run::Column::UpdatedAtUs)
            .filter(run::Column::Id.is_in(run_ids))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(id, last_sequence, updated_at_us)| {
                let version = crate::changes::Version {
                    last_sequence,
                    updated_at_us,
                };
                (id, version)
            })
            .collect())
    }

    /// A page of runs, newest first.
    pub async fn list_runs(&self, filter: &RunFilter) -> Result<Vec<run::Model>> {
        let mut query = run::Entity::find();
        if filter.basic {
            query = basic(query);
        }
        if let Some(org) = &filter.org_id {
            query = query.filter(run::Column::OrgId.eq(org.as_str()));
        }
        if let Some(lead) = &filter.lead_id {
            query = query.filter(run::Column::LeadId.eq(lead.as_str()));
        }
        if let Some(credential) = &filter.credential_id {
            query = query.filter(run::Column::CredentialId.eq(credential.as_str()));
        }
        if let Some(profile) = &filter.profile {
            query = query.filter(run::Column::Profile.eq(profile.as_str()));
        }
        if !filter.states.is_empty() {
            query = query.filter(run::Column::State.is_in(filter.states.iter().copied()));
        }
        if !filter.run_ids.is_empty() {
            query = query.filter(run::Column::Id.is_in(filter.run_ids.iter().cloned()));
        }
        for term in &filter.labels {
            query = query.filter(label_condition(term));
        }
        if filter.paused_only {
            query = query.filter(run::Column::PausedAtUs.gt(0));
        }
        if filter.with_pending_messages {
            // EXISTS on the run's own messages (the (run_id, sequence) index), not a scan
            // of every message ever queued.
            query = query.filter(Expr::exists(
                sea_orm::sea_query::Query::select()
                    .expr(Expr::val(1))
                    .from(steering_message::Entity)
                    .and_where(sea_orm::sea_query::ExprTrait::equals(
                        Expr::col((steering_message::Entity, steering_message::Column::RunId)),
                        (run::Entity, run::Column::Id),
                    ))
                    .and_where(steering_message::Column::AckedAtUs.is_null())
                    .to_owned(),
            ));
        }
        if let Some((created, id)) = &filter.after {
            query = query.filter(
                sea_orm::Condition::any()
                    .add(run::Column::CreatedAtUs.lt(*created))
                    .add(
                        sea_orm::Condition::all()
                            .add(run::Column::CreatedAtUs.eq(*created))
                            .add(run::Column::Id.lt(id.as_str())),
                    ),
            );
        }
        Ok(query
            .order_by(run::Column::CreatedAtUs, Order::Desc)
            .order_by(run::Column::Id, Order::Desc)
            .limit(filter.limit)
            .all(&self.db)
            .await?)
    }

    /// Runs in STARTING or RUNNING, counted per credential, per profile and per
    /// (profile, credential) pair keyed `profile/credential`; only runs on one of
    /// `credential_ids` or in one of `profiles` when either is given (empty: all).
    pub async fn count_active(
        &self,
        credential_ids: &[String],
        profiles: &[String],
    ) -> Result<ActiveCounts> {
        let mut query = run::Entity::find();
        if !credential_ids.is_empty() || !profiles.is_empty() {
            query = query.filter(
                sea_orm::Condition::any()
                    .add(run::Column::CredentialId.is_in(credential_ids.iter().cloned()))
                    .add(run::Column::Profile.is_in(profiles.iter().cloned())),
            );
        }
        let rows: Vec<(String, String, i64)> = query
            .select_only()
            .column(run::Column::CredentialId)
            .column(run::Column::Profile)
            .column_as(run::Column::Id.count(), "n")
            .filter(run::Column::State.is_in(RunState::ACTIVE))
            .group_by(run::Column::CredentialId)
            .group_by(run::Column::Profile)
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut counts = ActiveCounts::default();
        let mut queued = run::Entity::find()
            .select_only()
            .column(run::Column::CredentialId)
            .column_as(run::Column::Id.count(), "n")
            .filter(run::Column::State.eq(RunState::Queued))
            .filter(run::Column::CredentialId.ne(""));
        if !credential_ids.is_empty() {
            queued = queued.filter(run::Column::CredentialId.is_in(credential_ids.iter().cloned()));
        }
        let queued: Vec<(String, i64)> = queued
            .group_by(run::Column::CredentialId)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (credential, n) in queued {
            counts
                .queued_by_credential
                .insert(credential, u32::try_from(n).unwrap_or(u32::MAX));
        }
        for (credential, profile, n) in rows {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            if !credential.is_empty() {
                *counts.by_credential.entry(credential.clone()).or_insert(0) += n;
            }
            if !profile.is_empty() {
                *counts.by_profile.entry(profile.clone()).or_insert(0) += n;
                if !credential.is_empty() {
                    *counts
                        .by_profile_credential
                        .entry(format!("{profile}/{credential}"))
                        .or_insert(0) += n;
                }
            }
        }
        Ok(counts)
    }
}

/// The condition a selector's term puts on runs: EXISTS (or NOT EXISTS) on the run's own
/// label rows, through the `(key, value, run_id)` index.
fn label_condition(term: &crate::domain::labels::Term) -> sea_orm::Condition {
    use crate::domain::labels::Term;
    let has = |key: &str, value: Option<&str>| {
        let mut rows = sea_orm::sea_query::Query::select();
        rows.expr(Expr::val(1))
            .from(run_label::Entity)
            .and_where(sea_orm::sea_query::ExprTrait::equals(
                Expr::col((run_label::Entity, run_label::Column::RunId)),
                (run::Entity, run::Column::Id),
            ))
            .and_where(run_label::Column::Key.eq(key));
        if let Some(value) = value {
            rows.and_where(run_label::Column::Value.eq(value));
        }
        Expr::exists(rows.to_owned())
    };
    match term {
        Term::Equals(k, v) => sea_orm::Condition::all().add(has(k, Some(v))),
        Term::NotEquals(k, v) => sea_orm::Condition::all().add(has(k, Some(v))).not(),
        Term::Exists(k) => sea_orm::Condition::all().add(has(k, None)),
        Term::NotExists(k) => sea_orm::Condition::all().add(has(k, None)).not(),
    }
}

impl Store {
    /// Records whether `run_id`'s agent waits for input, as observed at `(generation,
    /// seq)`: one compare-and-set UPDATE, so an observation no newer than the stored one,
    /// or one for a run that is not RUNNING, changes nothing (`false`). A parked agent
    /// keeps the time it was first seen parked.
    pub async fn report_waiting(
        &self,
        run_id: &str,
        generation: i64,
        seq: i64,
        waiting: bool,
    ) -> Result<bool> {
        use sea_orm::sea_query::{Cond, Expr, SimpleExpr};
        let now = self.now_us();
        let since: SimpleExpr = if waiting {
            Expr::case(
                run::Column::WaitingSinceUs.gt(0),
                Expr::col(run::Column::WaitingSinceUs),
            )
            .finally(now)
            .into()
        } else {
            Expr::value(0i64)
        };
        let newer = Cond::any()
            .add(run::Column::WaitingGeneration.lt(generation))
            .add(
                Cond::all()
                    .add(run::Column::WaitingGeneration.eq(generation))
                    .add(run::Column::WaitingSeq.lt(seq)),
            );
        let txn = self.write_tx().await?;
        let updated = run::Entity::update_many()
            .col_expr(run::Column::WaitingSinceUs, since)
            .col_expr(run::Column::WaitingGeneration, Expr::value(generation))
            .col_expr(run::Column::WaitingSeq, Expr::value(seq))
            .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
            .filter(run::Column::Id.eq(run_id))
            .filter(run::Column::State.eq(RunState::Running))
            .filter(newer)
            .exec(&txn)
            .await?;
        let applied = updated.rows_affected == 1;
        // A wait that began with this observation is owed to the webhooks, once per wait.
        if applied
            && waiting
            && let Some(run) = run::Entity::find_by_id(run_id.to_owned()).one(&txn).await?
            && run.waiting_since_us == now
        {
            self.owe_webhooks_of(&txn, &run, "run.waiting_for_input", now, Some(now))
                .await?;
        }
        txn.commit().await?;
        Ok(applied)
    }
}
