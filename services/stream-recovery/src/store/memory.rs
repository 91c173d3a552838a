//! The embedded store for `runplane dev`: the same semantics as the Redis scripts, each
//! operation under one lock (as each script is one atomic step). State is lost with the
//! process, like a Redis without persistence.
//!
//! Bounded like Redis: every key the scripts give a TTL expires here at the same moment
//! (see `store/redis/mod.rs`), on this store's clock (the coordinator's, as Redis uses its
//! server's): a lease, a run's meta and buffer, its budget, an org's hourly counter.
//! Expired state is dropped when its run is next touched, and every run's by the sweep's
//! listing (`runs`), which the coordinator calls every 30 s.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;
use runplane_clock::{SharedClock, SystemClock};
use runplane_grpc::notifier::Notifier;

use super::{
    Acquired, Appended, BudgetState, ClaimArgs, ClaimOutcome, RecoveryStore, Replay, Result,
    StoreError, StoredFrame,
};
use crate::domain::policy::{
    BufferLimits, DEFAULT_LEASE_TTL, LEASE_GC_FACTOR, MAX_ATTEMPTS, RESET_AFTER, STATE_TTL,
    backoff_ms,
};

/// When a key expires, on the store's clock; `None` while it has no TTL (Redis's
/// `PERSIST`, or a key not written yet).
type Expiry = Option<i64>;

#[derive(Debug, Default)]
struct Run {
    lease: Option<Lease>,
    granted: bool,
    /// The attempt of the run the lease was last granted to (Redis: meta `attempt`).
    granted_attempt: u32,
    next: u64,
    first: u64,
    bytes: u64,
    frames: BTreeMap<u64, (Vec<u8>, i64)>,
    attempts: u32,
    claimed: Option<i64>,
    not_before: Option<i64>,
    exhausted: bool,
    /// What the latest claim replaced, so a failed hand-off can put it back.
    undo: Option<Undo>,
    /// The lease key's expiry.
    lease_until: Expiry,
    /// The meta and buffer keys' (next, first, bytes, granted, frames).
    meta_until: Expiry,
    /// The budget key's (attempts, claimed, not_before, exhausted, undo).
    budget_until: Expiry,
}

#[derive(Debug)]
struct Undo {
    token: String,
    attempts: u32,
    claimed: Option<i64>,
    not_before: Option<i64>,
    lease: Option<Lease>,
}

#[derive(Debug, Clone)]
struct Lease {
    controller: String,
    token: String,
    expires: i64,
    parked: bool,
}

impl Run {
    fn fresh() -> Self {
        Self {
            next: 1,
            first: 1,
            ..Self::default()
        }
    }

    fn is_blank(&self) -> bool {
        self.lease.is_none()
            && !self.granted
            && self.frames.is_empty()
            && self.next == 1
            && self.attempts == 0
            && !self.exhausted
    }

    fn live_lease(&self, now: i64) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| l.parked || l.expires > now)
    }

    /// Drops what has expired by `now`, key by key, as Redis would have.
    fn expire(&mut self, now: i64) {
        let gone = |until: &mut Expiry| {
            let expired = until.is_some_and(|t| t <= now);
            if expired {
                *until = None;
            }
            expired
        };
        if gone(&mut self.lease_until) {
            self.lease = None;
        }
        if gone(&mut self.meta_until) {
            self.granted = false;
            self.granted_attempt = 0;
            self.next = 1;
            self.first = 1;
            self.bytes = 0;
            self.frames.clear();
        }
        if gone(&mut self.budget_until) {
            self.attempts = 0;
            self.claimed = None;
            self.not_before = None;
            self.exhausted = false;
            self.undo = None;
        }
    }

    /// Redis's `PEXPIRE lease`.
    fn lease_lives(&mut self, now: i64, ms: i64) {
        self.lease_until = Some(now + ms);
    }

    /// The script's `keep(meta, ms)`: the meta and buffer live at least `ms` more.
    fn keep_meta(&mut self, now: i64, ms: i64) {
        if self.meta_until.is_none_or(|t| t < now + ms) {
            self.meta_until = Some(now + ms);
        }
    }
}

/// One org's hourly byte counter.
#[derive(Debug, Default)]
struct OrgHour {
    used: u64,
    until: i64,
}

