//! The index of runs the sweep walks (a sorted set beside the runs' keys, written outside
//! the scripts and only ever read as a hint), and forgetting a run the sweep settled.

use std::time::{Duration, Instant};

use super::connection::RedisStore;
use crate::domain::policy::STATE_TTL;
use crate::store::Result;

/// A run this process wrote into the index less than this long ago is not written
/// again: the index is a hint for the sweep, and an hourly write per active run keeps it
/// (and its `STATE_TTL`) alive, and rebuilds it within the hour if Redis lost it.
const REINDEX_AFTER: Duration = Duration::from_secs(3600);
/// Past this many runs remembered, the memo starts afresh (bounded memory).
const INDEXED_MEMO_MAX: usize = 100_000;

impl RedisStore {
    /// Writes `run` into the index of runs the sweep walks, unless this process did so
    /// within `REINDEX_AFTER` (one round trip saved on every claim and re-acquire).
    pub(super) async fn remember(&self, run: &str) -> Result<()> {
        let fresh = |at: &Instant| at.elapsed() < REINDEX_AFTER;
        if self
            .indexed
            .lock()
            .expect("index memo")
            .get(run)
            .is_some_and(fresh)
        {
            return Ok(());
        }
        self.write_index(run).await?;
        let mut memo = self.indexed.lock().expect("index memo");
        if memo.len() >= INDEXED_MEMO_MAX {
            memo.clear();
        }
        memo.insert(run.to_owned(), Instant::now());
        Ok(())
    }

    async fn write_index(&self, run: &str) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: () = redis::pipe()
            .atomic()
            .cmd("ZADD")
            .arg(self.index())
            .arg(0)
            .arg(run)
            .ignore()
            .cmd("PEXPIRE")
            .arg(self.index())
            .arg(STATE_TTL.as_millis() as u64)
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }
}

pub(super) async fn forget(store: &RedisStore, run: &str) -> Result<()> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let _: i64 = redis::cmd("DEL")
        .arg(&k.lease)
        .arg(&k.meta)
        .arg(&k.frames)
        .arg(&k.times)
        .arg(&k.budget)
        .query_async(&mut conn)
        .await?;
    store.indexed.lock().expect("index memo").remove(run);
    let _: i64 = redis::cmd("ZREM")
        .arg(store.index())
        .arg(run)
        .query_async(&mut conn)
        .await?;
    Ok(())
}

pub(super) async fn runs(store: &RedisStore, cursor: &str, limit: usize) -> Result<Vec<String>> {
    let mut conn = store.conn.clone();
    let from = if cursor.is_empty() {
        "-".to_owned()
    } else {
        format!("({cursor}")
    };
    Ok(redis::cmd("ZRANGEBYLEX")
        .arg(store.index())
        .arg(from)
        .arg("+")
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(&mut conn)
        .await?)
}
