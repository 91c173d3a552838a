//! One conformance suite for the recovery store, run against real Redis and against the
//! embedded store. Time is passed in, so every gap is exact. Key expiry runs on the
//! store's own time (Redis's server clock, the memory store's clock): the timed suite
//! moves it by hand, a manual clock for memory and, for Redis, every key of the test's
//! prefix aged by the same amount (`PEXPIRE` to what would be left, `DEL` when nothing).

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_stream_recovery::domain::policy::{
    BufferLimits, LEASE_GC_FACTOR, MAX_ATTEMPTS, RESET_AFTER, STATE_TTL, backoff_ms,
};
use runplane_stream_recovery::store::memory::MemoryStore;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_stream_recovery::store::{ClaimArgs, ClaimOutcome, RecoveryStore, StoreError};
use runplane_testkit::TestRedis;

const TTL: i64 = 30_000;
const T0: i64 = 1_800_000_000_000;

#[path = "store/leases.rs"]
mod leases;
use leases::*;

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
        mod cluster_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let redis = super::TestRedis::cluster().await;
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

/// Moves a store's own time (its key expiry) forward.
enum Time {
    Manual(ManualClock),
    /// Every node that holds keys, and the test's prefix.
    Redis(Vec<String>, String),
}

impl Time {
    async fn pass(&self, by: Duration) {
        match self {
            Time::Manual(clock) => clock.advance(by),
            Time::Redis(nodes, prefix) => {
                for node in nodes {
                    age(node, prefix, by).await;
                }
            }
        }
    }
}

/// Ages every key of `prefix` on one server by `by`.
async fn age(node: &str, prefix: &str, by: Duration) {
    let client = ::redis::Client::open(node).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let by = by.as_millis() as i64;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(500)
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    for key in keys {
        let left: i64 = ::redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if left < 0 {
            continue; // no TTL (-1: it lives for ever) or gone (-2)
        }
        let cmd = if left > by {
            let mut c = ::redis::cmd("PEXPIRE");
            c.arg(&key).arg(left - by);
            c
        } else {
            let mut c = ::redis::cmd("DEL");
            c.arg(&key);
            c
        };
        let _: i64 = cmd.query_async(&mut conn).await.unwrap();
    }
}

macro_rules! timed_conformance {
    ($($name:ident),* $(,)?) => {
        mod timed_redis_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let redis = super::TestRedis::new().await;
                    let store = super::RedisStore::connect(redis.url(), redis.prefix()).await.unwrap();
                    let time = super::Time::Redis(redis.nodes().to_vec(), redis.prefix().to_owned());
                    super::$name(std::sync::Arc::new(store), time).await;
                }
            )*
        }
        mod timed_cluster_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let redis = super::TestRedis::cluster().await;
                    let store = super::RedisStore::connect(redis.url(), redis.prefix()).await.unwrap();
                    let time = super::Time::Redis(redis.nodes().to_vec(), redis.prefix().to_owned());
                    super::$name(std::sync::Arc::new(store), time).await;
                }
            )*
        }
        mod timed_memory_store {
            $(
                #[tokio::test]
                async fn $name() {
                    let clock = runplane_clock::ManualClock::new(chrono::Utc::now());
                    let store = super::MemoryStore::with_clock(std::sync::Arc::new(clock.clone()));
                    super::$name(std::sync::Arc::new(store), super::Time::Manual(clock)).await;
                }
            )*
        }
    };
}

timed_conformance!(
    an_idle_buffer_expires_after_its_ttl,
    a_lease_key_lives_four_leases_and_a_parked_one_until_unparked,
    a_budget_lives_a_day_after_its_last_claim,
    an_orgs_hour_is_pruned_and_a_late_refund_leaves_nothing,
    the_index_of_runs_expires,
);

