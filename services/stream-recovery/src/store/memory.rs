//! The embedded store for `runplane dev`: the same semantics as the Redis scripts, each
//! operation under one lock (as each script is one atomic step). State is lost with the
//! process, like a Redis without persistence.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;

use super::{
    Acquired, Appended, BudgetState, ClaimArgs, ClaimOutcome, RecoveryStore, Replay, Result,
    StoreError, StoredFrame,
};
use crate::policy::{
    BACKOFF_BASE, BACKOFF_CAP, BufferLimits, DEFAULT_LEASE_TTL, MAX_ATTEMPTS, RESET_AFTER,
};

#[derive(Debug, Default)]
struct Run {
    lease: Option<Lease>,
    granted: bool,
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
}

#[derive(Debug, Default)]
pub struct MemoryStore {
    runs: Mutex<HashMap<String, Run>>,
    org_hours: Mutex<HashMap<(String, i64), u64>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the run's state; a run with no state gets an entry only if `f` leaves
    /// something in it (as a Redis script that only reads creates no key).
    fn with<T>(&self, run: &str, f: impl FnOnce(&mut Run) -> T) -> T {
        let mut runs = self.runs.lock().expect("memory store poisoned");
        if let Some(r) = runs.get_mut(run) {
            return f(r);
        }
        let mut fresh = Run::fresh();
        let out = f(&mut fresh);
        if !fresh.is_blank() {
            runs.insert(run.to_owned(), fresh);
        }
        out
    }
}

#[async_trait]
impl RecoveryStore for MemoryStore {
    async fn acquire(
        &self,
        run: &str,
        controller: &str,
        token: &str,
        ttl_ms: i64,
        now_ms: i64,
    ) -> Result<Acquired> {
        self.with(run, |r| {
            if let Some(lease) = r.live_lease(now_ms).cloned() {
                if lease.controller != controller {
                    return Err(StoreError::Held {
                        controller: lease.controller,
                    });
                }
                let lease = r.lease.as_mut().expect("live lease");
                lease.expires = now_ms + ttl_ms;
                return Ok(Acquired {
                    token: lease.token.clone(),
                    expires_ms: lease.expires,
                    next_sequence: r.next,
                });
            }
            if r.granted {
                return Err(StoreError::TakeoverRequired);
            }
            r.granted = true;
            r.lease = Some(Lease {
                controller: controller.to_owned(),
                token: token.to_owned(),
                expires: now_ms + ttl_ms,
                parked: false,
            });
            Ok(Acquired {
                token: token.to_owned(),
                expires_ms: now_ms + ttl_ms,
                next_sequence: r.next,
            })
        })
    }

    async fn renew(&self, run: &str, token: &str, ttl_ms: i64, now_ms: i64) -> Result<i64> {
        self.with(run, |r| match r.lease.as_mut() {
            Some(lease) if lease.token == token => {
                lease.expires = now_ms + ttl_ms;
                lease.parked = false;
                Ok(lease.expires)
            }
            Some(_) => Err(StoreError::Fenced),
            // Lost, not taken: the run's controller takes it back.
            None => {
                r.granted = true;
                r.lease = Some(Lease {
                    controller: "resynced".into(),
                    token: token.to_owned(),
                    expires: now_ms + ttl_ms,
                    parked: false,
                });
                Ok(now_ms + ttl_ms)
            }
        })
    }

    async fn release(&self, run: &str, token: &str) -> Result<bool> {
        self.with(run, |r| {
            if r.lease.as_ref().is_some_and(|l| l.token == token) {
                r.lease = None;
                Ok(true)
            } else {
                Ok(false)
            }
        })
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
        self.with(run, |r| {
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
            r.bytes += add;
            Ok(Appended {
                next_sequence: r.next,
                stored,
                stored_bytes: add,
                stream_bytes_remaining: limits.stream_bytes - r.bytes,
            })
        })
    }

    async fn read(&self, run: &str, from: u64, max: usize) -> Result<Replay> {
        self.with(run, |r| {
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
        self.with(run, |r| {
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
        self.with(run, |r| {
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
            let base = BACKOFF_BASE.as_millis() as f64;
            let cap = BACKOFF_CAP.as_millis() as f64;
            let d = (base * 2f64.powi(attempts as i32 - 1)).min(cap);
            let not_before = a.now_ms + (d + d * a.jitter).min(cap).floor() as i64;
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
            Ok(ClaimOutcome::Claimed {
                attempt: attempts,
                next_sequence: r.next,
                not_before_ms: not_before,
            })
        })
    }

    async fn unclaim(&self, run: &str, token: &str) -> Result<bool> {
        self.with(run, |r| {
            let Some(undo) = r.undo.take_if(|u| u.token == token) else {
                return Ok(false);
            };
            if r.lease.as_ref().is_some_and(|l| l.token == token) {
                r.lease = undo.lease;
            }
            r.attempts = undo.attempts;
            r.claimed = undo.claimed;
            r.not_before = undo.not_before;
            Ok(true)
        })
    }

    async fn charge_org(&self, org: &str, hour: i64, bytes: u64, limit: u64) -> Result<u64> {
        let mut hours = self.org_hours.lock().expect("memory store poisoned");
        let used = hours.entry((org.to_owned(), hour)).or_default();
        if *used + bytes > limit {
            return Err(StoreError::BudgetExceeded { scope: "org_hour" });
        }
        *used += bytes;
        Ok(limit - *used)
    }

    async fn refund_org(&self, org: &str, hour: i64, bytes: u64) -> Result<()> {
        let mut hours = self.org_hours.lock().expect("memory store poisoned");
        if let Some(used) = hours.get_mut(&(org.to_owned(), hour)) {
            *used = used.saturating_sub(bytes);
        }
        Ok(())
    }

    async fn park(&self, run: &str) -> Result<bool> {
        self.with(run, |r| {
            Ok(r.lease
                .as_mut()
                .map(|l| {
                    l.parked = true;
                    l.expires = super::PARKED_EXPIRES_MS;
                })
                .is_some())
        })
    }

    async fn unpark(&self, run: &str, ttl_ms: i64, now_ms: i64) -> Result<bool> {
        self.with(run, |r| match r.lease.as_mut() {
            Some(l) if l.parked => {
                l.parked = false;
                l.expires = now_ms + ttl_ms;
                Ok(true)
            }
            _ => Ok(false),
        })
    }

    async fn forget(&self, run: &str) -> Result<()> {
        self.runs.lock().expect("memory store poisoned").remove(run);
        Ok(())
    }

    async fn runs(&self, cursor: &str, limit: usize) -> Result<Vec<String>> {
        let runs = self.runs.lock().expect("memory store poisoned");
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
