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

/// `keep(key, ms)`: the key, if it exists, lives at least `ms` more (never shortened).
const KEEP: &str = r#"
local function keep(key, ms)
  local t = redis.call('PTTL', key)
  if t == -1 or (t >= 0 and t < ms) then redis.call('PEXPIRE', key, ms) end
end
"#;

/// A script whose body may call `keep`.
fn with_keep(body: &str) -> Script {
    Script::new(&format!("{KEEP}{body}"))
}

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    with_keep(
        r#"
local now = tonumber(ARGV[4])
local ttl = tonumber(ARGV[3])
local holder = redis.call('HGET', KEYS[1], 'controller')
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if holder and expires > now then
  if holder == ARGV[1] then
    redis.call('HSET', KEYS[1], 'expires', now + ttl)
    redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
    for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
    return {'ok', redis.call('HGET', KEYS[1], 'token'), now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next') or '1')}
  end
  return {'held', holder}
end
if redis.call('HGET', KEYS[2], 'granted') == '1' then
  return {'takeover'}
end
redis.call('HSET', KEYS[1], 'controller', ARGV[1], 'token', ARGV[2], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
redis.call('HSETNX', KEYS[2], 'next', 1)
redis.call('HSETNX', KEYS[2], 'first', 1)
redis.call('HSETNX', KEYS[2], 'bytes', 0)
redis.call('HSET', KEYS[2], 'granted', '1')
for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
return {'ok', ARGV[2], now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next'))}
"#,
    )
});

static RENEW: LazyLock<Script> = LazyLock::new(|| {
    with_keep(
        r#"
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return {'fenced'} end
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
if not holder then
  -- The lease key was lost (Redis restarted, evicted, flushed): nobody else holds it, so
  -- it is no fence; the run's own controller takes it back.
  redis.call('HSET', KEYS[1], 'controller', 'resynced', 'token', ARGV[1])
  redis.call('HSETNX', KEYS[2], 'next', 1)
  redis.call('HSETNX', KEYS[2], 'first', 1)
  redis.call('HSETNX', KEYS[2], 'bytes', 0)
  redis.call('HSET', KEYS[2], 'granted', '1')
end
redis.call('HSET', KEYS[1], 'expires', expires)
redis.call('HDEL', KEYS[1], 'parked')
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * tonumber(ARGV[4]))
for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[5])) end
return {'ok', expires}
"#,
    )
});

/// Parks a lease with a token: no expiry, no key TTL, until UNPARK (or a renewal).
static PARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if not redis.call('HGET', KEYS[1], 'token') then return 0 end
redis.call('HSET', KEYS[1], 'parked', '1', 'expires', ARGV[1])
redis.call('PERSIST', KEYS[1])
return 1
"#,
    )
});

static UNPARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'parked') ~= '1' then return 0 end
redis.call('HDEL', KEYS[1], 'parked')
redis.call('HSET', KEYS[1], 'expires', tonumber(ARGV[2]) + tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * tonumber(ARGV[3]))
return 1
"#,
    )
});

static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#,
    )
});

static APPEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return {'fenced'} end
local now = ARGV[2]
local max_frames = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local ttl = ARGV[5]
local lease_ttl = tonumber(ARGV[6])
local resync = ARGV[7] == '1'
local A = 10
local m = redis.call('HMGET', KEYS[2], 'next', 'first', 'bytes')
local next = tonumber(m[1] or '1')
local first = tonumber(m[2] or '1')
local bytes = tonumber(m[3] or '0')
local n = (#ARGV - A + 1) / 2
local from = tonumber(ARGV[A])
if from > next then
  if not resync then return {'gap', next} end
  -- The controller no longer holds the frames in between: the buffer restarts at its
  -- first frame, and readers get a replay_gap for what was lost.
  for s = first, next - 1 do
    redis.call('HDEL', KEYS[3], s)
    redis.call('HDEL', KEYS[4], s)
  end
  first, next = from, from
end
local add = 0
for i = 0, n - 1 do
  if tonumber(ARGV[A + 2 * i]) >= next then add = add + string.len(ARGV[A + 1 + 2 * i]) end
end
if bytes + add > budget then return {'budget'} end
if not holder then
  -- A lost lease key is no fence (see RENEW): the run's controller takes it back.
  redis.call('HSET', KEYS[1], 'controller', 'resynced', 'token', ARGV[1], 'expires', tonumber(now) + lease_ttl)
  redis.call('PEXPIRE', KEYS[1], lease_ttl * 4)
  redis.call('HSET', KEYS[2], 'granted', '1')
end
local stored = 0
local data, times = {}, {}
for i = 0, n - 1 do
  if tonumber(ARGV[A + 2 * i]) == next then
    data[#data + 1] = next
    data[#data + 1] = ARGV[A + 1 + 2 * i]
    times[#times + 1] = next
    times[#times + 1] = now
    next = next + 1
    stored = stored + 1
  end
end
if stored > 0 then
  redis.call('HSET', KEYS[3], unpack(data))
  redis.call('HSET', KEYS[4], unpack(times))
end
-- Trimmed in chunks: unpack() is bounded by Lua's stack (a lowered max_frames can trim
-- many at once).
while next - first > max_frames do
  local trimmed = {}
  while next - first > max_frames and #trimmed < 1000 do
    trimmed[#trimmed + 1] = first
    first = first + 1
  end
  redis.call('HDEL', KEYS[3], unpack(trimmed))
  redis.call('HDEL', KEYS[4], unpack(trimmed))
end
redis.call('HSET', KEYS[2], 'next', next, 'first', first, 'bytes', bytes + add)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[4], ttl)
-- Followers on every replica wake for new frames (ARGV[8] the channel, ARGV[9] the run).
if stored > 0 then redis.call('PUBLISH', ARGV[8], ARGV[9]) end
return {'ok', next, stored, budget - bytes - add, add}
"#,
    )
});

/// Reserve against an org's hourly byte budget (its own key and slot: cluster-safe).
static CHARGE_ORG: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local bytes, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + bytes > limit then return -1 end
used = redis.call('INCRBY', KEYS[1], bytes)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return limit - used
"#,
    )
});