#[derive(Debug)]
pub struct MemoryStore {
    runs: Mutex<HashMap<String, Run>>,
    org_hours: Mutex<HashMap<(String, i64), OrgHour>>,
    clock: SharedClock,
    notifier: Notifier,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// Expiring on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::shared())
    }

    /// Expiring on `clock` (the coordinator's; a manual one in tests).
    pub fn with_clock(clock: SharedClock) -> Self {
        Self {
            runs: Mutex::default(),
            org_hours: Mutex::default(),
            clock,
            notifier: Notifier::new(),
        }
    }

    /// `out`, after waking whoever follows `run` (what it changed is there to read).
    fn woke<T>(&self, run: &str, out: T) -> T {
        self.notifier.notify(run);
        out
    }

    fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Runs `f` on the run's unexpired state and the store's time; a run with no state
    /// gets an entry only if `f` leaves something in it (as a Redis script that only
    /// reads creates no key), and one left with nothing is dropped.
    fn with<T>(&self, run: &str, f: impl FnOnce(&mut Run, i64) -> T) -> T {
        let now = self.now();
        let mut runs = self.runs.lock().expect("memory store poisoned");
        let mut state = runs.remove(run).unwrap_or_else(Run::fresh);
        state.expire(now);
        let out = f(&mut state, now);
        if !state.is_blank() {
            runs.insert(run.to_owned(), state);
        }
        out
    }
}

