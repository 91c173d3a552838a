//! One conformance suite for the recovery store, run against real Redis and against the
//! embedded store. Time is passed in, so every gap is exact.

use std::sync::Arc;

use runplane_stream_recovery::policy::{BufferLimits, MAX_ATTEMPTS, RESET_AFTER};
use runplane_stream_recovery::store::memory::MemoryStore;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_stream_recovery::store::{ClaimArgs, ClaimOutcome, RecoveryStore, StoreError};
use runplane_testkit::TestRedis;

const TTL: i64 = 30_000;
const T0: i64 = 1_800_000_000_000;

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod redis_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let redis = super::TestRedis::new().await;
                    let store = super::RedisStore::connect(redis.url(), redis.prefix()).await.unwrap();
                    super::$name(std::sync::Arc::new(store)).await;
                }
            )*
        }
        mod memory_store {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(std::sync::Arc::new(super::MemoryStore::new())).await;
                }
            )*
        }
    };
}

conformance!(
    only_the_first_controller_acquires_and_the_holder_gets_its_token_back,
    appends_are_fenced_idempotent_contiguous_and_budgeted,
    the_buffer_trims_and_reads_report_the_first_kept_frame,
    takeovers_are_immediate_then_wait_then_exhaust_after_five,
    a_quiet_window_starts_a_fresh_budget,
    a_parked_run_is_never_taken_over,
    concurrent_claims_claim_once,
    a_claim_fences_the_previous_controller,
    an_orgs_hourly_budget_is_reserved_refused_and_refunded,
    a_run_whose_lease_was_never_granted_is_never_claimed,
    a_lost_lease_is_no_fence_and_a_controller_resyncs_past_lost_frames,
);

/// The run's first controller held the lease until `lapsed_at`: there is a lost
/// controller to replace from then on.
async fn started(s: &Arc<dyn RecoveryStore>, run: &str, lapsed_at: i64) {
    s.acquire(run, "first-controller", "first-token", 500, lapsed_at - 500)
        .await
        .unwrap();
}

fn claim(now_ms: i64, token: &str) -> ClaimArgs<'_> {
    ClaimArgs {
        now_ms,
        token,
        controller: "recovery",
        lease_ttl_ms: TTL,
        jitter: 0.0,
    }
}

/// Controllers that die within a second of their takeover, so the backoff is what spaces
/// the takeovers.
fn short_claim(now_ms: i64, token: &str) -> ClaimArgs<'_> {
    ClaimArgs {
        lease_ttl_ms: 500,
        ..claim(now_ms, token)
    }
}

fn frames(range: std::ops::RangeInclusive<u64>) -> Vec<(u64, Vec<u8>)> {
    range
        .map(|s| (s, format!("frame {s}").into_bytes()))
        .collect()
}

async fn only_the_first_controller_acquires_and_the_holder_gets_its_token_back(
    s: Arc<dyn RecoveryStore>,
) {
    let first = s
        .acquire("run-1", "ctl-a", "token-a", TTL, T0)
        .await
        .unwrap();
    assert_eq!((first.token.as_str(), first.next_sequence), ("token-a", 1));
    let again = s
        .acquire("run-1", "ctl-a", "token-other", TTL, T0 + 5)
        .await
        .unwrap();
    assert_eq!(
        again.token, "token-a",
        "the holder asking again gets its own token"
    );
    assert_eq!(
        s.acquire("run-1", "ctl-b", "token-b", TTL, T0 + 10).await,
        Err(StoreError::Held {
            controller: "ctl-a".into()
        })
    );
    // Once the lease lapsed, a new controller still cannot acquire: it must be claimed.
    assert_eq!(
        s.acquire("run-1", "ctl-b", "token-b", TTL, T0 + TTL + 100)
            .await,
        Err(StoreError::TakeoverRequired)
    );
}