/// Gives bytes back to a counter that still exists: a refund after the hour's counter
/// expired must not leave a negative key without a TTL behind.
static REFUND_ORG: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], ARGV[1]) end
return 0
"#,
    )
});

static READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local next = tonumber(redis.call('HGET', KEYS[1], 'next') or '1')
local first = tonumber(redis.call('HGET', KEYS[1], 'first') or '1')
local from = math.max(tonumber(ARGV[1]), first)
local last = math.min(next - 1, from + tonumber(ARGV[2]) - 1)
local out = {first, next}
for s = from, last do
  table.insert(out, s)
  table.insert(out, redis.call('HGET', KEYS[2], s) or '')
  table.insert(out, tonumber(redis.call('HGET', KEYS[3], s) or '0'))
end
return out
"#,
    )
});

static BUDGET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local now = tonumber(ARGV[1])
local holder = redis.call('HGET', KEYS[1], 'controller') or ''
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if expires <= now then holder = ''; expires = 0 end
local b = redis.call('HMGET', KEYS[2], 'attempts', 'claimed', 'not_before', 'exhausted')
return {holder, expires, tonumber(b[1] or '0'), tonumber(b[2] or '-1'), tonumber(b[3] or '-1'),
        b[4] or '0', tonumber(redis.call('HGET', KEYS[3], 'next') or '1'),
        redis.call('HGET', KEYS[1], 'parked') or '0'}
"#,
    )
});

/// Plan and claim in one step: a lease once granted (only a lost controller is replaced),
/// lease free, not exhausted, budget window, not_before, then the new token and
/// `{attempts, claimed, not_before}` together. The wait after the n-th takeover is
/// `ARGV[8 + n]`, computed by `policy::backoff_ms` (the one formula) for this claim's
/// jitter draw.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    with_keep(
        r#"
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[4])
local state_ttl = tonumber(ARGV[5])
local reset_after, max_attempts = tonumber(ARGV[6]), tonumber(ARGV[7])
local gc = ttl * tonumber(ARGV[8])
local l = redis.call('HMGET', KEYS[1], 'controller', 'token', 'expires', 'parked')
if l[4] == '1' then return {'held'} end
if l[1] and tonumber(l[3] or '0') > now then return {'held'} end
local m = redis.call('HMGET', KEYS[3], 'granted', 'next')
if m[1] ~= '1' then return {'no_controller'} end
local b = redis.call('HMGET', KEYS[2], 'attempts', 'claimed', 'not_before', 'exhausted')
if b[4] == '1' then return {'exhausted', 0} end
local attempts = tonumber(b[1] or '0')
local claimed = tonumber(b[2] or '0')
if attempts > 0 and now - claimed > reset_after then attempts = 0 end
if attempts >= max_attempts then
  redis.call('HSET', KEYS[2], 'exhausted', '1')
  redis.call('PEXPIRE', KEYS[2], state_ttl)
  return {'exhausted', 1}
end
if attempts > 0 and now < tonumber(b[3] or '0') then return {'wait', tonumber(b[3])} end
attempts = attempts + 1
local not_before = now + tonumber(ARGV[8 + attempts])
redis.call('HSET', KEYS[2], 'claim_token', ARGV[2], 'prev_attempts', b[1] or '',
  'prev_claimed', b[2] or '', 'prev_not_before', b[3] or '', 'prev_controller', l[1] or '',
  'prev_token', l[2] or '', 'prev_expires', l[3] or '',
  'attempts', attempts, 'claimed', now, 'not_before', not_before)
redis.call('PEXPIRE', KEYS[2], state_ttl)
redis.call('HSET', KEYS[1], 'controller', ARGV[3], 'token', ARGV[2], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], gc)
for k = 3, 5 do keep(KEYS[k], state_ttl) end
return {'claimed', attempts, tonumber(m[2] or '1'), not_before}
"#,
    )
});

/// Undoes the claim whose token is ARGV[1] if it is still the latest: the budget and the
/// lease go back to what the claim script stashed. The lease is restored only if the
/// claim's token still holds it.
static UNCLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[2], 'claim_token') ~= ARGV[1] then return 0 end
local p = redis.call('HMGET', KEYS[2], 'prev_attempts', 'prev_claimed', 'prev_not_before',
  'prev_controller', 'prev_token', 'prev_expires')
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  if p[4] and p[4] ~= '' then
    redis.call('HSET', KEYS[1], 'controller', p[4], 'token', p[5], 'expires', p[6])
  else
    redis.call('DEL', KEYS[1])
  end
end
local fields = {'attempts', 'claimed', 'not_before'}
for i = 1, 3 do
  if p[i] and p[i] ~= '' then
    redis.call('HSET', KEYS[2], fields[i], p[i])
  else
    redis.call('HDEL', KEYS[2], fields[i])
  end
end
redis.call('HDEL', KEYS[2], 'claim_token', 'prev_attempts', 'prev_claimed', 'prev_not_before',
  'prev_controller', 'prev_token', 'prev_expires')
return 1
"#,
    )
});

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
