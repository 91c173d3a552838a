//! Admission: claiming slots for queued runs by fair share (`domain::share`).

use std::collections::BTreeMap;

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
        // Per credential: the granted orgs' next runs in one query, claimed in one
        // statement, whatever the number of orgs.
        // Each credential's orgs in the order the plan first granted them.
        let mut by_credential: BTreeMap<&str, Vec<(&str, u32)>> = BTreeMap::new();
        for grant in &plan.grants {
            let orgs = by_credential
                .entry(grant.credential_id.as_str())
                .or_default();
            match orgs.iter_mut().find(|(org, _)| *org == grant.org_id) {
                Some((_, runs)) => *runs += grant.runs,
                None => orgs.push((grant.org_id.as_str(), grant.runs)),
            }
        }
        for (credential_id, orgs) in by_credential {
            let ids = self.next_runs(&txn, credential_id, &orgs).await?;
            // Compare-and-set, all at once: a cancel that took a run first keeps it.
            run::Entity::update_many()
                .col_expr(run::Column::State, Expr::value(RunState::Starting))
                .col_expr(run::Column::WaitingReason, Expr::value(""))
                .col_expr(run::Column::UpdatedAtUs, Expr::value(now))
                .filter(run::Column::Id.is_in(ids.iter().cloned()))
                .filter(run::Column::State.eq(RunState::Queued))
                .exec(&txn)
                .await?;
            // Without their spec: the claim's answer is a list of many runs.
            let mut runs = basic(run::Entity::find())
                .filter(run::Column::Id.is_in(ids.iter().cloned()))
                .filter(run::Column::State.eq(RunState::Starting))
                .filter(run::Column::UpdatedAtUs.eq(now))
                .all(&txn)
                .await?;
            // In the order the plan granted them, as the answer promises.
            runs.sort_by_key(|r| ids.iter().position(|id| *id == r.id));
            claimed.extend(runs);
        }
        if !plan.passes.is_empty() {
            org_share::Entity::insert_many(plan.passes.iter().map(
                |((credential_id, org_id), pass)| {
                    org_share::Model {
                        credential_id: credential_id.clone(),
                        org_id: org_id.clone(),
                        pass: *pass,
                    }
                    .into_active_model()
                },
            ))
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
        // credential and per org at quota; only the runs whose reason changes are written,
        // and where this replica wrote the same reason lately, only the runs created since.
        let at_quota: Vec<&String> = plan.org_reasons.keys().collect();
        let mut written = Vec::new();
        let queued = || run::Column::State.eq(RunState::Queued);
        for (credential_id, why) in &plan.credential_reasons {
            let which = sea_orm::Condition::all()
                .add(queued())
                .add(run::Column::CredentialId.eq(credential_id.as_str()))
                .add(run::Column::OrgId.is_not_in(at_quota.iter().map(|o| o.as_str())));
            let key = format!("credential {credential_id} but {at_quota:?}");
            written.push(self.write_reason(&txn, which, key, why, now).await?);
        }
        for ((credential_id, org_id), why) in &plan.pair_reasons {
            let which = sea_orm::Condition::all()
                .add(queued())
                .add(run::Column::CredentialId.eq(credential_id.as_str()))
                .add(run::Column::OrgId.eq(org_id.as_str()));
            let key = format!("credential {credential_id} for org {org_id}");
            written.push(self.write_reason(&txn, which, key, why, now).await?);
        }
        for (org_id, why) in &plan.org_reasons {
            let which = sea_orm::Condition::all()
                .add(queued())
                .add(run::Column::OrgId.eq(org_id.as_str()));
            written.push(
                self.write_reason(&txn, which, format!("org {org_id}"), why, now)
                    .await?,
            );
        }
        txn.commit().await?;
        self.reasons.wrote(written, now);
        Ok(claimed)
    }
}

impl Store {
    /// Writes `why` as the waiting reason of the runs `which` selects whose reason
    /// differs; where this replica wrote the same under `key` lately, only to the runs
    /// created since ([`WrittenReasons`]). Returns what to record once committed.
    async fn write_reason(
        &self,
        txn: &DatabaseTransaction,
        which: sea_orm::Condition,
        key: String,
        why: &str,
        now: i64,
    ) -> Result<(String, String)> {
        let since = self.reasons.since(&key, why, now);
        run::Entity::update_many()
            .col_expr(run::Column::WaitingReason, Expr::value(why))
            .filter(which)
            .filter(run::Column::CreatedAtUs.gte(since))
            .filter(run::Column::WaitingReason.ne(why))
            .exec(txn)
            .await?;
        Ok((key, why.to_owned()))
    }

