//! A runner's append as one autocommit statement (Postgres).
//!
//! The checked path (authenticate, begin, lock the run, look the batch key up, insert
//! the events and the batch row, move the run's chain tip, commit) costs nine round trips
//! and holds the run's row lock across six of them. The same append fits in one
//! statement: it checks the key, the batch key and the run's tip, and writes the events,
//! the batch row and the new tip, all or nothing, holding the row lock only while it runs
//! and commits.
//!
//! Its one input from before the statement is the run's chain tip (last sequence and
//! head), which the digests of the new events are computed from. This replica remembers
//! the tip it last wrote or read for each run ([`ChainTips`]); the statement applies only
//! while the run is still at that tip, a compare-and-set under the run's row lock. Every
//! append moves `last_sequence` (a batch holds at least one event), so a stale tip
//! (another replica appended, a verdict's final batch, a replay racing its original)
//! never forks the chain: it makes the statement write nothing.
//!
//! Whenever the statement writes nothing, the caller takes the checked path, which
//! answers exactly as it always did: an unknown, foreign, revoked or superseded key, a
//! terminal or missing run, a batch key used before (replay or reuse), a tip that moved.
//! The key is checked in the statement against its stored row, so nothing about a key
//! is cached and a revoked key is refused at once on every replica.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use sea_orm::sqlx::{self, PgPool};
use sea_orm::{DbErr, RuntimeErr};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::entities::event;
use crate::domain::state::RunState;

/// Where a run's hash chain ends: the input of its next append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChainTip {
    pub last_sequence: i64,
    pub head: Vec<u8>,
}

/// Most runs whose tip one replica remembers; past it the memory starts over (a
/// forgotten tip costs one read of the run at its next append).
const MAX_REMEMBERED_TIPS: usize = 16_384;

/// The chain tip this replica last saw committed, per run. Hints only: the append
/// statement checks the tip it was computed from against the stored one.
#[derive(Debug, Default)]
pub(super) struct ChainTips {
    tips: Mutex<HashMap<String, ChainTip>>,
}

impl ChainTips {
    pub fn get(&self, run_id: &str) -> Option<ChainTip> {
        self.tips.lock().expect("chain tips").get(run_id).cloned()
    }

    /// Remembers a committed tip, unless a later one of the same run is known already
    /// (two appends of one run on this replica may finish in either order).
    pub fn remember(&self, run_id: &str, tip: ChainTip) {
        let mut tips = self.tips.lock().expect("chain tips");
        if tips.len() >= MAX_REMEMBERED_TIPS && !tips.contains_key(run_id) {
            tips.clear();
        }
        match tips.get_mut(run_id) {
            Some(known) if known.last_sequence >= tip.last_sequence => {}
            Some(known) => *known = tip,
            None => {
                tips.insert(run_id.to_owned(), tip);
            }
        }
    }

    pub fn forget(&self, run_id: &str) {
        self.tips.lock().expect("chain tips").remove(run_id);
    }
}

/// The run's stored tip, or `None` if there is no such run.
pub(super) async fn read_tip(pool: &PgPool, run_id: &str) -> Result<Option<ChainTip>, DbErr> {
    let row: Option<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT last_sequence, chain_head FROM runs WHERE id = $1")
            .bind(run_id)
            .fetch_optional(pool)
            .await
            .map_err(query_error)?;
    Ok(row.map(|(last_sequence, head)| ChainTip {
        last_sequence,
        head,
    }))
}

/// Appends of different runs that arrive while earlier ones are being written share
/// one statement and one commit (group commit): under load a replica pays one round trip
/// and one WAL flush per group instead of per append, and with one append in flight the
/// group is that append alone, sent at once.
pub(super) struct AppendGroups {
    queue: mpsc::UnboundedSender<Pending>,
}

/// Most appends one group holds, and the events past which it takes no more.
const MAX_GROUP_APPENDS: usize = 64;
const MAX_GROUP_EVENTS: usize = 2_000;

/// Groups written at once, each on its own connection: enough to overlap one group's
/// commit with the next group's statement, few enough that groups still form.
const GROUPS_IN_FLIGHT: usize = 4;

/// One append waiting for its group, and who waits for the answer.
struct Pending {
    append: Chained,
    applied: oneshot::Sender<bool>,
}