conformance!(
    the_claims_wait_what_backoff_ms_says,
    only_the_first_controller_acquires_and_the_holder_gets_its_token_back,
    a_later_attempts_runner_gets_a_fresh_lease_without_a_takeover,
    appends_are_fenced_idempotent_contiguous_and_budgeted,
    the_buffer_trims_and_reads_report_the_first_kept_frame,
    a_lowered_frame_limit_trims_a_long_buffer_at_once,
    takeovers_are_immediate_then_wait_then_exhaust_after_five,
    a_quiet_window_starts_a_fresh_budget,
    a_parked_run_is_never_taken_over,
    concurrent_claims_claim_once,
    a_claim_fences_the_previous_controller,
    an_orgs_hourly_budget_is_reserved_refused_and_refunded,
    an_orgs_buffers_hold_at_most_its_bound_over_the_buffer_lifetime,
    a_frame_older_than_the_buffer_ttl_is_trimmed_though_the_stream_goes_on,
    a_run_whose_lease_was_never_granted_is_never_claimed,
    a_lost_lease_is_no_fence_and_a_controller_resyncs_past_lost_frames,
);

/// The run's first controller held the lease until `lapsed_at`: there is a lost
/// controller to replace from then on.
async fn started(s: &Arc<dyn RecoveryStore>, run: &str, lapsed_at: i64) {
    s.acquire(
        run,
        "first-controller",
        "first-token",
        500,
        lapsed_at - 500,
        1,
    )
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

async fn appends_are_fenced_idempotent_contiguous_and_budgeted(s: Arc<dyn RecoveryStore>) {
    let limits = BufferLimits {
        stream_bytes: 64,
        ..BufferLimits::default()
    };
    s.acquire("run-2", "ctl", "tok", TTL, T0, 1).await.unwrap();
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
    s.acquire("run-3", "ctl", "tok", TTL, T0, 1).await.unwrap();
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

/// A lowered `max_frames` trims a full buffer in one append (ten thousand frames at once,
/// more than one Lua `unpack` can take).
async fn a_lowered_frame_limit_trims_a_long_buffer_at_once(s: Arc<dyn RecoveryStore>) {
    s.acquire("run-long", "ctl", "tok", TTL, T0, 1)
        .await
        .unwrap();
    let limits = BufferLimits::default();
    for batch in 0..40u64 {
        let from = batch * 256 + 1;
        s.append(
            "run-long",
            "tok",
            &frames(from..=from + 255),
            T0,
            &limits,
            false,
        )
        .await
        .unwrap();
    }
    let lowered = BufferLimits {
        max_frames: 3,
        ..BufferLimits::default()
    };
    s.append(
        "run-long",
        "tok",
        &frames(10241..=10241),
        T0,
        &lowered,
        false,
    )
    .await
    .unwrap();
    let replay = s.read("run-long", 1, 100).await.unwrap();
    assert_eq!(replay.first_available, 10239);
    assert_eq!(
        replay.frames.iter().map(|f| f.sequence).collect::<Vec<_>>(),
        [10239, 10240, 10241]
    );
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
    s.acquire("run-6", "parked", "tok", TTL, T0, 1)
        .await
        .unwrap();
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
    s.acquire("run-8", "first", "old", TTL, T0, 1)
        .await
        .unwrap();
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

/// Limits with an org's hourly budget `hour` and buffer bound `held`.
fn org_limits(hour: u64, held: u64) -> BufferLimits {
    BufferLimits {
        org_hour_bytes: hour,
        org_buffer_bytes: held,
        ..BufferLimits::default()
    }
}

async fn an_orgs_hourly_budget_is_reserved_refused_and_refunded(s: Arc<dyn RecoveryStore>) {
    let limits = org_limits(100, 1 << 30);
    assert_eq!(s.charge_org("acme", 7, 60, &limits).await.unwrap(), 40);
    assert_eq!(
        s.charge_org("acme", 7, 50, &limits).await,
        Err(StoreError::BudgetExceeded { scope: "org_hour" }),
        "a refusal charges nothing"
    );
    s.refund_org("acme", 7, 20).await.unwrap();
    assert_eq!(s.charge_org("acme", 7, 60, &limits).await.unwrap(), 0);
    // Another hour, another org: budgets of their own.
    assert_eq!(s.charge_org("acme", 8, 10, &limits).await.unwrap(), 90);
    assert_eq!(s.charge_org("globex", 7, 10, &limits).await.unwrap(), 90);
}

/// What an org's buffers may hold (250 here) is checked against everything its streams
/// appended in the hours a buffer may still hold frames of (the default 24 h ttl: 25
/// hours): an org within its hourly budget every hour is still refused once the window
/// holds its bound, by scope; a refund gives room back; another org is not touched; and
/// once the early hours leave the window, there is room again.
async fn an_orgs_buffers_hold_at_most_its_bound_over_the_buffer_lifetime(
    s: Arc<dyn RecoveryStore>,
) {
    let limits = org_limits(100, 250);
    assert_eq!(limits.window_hours(), 25);
    assert_eq!(s.charge_org("acme", 100, 100, &limits).await.unwrap(), 0);
    assert_eq!(s.charge_org("acme", 110, 100, &limits).await.unwrap(), 0);
    assert_eq!(
        s.charge_org("acme", 124, 60, &limits).await,
        Err(StoreError::BudgetExceeded {
            scope: "org_buffer"
        }),
        "hour 124's window (100..=124) holds 200 of 250"
    );
    assert_eq!(s.charge_org("acme", 124, 50, &limits).await.unwrap(), 50);
    assert_eq!(
        s.charge_org("acme", 124, 1, &limits).await,
        Err(StoreError::BudgetExceeded {
            scope: "org_buffer"
        })
    );
    s.refund_org("acme", 124, 20).await.unwrap();
    assert_eq!(s.charge_org("acme", 124, 20, &limits).await.unwrap(), 50);
    assert_eq!(s.charge_org("globex", 124, 100, &limits).await.unwrap(), 0);
    // Hour 100 has left hour 125's window: its 100 bytes are no longer held.
    assert_eq!(s.charge_org("acme", 125, 100, &limits).await.unwrap(), 0);
}

/// A stream that keeps appending keeps its buffer alive, never its old frames: frames
/// appended longer than the ttl ago are trimmed at the next append, so an org's buffers
/// hold only what its window counts, and a late reader is told where the buffer starts.
async fn a_frame_older_than_the_buffer_ttl_is_trimmed_though_the_stream_goes_on(
    s: Arc<dyn RecoveryStore>,
) {
    let limits = BufferLimits {
        ttl: Duration::from_secs(3600),
        ..BufferLimits::default()
    };
    s.acquire("run-age", "ctl", "tok", TTL, T0, 1)
        .await
        .unwrap();
    s.append("run-age", "tok", &frames(1..=3), T0, &limits, false)
        .await
        .unwrap();
    s.append(
        "run-age",
        "tok",
        &frames(4..=5),
        T0 + 1_800_000,
        &limits,
        false,
    )
    .await
    .unwrap();
    // An hour and a second after the first three: they go, the later two stay.
    s.append(
        "run-age",
        "tok",
        &frames(6..=6),
        T0 + 3_601_000,
        &limits,
        false,
    )
    .await
    .unwrap();
    let replay = s.read("run-age", 1, 100).await.unwrap();
    assert_eq!(replay.first_available, 4);
    assert_eq!(
        replay.frames.iter().map(|f| f.sequence).collect::<Vec<_>>(),
        [4, 5, 6]
    );
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
        .acquire(
            "run-9",
            "late-runner",
            "late-token",
            TTL,
            T0 + 21 * 61_000,
            1,
        )
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
    s.acquire("run-10", "ctl", "tok", TTL, T0, 1).await.unwrap();
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

const SECOND: Duration = Duration::from_secs(1);

async fn an_idle_buffer_expires_after_its_ttl(s: Arc<dyn RecoveryStore>, t: Time) {
    let limits = BufferLimits {
        ttl: Duration::from_secs(600),
        ..BufferLimits::default()
    };
    s.acquire("run-t1", "ctl", "tok", TTL, T0, 1).await.unwrap();
    s.append("run-t1", "tok", &frames(1..=3), T0, &limits, false)
        .await
        .unwrap();
    t.pass(limits.ttl - SECOND).await;
    let kept = s.read("run-t1", 1, 100).await.unwrap();
    assert_eq!((kept.frames.len(), kept.next_sequence), (3, 4));
    t.pass(2 * SECOND).await;
    let gone = s.read("run-t1", 1, 100).await.unwrap();
    assert_eq!((gone.frames.len(), gone.next_sequence), (0, 1), "{gone:?}");
    // A run granted and never appended to: its lost controller is known as lost (a
    // claim replaces it) until the state's TTL, long after its lease key went.
    s.acquire("run-t1b", "ctl", "tok", TTL, T0, 1)
        .await
        .unwrap();
    t.pass(STATE_TTL - SECOND).await;
    assert!(matches!(
        s.claim("run-t1b", &claim(T0 + 10 * TTL, "t"))
            .await
            .unwrap(),
        ClaimOutcome::Claimed { attempt: 1, .. }
    ));
    s.acquire("run-t1c", "ctl", "tok", TTL, T0, 1)
        .await
        .unwrap();
    t.pass(STATE_TTL + SECOND).await;
    assert_eq!(
        s.claim("run-t1c", &claim(T0 + 10 * TTL, "t"))
            .await
            .unwrap(),
        ClaimOutcome::NoControllerYet,
        "nothing is left of it"
    );
}

async fn a_lease_key_lives_four_leases_and_a_parked_one_until_unparked(
    s: Arc<dyn RecoveryStore>,
    t: Time,
) {
    let gc = Duration::from_millis((TTL * LEASE_GC_FACTOR) as u64);
    s.acquire("run-t2", "ctl", "tok", TTL, T0, 1).await.unwrap();
    t.pass(gc - SECOND).await;
    assert!(s.budget("run-t2", T0).await.unwrap().lease.is_some());
    t.pass(2 * SECOND).await;
    assert!(
        s.budget("run-t2", T0).await.unwrap().lease.is_none(),
        "the lease key expired"
    );

    s.acquire("run-t3", "ctl", "tok", TTL, T0, 1).await.unwrap();
    assert!(s.park("run-t3").await.unwrap());
    t.pass(STATE_TTL * 2).await;
    let parked = s.budget("run-t3", T0 + 10 * TTL).await.unwrap();
    assert!(parked.parked && parked.lease.is_some(), "{parked:?}");
    assert!(s.unpark("run-t3", TTL, T0).await.unwrap());
    t.pass(gc + SECOND).await;
    assert!(s.budget("run-t3", T0).await.unwrap().lease.is_none());
}

async fn a_budget_lives_a_day_after_its_last_claim(s: Arc<dyn RecoveryStore>, t: Time) {
    started(&s, "run-t4", T0).await;
    assert!(matches!(
        s.claim("run-t4", &claim(T0, "t1")).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 1, .. }
    ));
    t.pass(STATE_TTL - SECOND).await;
    assert_eq!(s.budget("run-t4", T0).await.unwrap().attempts, 1);
    t.pass(2 * SECOND).await;
    assert_eq!(s.budget("run-t4", T0).await.unwrap().attempts, 0);
}

async fn an_orgs_hour_is_pruned_and_a_late_refund_leaves_nothing(
    s: Arc<dyn RecoveryStore>,
    t: Time,
) {
    let limits = org_limits(100, 1 << 30);
    let counter_ttl = Duration::from_millis(limits.org_counter_ttl_ms() as u64);
    assert_eq!(s.charge_org("acme", 9, 60, &limits).await.unwrap(), 40);
    t.pass(counter_ttl - SECOND).await;
    assert!(
        s.charge_org("acme", 9, 60, &limits).await.is_err(),
        "still counted"
    );
    t.pass(2 * SECOND).await;
    // The counter is gone: a refund for it gives nothing back, and the hour starts at 0.
    s.refund_org("acme", 9, 60).await.unwrap();
    assert_eq!(s.charge_org("acme", 9, 100, &limits).await.unwrap(), 0);
}

async fn the_index_of_runs_expires(s: Arc<dyn RecoveryStore>, t: Time) {
    s.acquire("run-t5", "ctl", "tok", TTL, T0, 1).await.unwrap();
    assert_eq!(s.runs("", 10).await.unwrap(), ["run-t5"]);
    t.pass(STATE_TTL + SECOND).await;
    assert!(s.runs("", 10).await.unwrap().is_empty());
}

async fn the_claims_wait_what_backoff_ms_says(s: Arc<dyn RecoveryStore>) {
    started(&s, "run-b", T0).await;
    let mut now = T0;
    for attempt in 1..=MAX_ATTEMPTS {
        let token = format!("t{attempt}");
        let args = ClaimArgs {
            jitter: 0.37,
            ..short_claim(now, &token)
        };
        let ClaimOutcome::Claimed { not_before_ms, .. } = s.claim("run-b", &args).await.unwrap()
        else {
            panic!("claim {attempt} was not made");
        };
        assert_eq!(
            not_before_ms - now,
            backoff_ms(attempt, 0.37),
            "claim {attempt}"
        );
        now = not_before_ms;
    }
}

/// On the cluster, every run's keys hash to one slot (a script whose keys spanned two
/// slots would be refused with CROSSSLOT), and runs spread over the masters.
#[tokio::test]
async fn on_a_cluster_a_runs_keys_share_one_slot_and_runs_spread_over_the_masters() {
    let redis = TestRedis::cluster().await;
    let store = RedisStore::connect(redis.url(), redis.prefix())
        .await
        .unwrap();
    let client = ::redis::cluster::ClusterClient::new(redis.nodes().to_vec()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let mut owners = std::collections::BTreeSet::new();
    for i in 0..24 {
        let run = format!("run-{i}");
        // Every script, so every key exists.
        started_store(&store, &run).await;
        let keys = store.run_keys(&run);
        let mut slots = std::collections::BTreeSet::new();
        for key in &keys {
            let slot: i64 = ::redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
            slots.insert(slot);
        }
        assert_eq!(slots.len(), 1, "{run}: keys {keys:?} span slots {slots:?}");
        owners.insert(owner(redis.nodes(), &keys[0]).await);
    }
    assert!(owners.len() >= 2, "24 runs all on {owners:?}");
    // Nothing was written outside the runs' keys, the index and nothing else.
    let mut expected: std::collections::BTreeSet<String> = (0..24)
        .flat_map(|i| store.run_keys(&format!("run-{i}")))
        .collect();
    expected.insert(format!("{}runs", redis.prefix()));
    for key in redis.keys().await {
        assert!(expected.contains(&key), "unexpected key {key}");
    }
}

/// Drives one run through acquire, append, renew, park, unpark, claim and unclaim.
async fn started_store(store: &RedisStore, run: &str) {
    store.acquire(run, "c", "t1", TTL, T0, 1).await.unwrap();
    store
        .append(
            run,
            "t1",
            &frames(1..=3),
            T0,
            &BufferLimits::default(),
            false,
        )
        .await
        .unwrap();
    store.renew(run, "t1", TTL, T0 + 1).await.unwrap();
    assert!(store.park(run).await.unwrap());
    assert!(store.unpark(run, TTL, T0 + 2).await.unwrap());
    store.read(run, 1, 10).await.unwrap();
    let later = T0 + 2 + TTL + 1;
    assert!(matches!(
        store.claim(run, &claim(later, "t2")).await.unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
    assert!(store.unclaim(run, "t2").await.unwrap());
    store.budget(run, later).await.unwrap();
}

/// The node (of `nodes`) that holds `key`.
async fn owner(nodes: &[String], key: &str) -> String {
    for node in nodes {
        let client = ::redis::Client::open(node.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let exists: i64 = ::redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap_or(0);
        if exists == 1 {
            return node.clone();
        }
    }
    panic!("{key} is on no node");
}
