//! The restart budget: read with the lease, spent by a claim (one script, so concurrent
//! planners claim once), and given back by an unclaim when the hand-off fails.

use redis::{ScriptInvocation, Value};

use super::connection::RedisStore;
use super::reply::{int, text};
use super::scripts::{BUDGET, CLAIM, UNCLAIM};
use crate::domain::policy::{LEASE_GC_FACTOR, MAX_ATTEMPTS, RESET_AFTER, STATE_TTL, backoff_ms};
use crate::store::{BudgetState, ClaimArgs, ClaimOutcome, Result};

impl RedisStore {
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
}

pub(super) async fn budget(store: &RedisStore, run: &str, now_ms: i64) -> Result<BudgetState> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
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

pub(super) async fn claim(
    store: &RedisStore,
    run: &str,
    a: &ClaimArgs<'_>,
) -> Result<ClaimOutcome> {
    let mut conn = store.conn.clone();
    let out: Vec<Value> = store
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
        && let Err(e) = store.remember(run).await
    {
        if let Err(undo) = unclaim(store, run, a.token).await {
            tracing::error!(run_id = run, cause = %undo, "claim not undone; its lease lapses");
        }
        return Err(e);
    }
    if matches!(
        outcome,
        ClaimOutcome::Claimed { .. } | ClaimOutcome::Exhausted { newly: true }
    ) {
        store.changed(run).await;
    }
    Ok(outcome)
}

pub(super) async fn unclaim(store: &RedisStore, run: &str, token: &str) -> Result<bool> {
    let k = store.keys(run);
    let mut conn = store.conn.clone();
    let undone: i64 = UNCLAIM
        .key(&k.lease)
        .key(&k.budget)
        .arg(token)
        .invoke_async(&mut conn)
        .await?;
    if undone == 1 {
        store.changed(run).await;
    }
    Ok(undone == 1)
}