/// A batch whose events were chained from the run's tip at `from_sequence`.
pub(super) struct Chained {
    /// What its events add to the run's stored event bytes.
    pub bytes: i64,
    pub key_hash: String,
    pub run_id: String,
    pub batch_key: String,
    pub batch_digest: String,
    pub from_sequence: i64,
    /// The events, in order; at least one.
    pub rows: Vec<event::Model>,
}

impl Chained {
    fn last(&self) -> &event::Model {
        self.rows.last().expect("a batch holds events")
    }
}

impl std::fmt::Debug for AppendGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppendGroups").finish_non_exhaustive()
    }
}

/// The writer of append groups. Aborted at shutdown: what it has queued is answered
/// `false` and takes the checked path, as a failed group does. A panic is logged and the
/// writer restarts on the same queue; while it is down, appends take the checked path,
/// slower but answered exactly alike.
pub const APPEND_GROUPS_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "run-store.append-groups",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

impl AppendGroups {
    /// Starts the declared task that forms and writes the groups ([`APPEND_GROUPS_TASK`]);
    /// it ends when the store (the last sender) is dropped.
    pub fn start(
        tasks: &runplane_grpc::Tasks,
        pool: PgPool,
        quota: super::EventQuota,
        now_us: impl Fn() -> i64 + Send + Sync + 'static,
    ) -> Self {
        let (queue, pending) = mpsc::unbounded_channel();
        // Behind a lock so that a restarted writer takes the queue up again.
        let pending = Arc::new(tokio::sync::Mutex::new(pending));
        let now_us = Arc::new(now_us);
        tasks.spawn(APPEND_GROUPS_TASK, move |_| {
            let (pool, pending, now_us) = (pool.clone(), pending.clone(), now_us.clone());
            async move {
                let mut pending = pending.lock().await;
                write_groups(pool, &mut pending, quota, move || now_us()).await;
            }
        });
        Self { queue }
    }

