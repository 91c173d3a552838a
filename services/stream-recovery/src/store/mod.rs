//! Where leases, replay buffers and restart budgets live: Redis in production, memory
//! for `runplane dev`, one trait and one conformance suite for both.
//!
//! Time comes from the injected clock, passed into every operation (and every Lua
//! script) as milliseconds: one time source whether the store is Redis or memory, a
//! clock tests can move by hand, and no dependence on the Redis server's clock agreeing
//! with the coordinators'. Redis key expiries are only garbage collection; every decision
//! compares the stored times with the caller's `now`.

pub mod memory;
pub mod redis;

use async_trait::async_trait;
use runplane_grpc::notifier::Notifier;

use crate::domain::policy::BufferLimits;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// The token no longer holds the lease.
    #[error("the lease is held by a newer controller")]
    Fenced,
    #[error("the lease is held by controller {controller}")]
    Held { controller: String },
    /// The run had a first controller already; later ones come through a claim.
    #[error("the run's first controller was already granted; a takeover goes through recovery")]
    TakeoverRequired,
    #[error("the batch starts past the next expected sequence {next}")]
    Gap { next: u64 },
    /// `scope` is `stream`, `org_hour` or `org_buffer`.
    #[error("the {scope} replay budget is spent")]
    BudgetExceeded { scope: &'static str },
    #[error("the recovery store is unavailable: {0}")]
    Backend(String),
}

impl From<::redis::RedisError> for StoreError {
    fn from(e: ::redis::RedisError) -> Self {
        StoreError::Backend(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A parked lease's expiry: never, in practice (year 2255).
pub const PARKED_EXPIRES_MS: i64 = 9_000_000_000_000;

/// A lease granted to a run's first controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    pub token: String,
    pub expires_ms: i64,
    pub next_sequence: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub next_sequence: u64,
    pub stored: u32,
    /// Bytes of the frames this call stored (a replay stores none).
    pub stored_bytes: u64,
    pub stream_bytes_remaining: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredFrame {
    pub sequence: u64,
    pub data: Vec<u8>,
    pub appended_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The first sequence still kept (1 when nothing was trimmed).
    pub first_available: u64,
    pub next_sequence: u64,
    pub frames: Vec<StoredFrame>,
}

/// A run's restart budget and lease, as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BudgetState {
    pub attempts: u32,
    pub claimed_ms: Option<i64>,
    pub not_before_ms: Option<i64>,
    pub exhausted: bool,
    /// The lease holder and expiry, when held (unexpired at the read's `now`).
    pub lease: Option<(String, i64)>,
    /// The lease is parked (its sandbox suspended).
    pub parked: bool,
    pub next_sequence: u64,
}

/// What one claim attempt decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// No controller was ever granted the lease: there is none to replace, and nothing
    /// was written.
    NoControllerYet,
    /// A controller holds the lease (live or parked): never taken over.
    LeaseHeld,
    /// The backoff runs until then.
    Wait { not_before_ms: i64 },
    /// The takeover is claimed: new token, budget updated, in one step.
    Claimed {
        attempt: u32,
        next_sequence: u64,
        not_before_ms: i64,
    },
    /// The budget is spent. `newly` is true for the one claim that spent it.
    Exhausted { newly: bool },
}

/// The arguments of a claim, fixed by the caller so the store stays deterministic.
#[derive(Debug, Clone)]
pub struct ClaimArgs<'a> {
    pub now_ms: i64,
    pub token: &'a str,
    pub controller: &'a str,
    pub lease_ttl_ms: i64,
    /// A draw from `[0, 1)` for the backoff's jitter.
    pub jitter: f64,
}

#[async_trait]
pub trait RecoveryStore: Send + Sync + 'static {
    /// Who follows which run. Every change the store makes to a run (a frame appended, a
    /// lease granted, released, claimed, parked or unparked) wakes the run's followers;
    /// on Redis, so does every other replica's.
    fn notifier(&self) -> &Notifier;
    /// Grants the lease to a run's first controller; the same controller again gets its
    /// token back (and a fresh expiry). The first controller of a later `attempt` of the
    /// run (its runner's key says which) gets a fresh lease, whoever held it: the earlier
    /// attempt's runner is gone (its key was revoked), so this is no takeover and spends
    /// no budget.
    async fn acquire(
        &self,
        run: &str,
        controller: &str,
        token: &str,
        ttl_ms: i64,
        now_ms: i64,
        attempt: u32,
    ) -> Result<Acquired>;
    /// Extends the lease `token` holds; a lease that is gone is taken back (not a fence).
    async fn renew(&self, run: &str, token: &str, ttl_ms: i64, now_ms: i64) -> Result<i64>;
    /// Removes the lease if `token` holds it.
    async fn release(&self, run: &str, token: &str) -> Result<bool>;
    /// Appends frames fenced by `token`, idempotent by sequence, charged to the stream's
    /// byte budget, trimmed to the buffer's length. Only a lease held by another token
    /// fences: a lease that is gone (lost keys) is taken back by `token`. With `resync`,
    /// a batch that starts past the next sequence restarts the buffer at its first frame
    /// (the controller no longer holds the frames in between) instead of a `Gap`.
    async fn append(
        &self,
        run: &str,
        token: &str,
        frames: &[(u64, Vec<u8>)],
        now_ms: i64,
        limits: &BufferLimits,
        resync: bool,
    ) -> Result<Appended>;
    async fn read(&self, run: &str, from: u64, max: usize) -> Result<Replay>;
    async fn budget(&self, run: &str, now_ms: i64) -> Result<BudgetState>;
    /// Plans and, when allowed, claims a takeover, all in one atomic step.
    async fn claim(&self, run: &str, args: &ClaimArgs<'_>) -> Result<ClaimOutcome>;
    /// Undoes the claim made with `token` if it is still the run's latest: the budget and
    /// the lease are put back as they were before it. The compensating half of a claim
    /// whose hand-off (index entry, resume_stream message) failed. False when a later
    /// claim or nothing was there to undo.
    async fn unclaim(&self, run: &str, token: &str) -> Result<bool>;
    /// Reserves `bytes` of an org's budget for the hour `hour` (ms epoch / 3.6e6) within
    /// `limits.org_hour_bytes`, and of what its buffers may hold within
    /// `limits.org_buffer_bytes` (the hours of [`BufferLimits::window_hours`] up to
    /// `hour`); returns what is left of the hour's, or refuses without charging.
    async fn charge_org(
        &self,
        org: &str,
        hour: i64,
        bytes: u64,
        limits: &BufferLimits,
    ) -> Result<u64>;
    /// Gives back bytes a reservation did not use.
    async fn refund_org(&self, org: &str, hour: i64, bytes: u64) -> Result<()>;
    /// Parks the run's lease (its sandbox is being suspended): held with no expiry until
    /// `unpark`. False when there is no lease to park.
    async fn park(&self, run: &str) -> Result<bool>;
    /// Hands a parked lease back: it expires `ttl_ms` after `now_ms` again, same token.
    async fn unpark(&self, run: &str, ttl_ms: i64, now_ms: i64) -> Result<bool>;
    /// Forgets everything about a run (the orphan sweep).
    async fn forget(&self, run: &str) -> Result<()>;
    /// Runs with state, in id order after `cursor`, at most `limit`.
    async fn runs(&self, cursor: &str, limit: usize) -> Result<Vec<String>>;
}