    /// The ids of the next queued runs of each org of `orgs` on `credential_id`, as many
    /// as it is granted, by priority then age: one query. On Postgres each org's are the
    /// first entries of its range of the `runs_queued` index (a lateral join per org), so
    /// the query reads only the runs it returns, however deep the queue.
    async fn next_runs(
        &self,
        txn: &DatabaseTransaction,
        credential_id: &str,
        orgs: &[(&str, u32)],
    ) -> Result<Vec<String>> {
        if self.postgres {
            let (names, counts): (Vec<String>, Vec<i64>) = orgs
                .iter()
                .map(|(org, n)| ((*org).to_owned(), i64::from(*n)))
                .unzip();
            let rows = txn
                .query_all_raw(sea_orm::Statement::from_sql_and_values(
                    sea_orm::DbBackend::Postgres,
                    "SELECT r.id FROM unnest($2::text[], $3::bigint[]) \
                         WITH ORDINALITY AS o(org_id, n, turn) \
                     CROSS JOIN LATERAL ( \
                         SELECT id, priority, created_at_us FROM runs \
                         WHERE state = 'queued' AND credential_id = $1 AND org_id = o.org_id \
                         ORDER BY priority DESC, created_at_us, id LIMIT o.n) r \
                     ORDER BY o.turn, r.priority DESC, r.created_at_us, r.id",
                    [credential_id.into(), names.into(), counts.into()],
                ))
                .await?;
            return rows
                .iter()
                .map(|row| row.try_get::<String>("", "id"))
                .collect::<std::result::Result<_, sea_orm::DbErr>>()
                .map_err(Into::into);
        }
        let most = orgs.iter().map(|(_, n)| *n).max().unwrap_or(0);
        use sea_orm::sea_query::{Alias, Func, Query, WindowStatement};
        let mut window = WindowStatement::partition_by(run::Column::OrgId);
        window
            .order_by(run::Column::Priority, Order::Desc)
            .order_by(run::Column::CreatedAtUs, Order::Asc)
            .order_by(run::Column::Id, Order::Asc);
        let queue = Query::select()
            .column(run::Column::Id)
            .column(run::Column::OrgId)
            .expr_window_as(
                Func::cust(Alias::new("ROW_NUMBER")),
                window,
                Alias::new("place"),
            )
            .from(run::Entity)
            .and_where(run::Column::State.eq(RunState::Queued))
            .and_where(run::Column::CredentialId.eq(credential_id))
            .and_where(run::Column::OrgId.is_in(orgs.iter().map(|(o, _)| (*o).to_owned())))
            .to_owned();
        let next = Query::select()
            .column(Alias::new("id"))
            .column(Alias::new("org_id"))
            .column(Alias::new("place"))
            .from_subquery(queue, Alias::new("queue"))
            .and_where(sea_orm::sea_query::ExprTrait::lte(
                Expr::col(Alias::new("place")),
                i64::from(most),
            ))
            .to_owned();
        let rows = txn
            .query_all_raw(txn.get_database_backend().build(&next))
            .await?;
        let mut ids = Vec::new();
        for row in &rows {
            let org = row.try_get::<String>("", "org_id")?;
            let granted = orgs.iter().find(|(o, _)| *o == org).map_or(0, |(_, n)| *n);
            if i64::from(granted) >= row.try_get::<i64>("", "place")? {
                ids.push(row.try_get::<String>("", "id")?);
            }
        }
        Ok(ids)
    }
}

/// How long a reason this replica wrote lets its next claims write only the runs created
/// since; past it a claim writes every run whose reason differs again, which also
/// catches what another replica or a late commit left.
const REWRITE_EVERY_US: i64 = 30_000_000;
/// How far before the last write a "created since" reaches: a run created just before
/// it may commit just after, and replicas' clocks differ a little.
const CREATED_MARGIN_US: i64 = 5_000_000;

/// The waiting reasons this replica's claims last wrote, and when: most claims find the
/// same reasons as the last, and need write only the runs queued since.
#[derive(Debug, Default)]
pub(super) struct WrittenReasons(std::sync::Mutex<HashMap<String, (String, i64)>>);

impl WrittenReasons {
    /// The oldest creation time a claim at `now` writes `why` under `key` for.
    fn since(&self, key: &str, why: &str, now: i64) -> i64 {
        match self.0.lock().expect("reasons poisoned").get(key) {
            Some((last, at)) if last == why && now - at < REWRITE_EVERY_US => {
                at - CREATED_MARGIN_US
            }
            _ => i64::MIN,
        }
    }

    /// Records what a committed claim at `now` wrote: a full write starts a new period.
    fn wrote(&self, written: Vec<(String, String)>, now: i64) {
        let mut map = self.0.lock().expect("reasons poisoned");
        for (key, why) in written {
            match map.get(&key) {
                Some((last, at)) if *last == why && now - at < REWRITE_EVERY_US => {}
                _ => {
                    map.insert(key, (why, now));
                }
            }
        }
    }
}