async fn appends_are_fenced_idempotent_contiguous_and_budgeted(s: Arc<dyn RecoveryStore>) {
    let limits = BufferLimits {
        stream_bytes: 64,
        ..BufferLimits::default()
    };
    s.acquire("run-2", "ctl", "tok", TTL, T0).await.unwrap();
    let a = s
        .append("run-2", "tok", &frames(1..=3), T0, &limits, false)
        .await
        .unwrap();
    assert_eq!((a.next_sequence, a.stored), (4, 3));
    // A replay of 2..=3 with one new frame stores only the new one.
    let b = s
        .append("run-2", "tok", &frames(2..=4), T0, &limits, false)
        .await
        .unwrap();
    assert_eq!((b.next_sequence, b.stored), (5, 1));
    let full_replay = s
        .append("run-2", "tok", &frames(1..=4), T0, &limits, false)
        .await
        .unwrap();
    assert_eq!(full_replay.stored, 0);
    assert_eq!(
        s.append("run-2", "tok", &frames(7..=8), T0, &limits, false)
            .await,
        Err(StoreError::Gap { next: 5 })
    );
    assert_eq!(
        s.append("run-2", "not-the-token", &frames(5..=5), T0, &limits, false)
            .await,
        Err(StoreError::Fenced)
    );
    // 4 frames of 7 bytes are charged; 8 more would pass the 64-byte budget.
    assert_eq!(
        s.append("run-2", "tok", &frames(5..=12), T0, &limits, false)
            .await,
        Err(StoreError::BudgetExceeded { scope: "stream" })
    );
    let after = s.read("run-2", 1, 100).await.unwrap();
    assert_eq!(after.next_sequence, 5, "a refused batch writes nothing");
    assert_eq!(after.frames.len(), 4);
    assert_eq!(after.frames[3].data, b"frame 4");
}

async fn the_buffer_trims_and_reads_report_the_first_kept_frame(s: Arc<dyn RecoveryStore>) {
    let limits = BufferLimits {
        max_frames: 3,
        ..BufferLimits::default()
    };
    s.acquire("run-3", "ctl", "tok", TTL, T0).await.unwrap();
    s.append("run-3", "tok", &frames(1..=5), T0, &limits, false)
        .await
        .unwrap();
    let replay = s.read("run-3", 1, 100).await.unwrap();
    assert_eq!(replay.first_available, 3);
    assert_eq!(
        replay.frames.iter().map(|f| f.sequence).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    let tail = s.read("run-3", 5, 100).await.unwrap();
    assert_eq!(tail.frames.len(), 1);
}

async fn takeovers_are_immediate_then_wait_then_exhaust_after_five(s: Arc<dyn RecoveryStore>) {
    started(&s, "run-4", T0 + 1).await;
    let mut now = T0;
    let mut gaps = Vec::new();
    let mut last_claim = None;
    for attempt in 1..=MAX_ATTEMPTS {
        // The previous controller died: its lease lapses.
        now += 501;
        let outcome = s
            .claim("run-4", &short_claim(now, &format!("tok-{attempt}")))
            .await
            .unwrap();
        let (not_before, claimed_at) = match outcome {
            ClaimOutcome::Claimed {
                attempt: a,
                not_before_ms,
                ..
            } => {
                assert_eq!(a, attempt);
                (not_before_ms, now)
            }
            ClaimOutcome::Wait { not_before_ms } => {
                assert!(attempt > 1, "the first takeover is immediate");
                now = not_before_ms;
                match s
                    .claim("run-4", &short_claim(now, &format!("tok-{attempt}")))
                    .await
                    .unwrap()
                {
                    ClaimOutcome::Claimed {
                        attempt: a,
                        not_before_ms,
                        ..
                    } => {
                        assert_eq!(a, attempt);
                        (not_before_ms, now)
                    }
                    other => panic!("attempt {attempt} after waiting: {other:?}"),
                }
            }
            other => panic!("attempt {attempt}: {other:?}"),
        };
        if let Some(previous) = last_claim {
            gaps.push(claimed_at - previous);
        }
        last_claim = Some(claimed_at);
        now = now.max(claimed_at);
        let _ = not_before;
    }
    assert!(
        gaps.windows(2).all(|w| w[1] > w[0]),
        "the gaps grow: {gaps:?}"
    );
    now += 120_000;
    assert_eq!(
        s.claim("run-4", &claim(now, "tok-6")).await.unwrap(),
        ClaimOutcome::Exhausted { newly: true }
    );
    assert_eq!(
        s.claim("run-4", &claim(now + 1, "tok-7")).await.unwrap(),
        ClaimOutcome::Exhausted { newly: false },
        "exhaustion is reported once as new"
    );
    assert!(s.budget("run-4", now).await.unwrap().exhausted);
}

async fn a_quiet_window_starts_a_fresh_budget(s: Arc<dyn RecoveryStore>) {
    started(&s, "run-5", T0).await;
    let mut now = T0;
    assert!(matches!(
        s.claim("run-5", &claim(now, "a")).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 1, .. }
    ));
    now += 60_000;
    assert!(matches!(
        s.claim("run-5", &claim(now, "b")).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 2, .. }
    ));
    now += RESET_AFTER.as_millis() as i64 + 1;
    assert!(
        matches!(
            s.claim("run-5", &claim(now, "c")).await.unwrap(),
            ClaimOutcome::Claimed { attempt: 1, .. }
        ),
        "a takeover more than 5 minutes after the previous one starts over"
    );
}

