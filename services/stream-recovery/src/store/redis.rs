//! The Redis store. Every change that touches more than one key, or reads then writes, is
//! one Lua script, loaded once and re-loaded on `NOSCRIPT` (the `redis` crate's
//! `Script` does both). A run's keys share the hash tag `{run:<id>}`, so every script
//! touches one slot and Redis Cluster works; the index of runs (for the sweep) is a
//! separate key written outside the scripts, and only ever read as a hint.
//!
//! Every key expires (Redis server time; garbage collection only, decisions use the
//! caller's `now`): a lease key `LEASE_GC_FACTOR` leases after its last grant or renewal
//! (a parked one never, until unparked); a run's meta and buffer `STATE_TTL` after its
//! last grant, renewal or claim (a lost controller stays known as lost) and `limits.ttl`
//! after its last append; a budget `STATE_TTL` after its last
//! claim; the index `STATE_TTL` after its last entry; an org's hourly counter
//! `ORG_HOUR_TTL` after its last charge. The memory store mirrors exactly this.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, ScriptInvocation, Value};
use runplane_config::RedisTarget;
use runplane_grpc::tasks::AbortOnDrop;
use runplane_grpc::wake::Wakeups;

use super::{
    Acquired, Appended, BudgetState, ClaimArgs, ClaimOutcome, RecoveryStore, Replay, Result,
    StoreError, StoredFrame,
};
use crate::domain::policy::{
    BufferLimits, DEFAULT_LEASE_TTL, LEASE_GC_FACTOR, MAX_ATTEMPTS, ORG_HOUR_TTL, RESET_AFTER,
    STATE_TTL, backoff_ms,
};

// Each script lives in its own file under `redis/lua/`, headed by its KEYS, ARGV and
// reply.

/// `keep(key, ms)`, prepended to the scripts that call it.
const KEEP: &str = include_str!("redis/lua/keep.lua");

/// A script whose body may call `keep`.
fn with_keep(body: &str) -> Script {
    Script::new(&format!("{KEEP}{body}"))
}

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| with_keep(include_str!("redis/lua/acquire_lease.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| with_keep(include_str!("redis/lua/renew_lease.lua")));
static PARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/park_lease.lua")));
static UNPARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/unpark_lease.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/release_lease.lua")));
static APPEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/append_frames.lua")));
static CHARGE_ORG: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/charge_org.lua")));
static REFUND_ORG: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/refund_org.lua")));
static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/read_frames.lua")));
static BUDGET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/read_budget.lua")));
static CLAIM: LazyLock<Script> = LazyLock::new(|| with_keep(include_str!("redis/lua/claim.lua")));
static UNCLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("redis/lua/unclaim.lua")));

/// The Redis-backed store; cheap to clone (one multiplexed, reconnecting connection, or
/// the cluster client's connections, one per master, routed by each script's first key).
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    /// When this process last wrote each run into the index (see `remember`).
    indexed: Arc<Mutex<HashMap<String, Instant>>>,
    wakeups: Wakeups,
    /// The subscriber relaying every replica's changes to `wakeups`; stops with the
    /// last clone of the store.
    _listener: Arc<AbortOnDrop<()>>,
}

/// Relays the runs published on `channel` (by every replica's scripts and changes) to
/// this process's followers. Subscribes on one server (in a cluster any node hears every
/// node's PUBLISH), moving to the next seed when it fails; after a reconnect everyone is
/// woken, since what was published meanwhile is gone.
async fn relay_changes(servers: Vec<String>, channel: String, wakeups: Wakeups) {
    use futures::StreamExt;
    for server in servers.iter().cycle() {
        let subscribed = async {
            let mut pubsub = redis::Client::open(server.as_str())?
                .get_async_pubsub()
                .await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(mut pubsub) => {
                wakeups.wake_all();
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    if let Ok(run) = message.get_payload::<String>() {
                        wakeups.wake(&run);
                    }
                }
                tracing::debug!(server = %runplane_config::redact_url(server), "stream changes subscription ended; resubscribing");
            }
            Err(e) => {
                tracing::debug!(server = %runplane_config::redact_url(server), error = %e, "cannot subscribe to stream changes; trying the next server in 1 s");
            }
        }
        wakeups.wake_all();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A run this process wrote into the index less than this long ago is not written
/// again: the index is a hint for the sweep, and an hourly write per active run keeps it
/// (and its `STATE_TTL`) alive, and rebuilds it within the hour if Redis lost it.
const REINDEX_AFTER: Duration = Duration::from_secs(3600);
/// Past this many runs remembered, the memo starts afresh (bounded memory).
const INDEXED_MEMO_MAX: usize = 100_000;

/// One server or a cluster. Every script's keys share the run's (or org's) hash tag, so
/// the cluster client sends each whole script to the one master that owns the slot; a
/// script's `SCRIPT LOAD` on `NOSCRIPT` goes to every master.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

struct Keys {
    lease: String,
    meta: String,
    frames: String,
    times: String,
    budget: String,
}

fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        other => text(other).parse().unwrap_or_default(),
    }
}

fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        other => text(other).into_bytes(),
    }
}

impl RedisStore {
    /// Connects to `url`, in any form `[stream_recovery].redis_url` takes (one server, or
    /// a cluster by `redis+cluster://` or a comma-separated list of seeds).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        let target =
            RedisTarget::parse(url).map_err(|reason| StoreError::Backend(reason.to_owned()))?;
        Self::connect_to(&target, prefix).await
    }

    pub async fn connect_to(target: &RedisTarget, prefix: &str) -> Result<Self> {
        let conn = match target {
            RedisTarget::Single(url) => {
                Conn::Single(ConnectionManager::new(redis::Client::open(url.as_str())?).await?)
            }
            RedisTarget::Cluster(seeds) => Conn::Cluster(
                redis::cluster::ClusterClient::new(seeds.iter().map(String::as_str))?
                    .get_async_connection()
                    .await?,
            ),
            RedisTarget::Memory => {
                return Err(StoreError::Backend(
                    "memory:// is the in-process store, not Redis".to_owned(),
                ));
            }
        };
        let servers = match target {
            RedisTarget::Single(url) => vec![url.clone()],
            RedisTarget::Cluster(seeds) => seeds.clone(),
            RedisTarget::Memory => Vec::new(),
        };
        let wakeups = Wakeups::new();
        let listener = tokio::spawn(relay_changes(
            servers,
            format!("{prefix}changes"),
            wakeups.clone(),
        ));
        Ok(Self {
            conn,
            prefix: prefix.to_owned(),
            indexed: Arc::default(),
            wakeups,
            _listener: Arc::new(AbortOnDrop(listener)),
        })
    }

    /// The channel every replica publishes the runs it changed on.
    fn channel(&self) -> String {
        format!("{}changes", self.prefix)
    }

    /// Wakes this process's followers of `run` at once and tells the other replicas. A
    /// publish that fails is only logged: their tails still re-read on their heartbeat.
    async fn changed(&self, run: &str) {
        self.wakeups.wake(run);
        let mut conn = self.conn.clone();
        let published: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(self.channel())
            .arg(run)
            .query_async(&mut conn)
            .await;
        if let Err(e) = published {
            tracing::debug!(run_id = run, error = %e, "stream change not published");
        }
    }

    /// Every key a run's scripts are given (lease, meta, frames, times, budget): one hash
    /// tag, so one cluster slot.
    pub fn run_keys(&self, run: &str) -> [String; 5] {
        let Keys {
            lease,
            meta,
            frames,
            times,
            budget,
        } = self.keys(run);
        [lease, meta, frames, times, budget]
    }

    fn keys(&self, run: &str) -> Keys {
        let tag = format!("{}{{run:{run}}}", self.prefix);
        Keys {
            lease: format!("{tag}:lease"),
            meta: format!("{tag}:meta"),
            frames: format!("{tag}:frames"),
            times: format!("{tag}:times"),
            budget: format!("{tag}:budget"),
        }
    }

    /// The CLAIM script call `claim` makes, exactly (the benchmark's raw baseline runs it
    /// with a bare EVALSHA).
    pub fn claim_invocation(&self, run: &str, a: &ClaimArgs<'_>) -> ScriptInvocation<'static> {
        let k = self.keys(run);
        let mut invocation = CLAIM.prepare_invoke();
        invocation
            .key(&k.lease)
            .key(&k.budget)
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(a.now_ms)
            .arg(a.token)
            .arg(a.controller)
            .arg(a.lease_ttl_ms)
            .arg(STATE_TTL.as_millis() as u64)
            .arg(RESET_AFTER.as_millis() as u64)
            .arg(MAX_ATTEMPTS)
            .arg(LEASE_GC_FACTOR);
        for attempt in 1..=MAX_ATTEMPTS {
            invocation.arg(backoff_ms(attempt, a.jitter));
        }
        invocation
    }

    /// The APPEND script call `append` makes, exactly.
    pub fn append_invocation(
        &self,
        run: &str,
        token: &str,
        frames: &[(u64, Vec<u8>)],
        now_ms: i64,
        limits: &BufferLimits,
        resync: bool,
    ) -> ScriptInvocation<'static> {
        let k = self.keys(run);
        let mut invocation = APPEND.prepare_invoke();
        invocation
            .key(&k.lease)
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(token)
            .arg(now_ms)
            .arg(limits.max_frames)
            .arg(limits.stream_bytes)
            .arg(limits.ttl.as_millis() as u64)
            .arg(DEFAULT_LEASE_TTL.as_millis() as u64)
            .arg(if resync { "1" } else { "0" })
            .arg(self.channel())
            .arg(run);
        for (sequence, data) in frames {
            invocation.arg(*sequence).arg(data.as_slice());
        }
        invocation
    }

    fn index(&self) -> String {
        format!("{}runs", self.prefix)
    }

    /// Writes `run` into the index of runs the sweep walks, unless this process did so
    /// within `REINDEX_AFTER` (one round trip saved on every claim and re-acquire).
    async fn remember(&self, run: &str) -> Result<()> {
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

#[async_trait]
impl RecoveryStore for RedisStore {
    fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }

    async fn acquire(
        &self,
        run: &str,
        controller: &str,
        token: &str,
        ttl_ms: i64,
        now_ms: i64,
    ) -> Result<Acquired> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let out: Vec<Value> = ACQUIRE
            .key(&k.lease)
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(controller)
            .arg(token)
            .arg(ttl_ms)
            .arg(now_ms)
            .arg(LEASE_GC_FACTOR)
            .arg(STATE_TTL.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        match text(&out[0]).as_str() {
            "ok" => {
                self.remember(run).await?;
                self.changed(run).await;
                Ok(Acquired {
                    token: text(&out[1]),
                    expires_ms: int(&out[2]),
                    next_sequence: int(&out[3]) as u64,
                })
            }
            "held" => Err(StoreError::Held {
                controller: text(&out[1]),
            }),
            _ => Err(StoreError::TakeoverRequired),
        }
    }

    async fn renew(&self, run: &str, token: &str, ttl_ms: i64, now_ms: i64) -> Result<i64> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let out: Vec<Value> = RENEW
            .key(&k.lease)
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(token)
            .arg(ttl_ms)
            .arg(now_ms)
            .arg(LEASE_GC_FACTOR)
            .arg(STATE_TTL.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        match text(&out[0]).as_str() {
            "ok" => Ok(int(&out[1])),
            _ => Err(StoreError::Fenced),
        }
    }

    async fn release(&self, run: &str, token: &str) -> Result<bool> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let released: i64 = RELEASE
            .key(&k.lease)
            .arg(token)
            .invoke_async(&mut conn)
            .await?;
        if released == 1 {
            self.changed(run).await;
        }
        Ok(released == 1)
    }

    async fn append(
        &self,
        run: &str,
        token: &str,
        frames: &[(u64, Vec<u8>)],
        now_ms: i64,
        limits: &BufferLimits,
        resync: bool,
    ) -> Result<Appended> {
        let mut conn = self.conn.clone();
        let out: Vec<Value> = self
            .append_invocation(run, token, frames, now_ms, limits, resync)
            .invoke_async(&mut conn)
            .await?;
        match text(&out[0]).as_str() {
            "ok" => {
                // The script published the frames to the other replicas.
                self.wakeups.wake(run);
                Ok(Appended {
                    next_sequence: int(&out[1]) as u64,
                    stored: int(&out[2]) as u32,
                    stream_bytes_remaining: int(&out[3]).max(0) as u64,
                    stored_bytes: int(&out[4]).max(0) as u64,
                })
            }
            "gap" => Err(StoreError::Gap {
                next: int(&out[1]) as u64,
            }),
            "budget" => Err(StoreError::BudgetExceeded { scope: "stream" }),
            _ => Err(StoreError::Fenced),
        }
    }

    async fn read(&self, run: &str, from: u64, max: usize) -> Result<Replay> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let out: Vec<Value> = READ
            .key(&k.meta)
            .key(&k.frames)
            .key(&k.times)
            .arg(from)
            .arg(max)
            .invoke_async(&mut conn)
            .await?;
        let frames = out[2..]
            .chunks(3)
            .map(|c| StoredFrame {
                sequence: int(&c[0]) as u64,
                data: bytes(&c[1]),
                appended_ms: int(&c[2]),
            })
            .collect();
        Ok(Replay {
            first_available: int(&out[0]) as u64,
            next_sequence: int(&out[1]) as u64,
            frames,
        })
    }

    async fn budget(&self, run: &str, now_ms: i64) -> Result<BudgetState> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let out: Vec<Value> = BUDGET
            .key(&k.lease)
            .key(&k.budget)
            .key(&k.meta)
            .arg(now_ms)
            .invoke_async(&mut conn)
            .await?;
        let holder = text(&out[0]);
        let optional = |v: i64| (v >= 0).then_some(v);
        Ok(BudgetState {
            lease: (!holder.is_empty()).then(|| (holder, int(&out[1]))),
            attempts: int(&out[2]) as u32,
            claimed_ms: optional(int(&out[3])),
            not_before_ms: optional(int(&out[4])),
            exhausted: text(&out[5]) == "1",
            next_sequence: int(&out[6]) as u64,
            parked: text(&out[7]) == "1",
        })
    }

    async fn claim(&self, run: &str, a: &ClaimArgs<'_>) -> Result<ClaimOutcome> {
        let mut conn = self.conn.clone();
        let out: Vec<Value> = self
            .claim_invocation(run, a)
            .invoke_async(&mut conn)
            .await?;
        let outcome = match text(&out[0]).as_str() {
            "held" => ClaimOutcome::LeaseHeld,
            "no_controller" => ClaimOutcome::NoControllerYet,
            "wait" => ClaimOutcome::Wait {
                not_before_ms: int(&out[1]),
            },
            "exhausted" => ClaimOutcome::Exhausted {
                newly: int(&out[1]) == 1,
            },
            _ => ClaimOutcome::Claimed {
                attempt: int(&out[1]) as u32,
                next_sequence: int(&out[2]) as u64,
                not_before_ms: int(&out[3]),
            },
        };
        // The index entry is part of the claim's effects: without it the sweep could not
        // find the run, so a failed ZADD undoes the claim (compensation, as in plan()).
        if matches!(outcome, ClaimOutcome::Claimed { .. })
            && let Err(e) = self.remember(run).await
        {
            if let Err(undo) = self.unclaim(run, a.token).await {
                tracing::error!(run_id = run, cause = %undo, "claim not undone; its lease lapses");
            }
            return Err(e);
        }
        if matches!(
            outcome,
            ClaimOutcome::Claimed { .. } | ClaimOutcome::Exhausted { newly: true }
        ) {
            self.changed(run).await;
        }
        Ok(outcome)
    }

    async fn unclaim(&self, run: &str, token: &str) -> Result<bool> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let undone: i64 = UNCLAIM
            .key(&k.lease)
            .key(&k.budget)
            .arg(token)
            .invoke_async(&mut conn)
            .await?;
        if undone == 1 {
            self.changed(run).await;
        }
        Ok(undone == 1)
    }

    async fn charge_org(&self, org: &str, hour: i64, bytes: u64, limit: u64) -> Result<u64> {
        let mut conn = self.conn.clone();
        let key = format!("{}{{org:{org}}}:bytes:{hour}", self.prefix);
        let left: i64 = CHARGE_ORG
            .key(key)
            .arg(bytes)
            .arg(limit)
            .arg(ORG_HOUR_TTL.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        if left < 0 {
            return Err(StoreError::BudgetExceeded { scope: "org_hour" });
        }
        Ok(left as u64)
    }

    async fn refund_org(&self, org: &str, hour: i64, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let key = format!("{}{{org:{org}}}:bytes:{hour}", self.prefix);
        let _: i64 = REFUND_ORG
            .key(key)
            .arg(bytes)
            .invoke_async(&mut conn)
            .await?;
        Ok(())
    }

    async fn park(&self, run: &str) -> Result<bool> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let parked: i64 = PARK
            .key(&k.lease)
            .arg(super::PARKED_EXPIRES_MS)
            .invoke_async(&mut conn)
            .await?;
        if parked == 1 {
            self.changed(run).await;
        }
        Ok(parked == 1)
    }

    async fn unpark(&self, run: &str, ttl_ms: i64, now_ms: i64) -> Result<bool> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let unparked: i64 = UNPARK
            .key(&k.lease)
            .arg(ttl_ms)
            .arg(now_ms)
            .arg(LEASE_GC_FACTOR)
            .invoke_async(&mut conn)
            .await?;
        if unparked == 1 {
            self.changed(run).await;
        }
        Ok(unparked == 1)
    }

    async fn forget(&self, run: &str) -> Result<()> {
        let k = self.keys(run);
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("DEL")
            .arg(&k.lease)
            .arg(&k.meta)
            .arg(&k.frames)
            .arg(&k.times)
            .arg(&k.budget)
            .query_async(&mut conn)
            .await?;
        self.indexed.lock().expect("index memo").remove(run);
        let _: i64 = redis::cmd("ZREM")
            .arg(self.index())
            .arg(run)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    async fn runs(&self, cursor: &str, limit: usize) -> Result<Vec<String>> {
        let mut conn = self.conn.clone();
        let from = if cursor.is_empty() {
            "-".to_owned()
        } else {
            format!("({cursor}")
        };
        Ok(redis::cmd("ZRANGEBYLEX")
            .arg(self.index())
            .arg(from)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await?)
    }
}
