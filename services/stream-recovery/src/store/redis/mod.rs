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
//! `limits.org_counter_ttl_ms()` after its last charge. The memory store mirrors exactly this.
//!
//! Here are the connection and `RecoveryStore`; each operation lives with its concern:
//! [`leases`], [`claims`] (the restart budget), [`frames`] (the replay buffer and the
//! org's hourly bytes), [`index`] (the runs the sweep walks), [`relay`] (changes between
//! replicas); [`scripts`] loads the Lua under `lua/`, [`keys`] names the keys, [`reply`]
//! reads the answers.

mod claims;
mod connection;
mod frames;
mod index;
mod keys;
mod leases;
mod relay;
mod reply;
mod scripts;

pub use connection::RedisStore;

use std::sync::Arc;

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use runplane_config::{RedisTarget, StreamRecoveryConfig};
use runplane_grpc::notifier::Notifier;

use crate::domain::policy::BufferLimits;
use crate::store::{
    Acquired, Appended, BudgetState, ClaimArgs, ClaimOutcome, RecoveryStore, Replay, Result,
    StoreError,
};
use connection::{Conn, certificates, client};
use relay::relay_changes;

/// The relay of the other replicas' changes (`relay::relay_changes`). Aborted when the
/// store is dropped; a panic is logged and the relay starts again after the pause,
/// waking every follower once it is subscribed, since what was published meanwhile is
/// gone. Its followers' heartbeats re-read in the meantime.
const RELAY_TASK: runplane_grpc::Task = runplane_grpc::Task {
    name: "stream-recovery.relay",
    on_cancel: runplane_grpc::OnCancel::Abort,
    on_panic: runplane_grpc::OnPanic::Restart,
};

impl RedisStore {
    /// Connects to the Redis `[stream_recovery]` names: `redis_url`, its servers'
    /// certificates checked against `redis_ca_file` when set, keys under `key_prefix`.
    pub async fn open(config: &StreamRecoveryConfig) -> Result<Self> {
        let target = config
            .target()
            .map_err(|reason| StoreError::Backend(reason.to_owned()))?;
        let ca = match config.redis_ca_file.as_str() {
            "" => None,
            path => Some(std::fs::read(path).map_err(|e| {
                StoreError::Backend(format!(
                    "cannot read stream_recovery.redis_ca_file {path}: {e}"
                ))
            })?),
        };
        Self::connect_to(&target, ca.as_deref(), &config.key_prefix).await
    }

    /// Connects to `url`, in any form `[stream_recovery].redis_url` takes (one server, or
    /// a cluster by `redis+cluster://` or a comma-separated list of seeds), trusting the
    /// system's CAs when it is TLS.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        let target =
            RedisTarget::parse(url).map_err(|reason| StoreError::Backend(reason.to_owned()))?;
        Self::connect_to(&target, None, prefix).await
    }

    /// Connects to `target`; over TLS, `ca` (PEM) replaces the system's CAs.
    pub async fn connect_to(target: &RedisTarget, ca: Option<&[u8]>, prefix: &str) -> Result<Self> {
        let ca: Option<Arc<[u8]>> = ca.map(Arc::from);
        let conn = match target {
            RedisTarget::Single(url) => {
                Conn::Single(ConnectionManager::new(client(url, ca.as_deref())?).await?)
            }
            RedisTarget::Cluster(seeds) => {
                let mut builder =
                    redis::cluster::ClusterClientBuilder::new(seeds.iter().map(String::as_str));
                if let Some(ca) = &ca {
                    builder = builder.certs(certificates(ca));
                }
                Conn::Cluster(builder.build()?.get_async_connection().await?)
            }
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
        let notifier = Notifier::new();
        let relay = runplane_grpc::Tasks::new();
        let channel = format!("{prefix}changes");
        relay.spawn(RELAY_TASK, {
            let notifier = notifier.clone();
            move |_| {
                relay_changes(
                    servers.clone(),
                    ca.clone(),
                    channel.clone(),
                    notifier.clone(),
                )
            }
        });
        Ok(Self {
            conn,
            prefix: prefix.to_owned(),
            indexed: Arc::default(),
            notifier,
            _relay: Arc::new(runplane_grpc::tasks::CancelOnDrop(relay)),
        })
    }
}

#[async_trait]
impl RecoveryStore for RedisStore {
    fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    async fn acquire(
        &self,
        run: &str,
        controller: &str,
        token: &str,
        ttl_ms: i64,
        now_ms: i64,
        attempt: u32,
    ) -> Result<Acquired> {
        leases::acquire(self, run, controller, token, ttl_ms, now_ms, attempt).await
    }

    async fn renew(&self, run: &str, token: &str, ttl_ms: i64, now_ms: i64) -> Result<i64> {
        leases::renew(self, run, token, ttl_ms, now_ms).await
    }

    async fn release(&self, run: &str, token: &str) -> Result<bool> {
        leases::release(self, run, token).await
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
        frames::append(self, run, token, frames, now_ms, limits, resync).await
    }

    async fn read(&self, run: &str, from: u64, max: usize) -> Result<Replay> {
        frames::read(self, run, from, max).await
    }

    async fn budget(&self, run: &str, now_ms: i64) -> Result<BudgetState> {
        claims::budget(self, run, now_ms).await
    }

    async fn claim(&self, run: &str, a: &ClaimArgs<'_>) -> Result<ClaimOutcome> {
        claims::claim(self, run, a).await
    }

    async fn unclaim(&self, run: &str, token: &str) -> Result<bool> {
        claims::unclaim(self, run, token).await
    }

    async fn charge_org(
        &self,
        org: &str,
        hour: i64,
        bytes: u64,
        limits: &BufferLimits,
    ) -> Result<u64> {
        frames::charge_org(self, org, hour, bytes, limits).await
    }

    async fn refund_org(&self, org: &str, hour: i64, bytes: u64) -> Result<()> {
        frames::refund_org(self, org, hour, bytes).await
    }

    async fn park(&self, run: &str) -> Result<bool> {
        leases::park(self, run).await
    }

    async fn unpark(&self, run: &str, ttl_ms: i64, now_ms: i64) -> Result<bool> {
        leases::unpark(self, run, ttl_ms, now_ms).await
    }

    async fn forget(&self, run: &str) -> Result<()> {
        index::forget(self, run).await
    }

    async fn runs(&self, cursor: &str, limit: usize) -> Result<Vec<String>> {
        index::runs(self, cursor, limit).await
    }
}