async fn a_parked_run_is_never_taken_over(s: Arc<dyn RecoveryStore>) {
    s.acquire("run-6", "parked", "tok", TTL, T0).await.unwrap();
    for i in 1..=10 {
        let now = T0 + i * (TTL / 2);
        s.renew("run-6", "tok", TTL, now).await.unwrap();
        assert_eq!(
            s.claim("run-6", &claim(now, "thief")).await.unwrap(),
            ClaimOutcome::LeaseHeld
        );
    }
    assert_eq!(
        s.budget("run-6", T0).await.unwrap().attempts,
        0,
        "nothing was spent"
    );
}

async fn concurrent_claims_claim_once(s: Arc<dyn RecoveryStore>) {
    started(&s, "run-7", T0).await;
    let (ca, cb, cc) = (claim(T0, "a"), claim(T0, "b"), claim(T0, "c"));
    let (a, b, c) = tokio::join!(
        s.claim("run-7", &ca),
        s.claim("run-7", &cb),
        s.claim("run-7", &cc),
    );
    let claimed = [a.unwrap(), b.unwrap(), c.unwrap()]
        .into_iter()
        .filter(|o| matches!(o, ClaimOutcome::Claimed { .. }))
        .count();
    assert_eq!(claimed, 1);
    assert_eq!(s.budget("run-7", T0).await.unwrap().attempts, 1);
}