    /// Appends `append` in the next group; `false` when it wrote nothing (see the module
    /// doc), including when its group failed as a whole.
    pub async fn append(&self, append: Chained) -> bool {
        let (applied, answer) = oneshot::channel();
        if self.queue.send(Pending { append, applied }).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

/// Takes what is queued into a group whenever a slot is free and writes it.
async fn write_groups(
    pool: PgPool,
    pending: &mut mpsc::UnboundedReceiver<Pending>,
    quota: super::EventQuota,
    now_us: impl Fn() -> i64,
) {
    let slots = Arc::new(Semaphore::new(GROUPS_IN_FLIGHT));
    // The runs of the groups being written. A run is in one group at a time, so two
    // groups of this replica never wait for each other's row locks.
    let writing: Arc<Mutex<HashSet<String>>> = Arc::default();
    while let Some(first) = pending.recv().await {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut group = Vec::new();
        let mut events = 0;
        let mut next = Some(first);
        while let Some(p) = next.take() {
            if writing
                .lock()
                .expect("runs being written")
                .insert(p.append.run_id.clone())
            {
                events += p.append.rows.len();
                group.push(p);
            } else {
                // Chained from the tip the run's append being written started from, so
                // it cannot apply; the checked path orders it after that one.
                let _ = p.applied.send(false);
            }
            if group.len() < MAX_GROUP_APPENDS && events < MAX_GROUP_EVENTS {
                next = pending.try_recv().ok();
            }
        }
        if group.is_empty() {
            continue;
        }
        let (pool, writing) = (pool.clone(), writing.clone());
        let now_us = now_us();
        tokio::spawn(async move {
            let applied = match append_group(&pool, &group, quota, now_us).await {
                Ok(applied) => applied,
                Err(e) => {
                    // The checked path retries each append on its own; a group that did
                    // commit is found there by its batch keys.
                    tracing::debug!(error = %e, appends = group.len(), "append group not written; appending one by one");
                    Vec::new()
                }
            };
            let mut runs = writing.lock().expect("runs being written");
            for (index, p) in group.into_iter().enumerate() {
                runs.remove(&p.append.run_id);
                let _ = p.applied.send(applied.contains(&(index as i32)));
            }
            drop(slot);
        });
    }
}

/// One statement for a group: for each append, the key must be live and of its run, at
/// the run's current generation; the run live and still at the tip the events were
/// chained from, and within its event quota; the batch key unused. The `UPDATE` moves the tips of the appends that
/// pass, and the inserts, which read its `RETURNING`, write their batch rows and events.
/// The `UPDATE` rechecks its conditions on the newest row version after a lock wait,
/// so a concurrent append, supersede or verdict makes that append write nothing. (Two
/// replicas' groups that share two runs could wait for each other; Postgres ends one
/// as a deadlock, and its appends take the checked path.)
const APPEND_GROUP: &str = r#"
WITH appends AS (
    SELECT * FROM unnest($1::integer[], $2::text[], $3::text[], $4::text[], $5::text[],
                         $6::bigint[], $7::bigint[], $8::bytea[], $20::bigint[])
        AS a(pos, run_id, key_hash, batch_key, batch_digest, from_sequence,
             to_sequence, head, bytes)
),
tip AS (
    UPDATE runs
    SET last_sequence = a.to_sequence, chain_head = a.head, updated_at_us = $9,
        event_bytes = runs.event_bytes + a.bytes
    FROM appends a
    WHERE runs.id = a.run_id
      AND runs.last_sequence = a.from_sequence
      AND a.to_sequence <= $21
      AND runs.event_bytes + a.bytes <= $22
      AND runs.state = ANY($10)
      AND runs.sandbox_generation = (
          SELECT k.sandbox_generation FROM run_keys k
          WHERE k.key_hash = a.key_hash AND k.run_id = a.run_id AND k.revoked_at_us IS NULL)
      AND NOT EXISTS (
          SELECT 1 FROM event_batches b WHERE b.run_id = a.run_id AND b.batch_key = a.batch_key)
    RETURNING a.*
),
batch AS (
    INSERT INTO event_batches
        (run_id, batch_key, batch_digest, first_sequence, last_sequence, chain_head)
    SELECT run_id, batch_key, batch_digest, from_sequence + 1, to_sequence, head FROM tip
),
appended AS (
    INSERT INTO events
        (run_id, sequence, kind, text, data, is_check, name, observed_at_us,
         recorded_at_us, digest)
    SELECT tip.run_id, e.sequence, e.kind, e.text, e.data, e.is_check, e.name,
           e.observed_at_us, $9, e.digest
    FROM unnest($11::integer[], $12::bigint[], $13::integer[], $14::text[], $15::text[],
                $16::boolean[], $17::text[], $18::bigint[], $19::bytea[])
             AS e(pos, sequence, kind, text, data, is_check, name, observed_at_us,
                  digest)
    JOIN tip ON tip.pos = e.pos
)
SELECT pos FROM tip
"#;

/// Writes a group; returns the indexes of the appends that applied.
async fn append_group(
    pool: &PgPool,
    group: &[Pending],
    quota: super::EventQuota,
    now_us: i64,
) -> Result<Vec<i32>, DbErr> {
    let appends = || group.iter().map(|p| &p.append);
    let rows = || {
        group
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.append.rows.iter().map(move |r| (i as i32, r)))
    };
    sqlx::query_scalar(APPEND_GROUP)
        .bind((0..group.len() as i32).collect::<Vec<_>>())
        .bind(appends().map(|a| a.run_id.as_str()).collect::<Vec<_>>())
        .bind(appends().map(|a| a.key_hash.as_str()).collect::<Vec<_>>())
        .bind(appends().map(|a| a.batch_key.as_str()).collect::<Vec<_>>())
        .bind(
            appends()
                .map(|a| a.batch_digest.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(appends().map(|a| a.from_sequence).collect::<Vec<_>>())
        .bind(appends().map(|a| a.last().sequence).collect::<Vec<_>>())
        .bind(
            appends()
                .map(|a| a.last().digest.as_slice())
                .collect::<Vec<_>>(),
        )
        .bind(now_us)
        .bind(RunState::LIVE.map(RunState::as_str).to_vec())
        .bind(rows().map(|(i, _)| i).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.sequence).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.kind).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.text.as_str()).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.data.as_str()).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.is_check).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.name.as_str()).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.observed_at_us).collect::<Vec<_>>())
        .bind(rows().map(|(_, r)| r.digest.as_slice()).collect::<Vec<_>>())
        .bind(appends().map(|a| a.bytes).collect::<Vec<_>>())
        .bind(quota.max_events)
        .bind(quota.max_bytes)
        .fetch_all(pool)
        .await
        .map_err(query_error)
}

fn query_error(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(e.into()))
}