#[async_trait]
impl RecoveryStore for MemoryStore {
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
        let out = self.with(run, |r, t| {
            let later_attempt = r.granted && attempt > r.granted_attempt.max(1);
            if let Some(lease) = r.live_lease(now_ms).cloned().filter(|_| !later_attempt) {
                if lease.controller != controller {
                    return Err(StoreError::Held {
                        controller: lease.controller,
                    });
                }
                let lease = r.lease.as_mut().expect("live lease");
                lease.expires = now_ms + ttl_ms;
                let acquired = Acquired {
                    token: lease.token.clone(),
                    expires_ms: lease.expires,
                    next_sequence: r.next,
                };
                r.lease_lives(t, ttl_ms * LEASE_GC_FACTOR);
                r.keep_meta(t, STATE_TTL.as_millis() as i64);
                return Ok(acquired);
            }
            if r.granted && !later_attempt {
                return Err(StoreError::TakeoverRequired);
            }
            r.granted = true;
            r.granted_attempt = attempt.max(1);
            r.lease = Some(Lease {
                controller: controller.to_owned(),
                token: token.to_owned(),
                expires: now_ms + ttl_ms,
                parked: false,
            });
            r.lease_lives(t, ttl_ms * LEASE_GC_FACTOR);
            r.keep_meta(t, STATE_TTL.as_millis() as i64);
            Ok(Acquired {
                token: token.to_owned(),
                expires_ms: now_ms + ttl_ms,
                next_sequence: r.next,
            })
        });
        self.woke(run, out)
    }

    async fn renew(&self, run: &str, token: &str, ttl_ms: i64, now_ms: i64) -> Result<i64> {
        self.with(run, |r, t| {
            match r.lease.as_mut() {
                Some(lease) if lease.token == token => {
                    lease.expires = now_ms + ttl_ms;
                    lease.parked = false;
                }
                Some(_) => return Err(StoreError::Fenced),
                // Lost, not taken: the run's controller takes it back.
                None => {
                    r.granted = true;
                    r.lease = Some(Lease {
                        controller: "resynced".into(),
                        token: token.to_owned(),
                        expires: now_ms + ttl_ms,
                        parked: false,
                    });
                }
            }
            r.lease_lives(t, ttl_ms * LEASE_GC_FACTOR);
            r.keep_meta(t, STATE_TTL.as_millis() as i64);
            Ok(now_ms + ttl_ms)
        })
    }

    async fn release(&self, run: &str, token: &str) -> Result<bool> {
        let out = self.with(run, |r, _| {
            if r.lease.as_ref().is_some_and(|l| l.token == token) {
                r.lease = None;
                r.lease_until = None;
                Ok(true)
            } else {
                Ok(false)
            }
        });
        self.woke(run, out)
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
        let out = self.with(run, |r, t| {
            if r.lease.as_ref().is_some_and(|l| l.token != token) {
                return Err(StoreError::Fenced);
            }
            if let Some(&(from, _)) = frames.first().filter(|(s, _)| *s > r.next) {
                if !resync {
                    return Err(StoreError::Gap { next: r.next });
                }
                r.frames.clear();
                r.first = from;
                r.next = from;
            }
            let add: u64 = frames
                .iter()
                .filter(|(s, _)| *s >= r.next)
                .map(|(_, d)| d.len() as u64)
                .sum();
            if r.bytes + add > limits.stream_bytes {
                return Err(StoreError::BudgetExceeded { scope: "stream" });
            }
            if r.lease.is_none() {
                r.granted = true;
                r.lease = Some(Lease {
                    controller: "resynced".into(),
                    token: token.to_owned(),
                    expires: now_ms + DEFAULT_LEASE_TTL.as_millis() as i64,
                    parked: false,
                });
                r.lease_lives(t, DEFAULT_LEASE_TTL.as_millis() as i64 * LEASE_GC_FACTOR);
            }
            let mut stored = 0;
            for (sequence, data) in frames {
                if *sequence == r.next {
                    r.frames.insert(*sequence, (data.clone(), now_ms));
                    r.next += 1;
                    stored += 1;
                }
            }
            while r.next - r.first > limits.max_frames {
                r.frames.remove(&r.first);
                r.first += 1;
            }
            // Frames appended longer than the ttl ago go too (as the Redis script).
            let oldest = now_ms - limits.ttl.as_millis() as i64;
            while r.first < r.next && r.frames.get(&r.first).is_some_and(|(_, at)| *at < oldest) {
                r.frames.remove(&r.first);
                r.first += 1;
            }
            r.bytes += add;
            r.meta_until = Some(t + limits.ttl.as_millis() as i64);
            Ok(Appended {
                next_sequence: r.next,
                stored,
                stored_bytes: add,
                stream_bytes_remaining: limits.stream_bytes - r.bytes,
            })
        });
        self.woke(run, out)
    }

    async fn read(&self, run: &str, from: u64, max: usize) -> Result<Replay> {
        self.with(run, |r, _| {
            Ok(Replay {
                first_available: r.first,
                next_sequence: r.next,
                frames: r
                    .frames
                    .range(from.max(r.first)..)
                    .take(max)
                    .map(|(s, (d, at))| StoredFrame {
                        sequence: *s,
                        data: d.clone(),
                        appended_ms: *at,
                    })
                    .collect(),
            })
        })
    }

    async fn budget(&self, run: &str, now_ms: i64) -> Result<BudgetState> {
        self.with(run, |r, _| {
            Ok(BudgetState {
                attempts: r.attempts,
                claimed_ms: r.claimed,
                not_before_ms: r.not_before,
                exhausted: r.exhausted,
                lease: r
                    .live_lease(now_ms)
                    .map(|l| (l.controller.clone(), l.expires)),
                next_sequence: r.next,
                parked: r.lease.as_ref().is_some_and(|l| l.parked),
            })
        })
    }

    async fn claim(&self, run: &str, a: &ClaimArgs<'_>) -> Result<ClaimOutcome> {
        let out = self.with(run, |r, t| {
            let state_ttl = STATE_TTL.as_millis() as i64;
            if r.live_lease(a.now_ms).is_some() {
                return Ok(ClaimOutcome::LeaseHeld);
            }
            if !r.granted {
                return Ok(ClaimOutcome::NoControllerYet);
            }
            if r.exhausted {
                return Ok(ClaimOutcome::Exhausted { newly: false });
            }
            let mut attempts = r.attempts;
            if attempts > 0
                && a.now_ms - r.claimed.unwrap_or_default() > RESET_AFTER.as_millis() as i64
            {
                attempts = 0;
            }
            if attempts >= MAX_ATTEMPTS {
                r.exhausted = true;
                r.budget_until = Some(t + state_ttl);
                return Ok(ClaimOutcome::Exhausted { newly: true });
            }
            if attempts > 0
                && let Some(not_before) = r.not_before.filter(|nb| a.now_ms < *nb)
            {
                return Ok(ClaimOutcome::Wait {
                    not_before_ms: not_before,
                });
            }
            attempts += 1;
            let not_before = a.now_ms + backoff_ms(attempts, a.jitter);
            r.undo = Some(Undo {
                token: a.token.to_owned(),
                attempts: r.attempts,
                claimed: r.claimed,
                not_before: r.not_before,
                lease: r.lease.clone(),
            });
            r.attempts = attempts;
            r.claimed = Some(a.now_ms);
            r.not_before = Some(not_before);
            r.lease = Some(Lease {
                controller: a.controller.to_owned(),
                token: a.token.to_owned(),
                expires: a.now_ms + a.lease_ttl_ms,
                parked: false,
            });
            r.budget_until = Some(t + state_ttl);
            r.lease_lives(t, a.lease_ttl_ms * LEASE_GC_FACTOR);
            r.keep_meta(t, state_ttl);
            Ok(ClaimOutcome::Claimed {
                attempt: attempts,
                next_sequence: r.next,
                not_before_ms: not_before,
            })
        });
        self.woke(run, out)
    }

    async fn unclaim(&self, run: &str, token: &str) -> Result<bool> {
        let out = self.with(run, |r, _| {
            let Some(undo) = r.undo.take_if(|u| u.token == token) else {
                return Ok(false);
            };
            if r.lease.as_ref().is_some_and(|l| l.token == token) {
                // Redis restores the stashed fields into the claim's key (its TTL
                // stays), or deletes the key when there was no lease before.
                if undo.lease.is_none() {
                    r.lease_until = None;
                }
                r.lease = undo.lease;
            }
            r.attempts = undo.attempts;
            r.claimed = undo.claimed;
            r.not_before = undo.not_before;
            Ok(true)
        });
        self.woke(run, out)
    }

    async fn charge_org(
        &self,
        org: &str,
        hour: i64,
        bytes: u64,
        limits: &BufferLimits,
    ) -> Result<u64> {
        let now = self.now();
        let mut hours = self.org_hours.lock().expect("memory store poisoned");
        hours.retain(|_, h| h.until > now);
        let used = |h: i64| hours.get(&(org.to_owned(), h)).map_or(0, |c| c.used);
        let held: u64 = (hour - limits.window_hours() + 1..=hour).map(used).sum();
        if used(hour) + bytes > limits.org_hour_bytes {
            return Err(StoreError::BudgetExceeded { scope: "org_hour" });
        }
        if held + bytes > limits.org_buffer_bytes {
            return Err(StoreError::BudgetExceeded {
                scope: "org_buffer",
            });
        }
        let counter = hours.entry((org.to_owned(), hour)).or_default();
        counter.used += bytes;
        counter.until = now + limits.org_counter_ttl_ms();
        Ok(limits.org_hour_bytes.saturating_sub(counter.used))
    }

    async fn refund_org(&self, org: &str, hour: i64, bytes: u64) -> Result<()> {
        let now = self.now();
        let mut hours = self.org_hours.lock().expect("memory store poisoned");
        hours.retain(|_, h| h.until > now);
        if let Some(counter) = hours.get_mut(&(org.to_owned(), hour)) {
            counter.used = counter.used.saturating_sub(bytes);
        }
        Ok(())
    }

    async fn park(&self, run: &str) -> Result<bool> {
        let out = self.with(run, |r, _| {
            let Some(l) = r.lease.as_mut() else {
                return Ok(false);
            };
            l.parked = true;
            l.expires = super::PARKED_EXPIRES_MS;
            r.lease_until = None;
            Ok(true)
        });
        self.woke(run, out)
    }

    async fn unpark(&self, run: &str, ttl_ms: i64, now_ms: i64) -> Result<bool> {
        let out = self.with(run, |r, t| match r.lease.as_mut() {
            Some(l) if l.parked => {
                l.parked = false;
                l.expires = now_ms + ttl_ms;
                r.lease_lives(t, ttl_ms * LEASE_GC_FACTOR);
                Ok(true)
            }
            _ => Ok(false),
        });
        self.woke(run, out)
    }

    async fn forget(&self, run: &str) -> Result<()> {
        self.runs.lock().expect("memory store poisoned").remove(run);
        Ok(())
    }

    async fn runs(&self, cursor: &str, limit: usize) -> Result<Vec<String>> {
        let now = self.now();
        let mut runs = self.runs.lock().expect("memory store poisoned");
        runs.retain(|_, r| {
            r.expire(now);
            !r.is_blank()
        });
        let mut ids: Vec<String> = runs
            .keys()
            .filter(|id| id.as_str() > cursor)
            .cloned()
            .collect();
        ids.sort();
        ids.truncate(limit);
        Ok(ids)
    }
}