async fn a_claim_fences_the_previous_controller(s: Arc<dyn RecoveryStore>) {
    s.acquire("run-8", "first", "old", TTL, T0).await.unwrap();
    let later = T0 + TTL + 1;
    assert!(matches!(
        s.claim("run-8", &claim(later, "new")).await.unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
    assert_eq!(
        s.renew("run-8", "old", TTL, later).await,
        Err(StoreError::Fenced)
    );
    assert_eq!(
        s.append(
            "run-8",
            "old",
            &frames(1..=1),
            later,
            &BufferLimits::default(),
            false
        )
        .await,
        Err(StoreError::Fenced)
    );
    assert!(
        !s.release("run-8", "old").await.unwrap(),
        "never releases another's lease"
    );
    s.append(
        "run-8",
        "new",
        &frames(1..=1),
        later,
        &BufferLimits::default(),
        false,
    )
    .await
    .unwrap();
}

async fn an_orgs_hourly_budget_is_reserved_refused_and_refunded(s: Arc<dyn RecoveryStore>) {
    assert_eq!(s.charge_org("acme", 7, 60, 100).await.unwrap(), 40);
    assert_eq!(
        s.charge_org("acme", 7, 50, 100).await,
        Err(StoreError::BudgetExceeded { scope: "org_hour" }),
        "a refusal charges nothing"
    );
    s.refund_org("acme", 7, 20).await.unwrap();
    assert_eq!(s.charge_org("acme", 7, 60, 100).await.unwrap(), 0);
    // Another hour, another org: budgets of their own.
    assert_eq!(s.charge_org("acme", 8, 10, 100).await.unwrap(), 90);
    assert_eq!(s.charge_org("globex", 7, 10, 100).await.unwrap(), 90);
}

async fn a_run_whose_lease_was_never_granted_is_never_claimed(s: Arc<dyn RecoveryStore>) {
    for i in 0..20 {
        let now = T0 + i * 61_000;
        assert_eq!(
            s.claim("run-9", &claim(now, &format!("thief-{i}")))
                .await
                .unwrap(),
            ClaimOutcome::NoControllerYet
        );
    }
    let budget = s.budget("run-9", T0 + 20 * 61_000).await.unwrap();
    assert_eq!(
        (budget.attempts, budget.lease),
        (0, None),
        "nothing was spent"
    );
    // Its runner then starts the stream as the first controller, not through a claim.
    let first = s
        .acquire("run-9", "late-runner", "late-token", TTL, T0 + 21 * 61_000)
        .await
        .unwrap();
    assert_eq!(
        (first.token.as_str(), first.next_sequence),
        ("late-token", 1)
    );
}

async fn a_lost_lease_is_no_fence_and_a_controller_resyncs_past_lost_frames(
    s: Arc<dyn RecoveryStore>,
) {
    let limits = BufferLimits::default();
    s.acquire("run-10", "ctl", "tok", TTL, T0).await.unwrap();
    s.append("run-10", "tok", &frames(1..=3), T0, &limits, false)
        .await
        .unwrap();
    // Every key of the run is lost (a Redis without persistence restarted).
    s.forget("run-10").await.unwrap();
    assert_eq!(
        s.append("run-10", "tok", &frames(4..=5), T0, &limits, false)
            .await,
        Err(StoreError::Gap { next: 1 }),
        "a lost lease is no fence: the controller learns where to resend from"
    );
    // A controller that still holds everything re-sends it all.
    let again = s
        .append("run-10", "tok", &frames(1..=5), T0, &limits, false)
        .await
        .unwrap();
    assert_eq!((again.next_sequence, again.stored), (6, 5));
    assert!(s.renew("run-10", "tok", TTL, T0 + 1).await.is_ok());
    assert_eq!(
        s.claim("run-10", &claim(T0 + 2, "thief")).await.unwrap(),
        ClaimOutcome::LeaseHeld,
        "the lease was taken back"
    );
    // One that no longer holds 6..=9 resyncs at 10: readers see the buffer start there.
    s.forget("run-10").await.unwrap();
    assert!(s.renew("run-10", "tok", TTL, T0 + 3).await.is_ok());
    let resynced = s
        .append("run-10", "tok", &frames(10..=11), T0 + 3, &limits, true)
        .await
        .unwrap();
    assert_eq!(resynced.next_sequence, 12);
    let replay = s.read("run-10", 1, 100).await.unwrap();
    assert_eq!(replay.first_available, 10);
    assert_eq!(
        replay.frames.iter().map(|f| f.sequence).collect::<Vec<_>>(),
        [10, 11]
    );
    // A lease held by another token still fences.
    assert_eq!(
        s.append("run-10", "other", &frames(12..=12), T0 + 3, &limits, false)
            .await,
        Err(StoreError::Fenced)
    );
}
