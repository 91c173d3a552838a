//! A recovery storm, and what the Lua steps cost.
//!
//! Storm: a run whose controllers keep dying (each takeover's lease lapses a second
//! later) is tailed by 1 or 3 readers that each plan a recovery once a second, as `Tail`
//! does. Over 60 s of simulated time the table counts resume requests (claims handed to
//! the runner) with runplane's budget and with an unbounded baseline that claims whenever
//! the lease is free (the seed's "before"). Time is simulated, so the 60 s take
//! milliseconds and the counts are exact.
//!
//! Throughput: the store's claim and append against real Redis, each beside the same
//! script call (same keys, same arguments) sent as a bare EVALSHA on a plain connection,
//! which is the ceiling the store's own work is measured against; a plain SET and an
//! EVALSHA of a trivial script show what the scripts themselves cost. 16 concurrent
//! callers each.
//!
//! Run: `cargo bench -p runplane-stream-recovery --bench storm` (needs the local Redis).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use runplane_stream_recovery::domain::policy::BufferLimits;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_stream_recovery::store::{ClaimArgs, ClaimOutcome, RecoveryStore};
use runplane_testkit::TestRedis;

const SIMULATED_MS: i64 = 60_000;
const STEP_MS: i64 = 100;
/// A taken-over controller dies this long after its claim.
const CONTROLLER_LIFE_MS: i64 = 1_000;

/// Resume requests runplane's budget allows over the storm.
async fn runplane_storm(store: &dyn RecoveryStore, run: &str, tails: usize) -> u32 {
    let mut resumes = 0;
    let mut now = 1_800_000_000_000;
    // The run's first controller held the lease and died: there is one to replace.
    store
        .acquire(
            run,
            "first",
            "first",
            CONTROLLER_LIFE_MS,
            now - CONTROLLER_LIFE_MS,
            1,
        )
        .await
        .unwrap();
    let end = now + SIMULATED_MS;
    let mut next_poll = vec![now; tails];
    while now < end {
        for poll in next_poll.iter_mut() {
            if now >= *poll {
                *poll = now + 1_000;
                let token = format!("t{now}");
                let outcome = store
                    .claim(
                        run,
                        &ClaimArgs {
                            now_ms: now,
                            token: &token,
                            controller: "storm",
                            lease_ttl_ms: CONTROLLER_LIFE_MS,
                            jitter: rand::random(),
                        },
                    )
                    .await
                    .unwrap();
                match outcome {
                    ClaimOutcome::Claimed { .. } => resumes += 1,
                    ClaimOutcome::Exhausted { .. } => return resumes,
                    _ => {}
                }
            }
        }
        now += STEP_MS;
    }
    resumes
}

/// The baseline: every poll that finds the lease free re-hands the run.
fn unbounded_storm(tails: usize) -> u32 {
    let mut resumes = 0;
    let mut now = 0;
    let mut lease_until = -1;
    let mut next_poll = vec![0; tails];
    while now < SIMULATED_MS {
        for poll in next_poll.iter_mut() {
            if now >= *poll {
                *poll = now + 1_000;
                if now >= lease_until {
                    lease_until = now + CONTROLLER_LIFE_MS;
                    resumes += 1;
                }
            }
        }
        now += STEP_MS;
    }
    resumes
}

fn claim_args(token: &str) -> ClaimArgs<'_> {
    ClaimArgs {
        now_ms: 1_800_000_000_000,
        token,
        controller: "bench",
        lease_ttl_ms: 30_000,
        jitter: 0.5,
    }
}

type Op = Arc<dyn Fn(usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Seconds `workers` concurrent callers take for calls `from..from + count` of `op`.
async fn timed(op: Op, from: usize, count: usize, workers: usize) -> f64 {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            for i in (from + w..from + count).step_by(workers) {
                op(i).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let redis = TestRedis::new().await;
    let store = Arc::new(
        RedisStore::connect(redis.url(), redis.prefix())
            .await
            .unwrap(),
    );

    println!(
        "storm: controllers die 1 s after each takeover, tails plan once a second, 60 s simulated"
    );
    println!("{:<34} {:>6} {:>16}", "policy", "tails", "resume requests");
    for tails in [1, 3] {
        let ours = runplane_storm(store.as_ref(), &format!("storm-{tails}"), tails).await;
        println!(
            "{:<34} {:>6} {:>16}",
            "runplane (5 takeovers, backoff)", tails, ours
        );
        println!(
            "{:<34} {:>6} {:>16}",
            "unbounded (claim when free)",
            tails,
            unbounded_storm(tails)
        );
    }

    let rounds = 8;
    let per_round = 2_500;
    let ops = rounds * per_round;
    let workers = 16;
    let client = redis::Client::open(redis.url()).unwrap();
    let conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let prefix = redis.prefix().to_owned();

    // Claims: each run's first controller held its lease and lost it. The store's claim
    // and the same script by a bare EVALSHA, each on runs of its own.
    for i in 0..ops {
        for kind in ["claim", "raw-claim"] {
            store
                .acquire(
                    &format!("{kind}-{i}"),
                    "first",
                    "first",
                    5_000,
                    1_700_000_000_000,
                    1,
                )
                .await
                .unwrap();
        }
    }
    // Appends: each worker its own run and lease, one frame per call.
    for w in 0..workers {
        for kind in ["append", "raw-append"] {
            store
                .acquire(
                    &format!("{kind}-{w}"),
                    "bench-controller",
                    &format!("tok-{w}"),
                    600_000,
                    1_800_000_000_000,
                    1,
                )
                .await
                .unwrap();
        }
    }
    const LINE: &[u8] = b"a line of agent output of typical length";
    let limits = BufferLimits::default();
    let frame = move |i: usize| {
        let w = i % workers;
        (w, [((i / workers) as u64 + 1, LINE.to_vec())])
    };

    let mut ops_list: Vec<(&str, Op)> = Vec::new();
    let s = store.clone();
    ops_list.push((
        "claim",
        Arc::new(move |i| {
            let s = s.clone();
            Box::pin(async move {
                let token = format!("tok-{i}");
                let outcome = s
                    .claim(&format!("claim-{i}"), &claim_args(&token))
                    .await
                    .unwrap();
                assert!(matches!(outcome, ClaimOutcome::Claimed { .. }));
            })
        }),
    ));
    let (s, c) = (store.clone(), conn.clone());
    ops_list.push((
        "raw claim",
        Arc::new(move |i| {
            let (s, mut c) = (s.clone(), c.clone());
            Box::pin(async move {
                let token = format!("tok-{i}");
                let out: Vec<redis::Value> = s
                    .claim_invocation(&format!("raw-claim-{i}"), &claim_args(&token))
                    .invoke_async(&mut c)
                    .await
                    .unwrap();
                assert_eq!(out[0], redis::Value::BulkString(b"claimed".to_vec()));
            })
        }),
    ));
    let s = store.clone();
    ops_list.push((
        "append",
        Arc::new(move |i| {
            let s = s.clone();
            let (w, frames) = frame(i);
            Box::pin(async move {
                s.append(
                    &format!("append-{w}"),
                    &format!("tok-{w}"),
                    &frames,
                    1_800_000_000_000,
                    &limits,
                    false,
                )
                .await
                .unwrap();
            })
        }),
    ));
    let (s, c) = (store.clone(), conn.clone());
    ops_list.push((
        "raw append",
        Arc::new(move |i| {
            let (s, mut c) = (s.clone(), c.clone());
            let (w, frames) = frame(i);
            Box::pin(async move {
                let out: Vec<redis::Value> = s
                    .append_invocation(
                        &format!("raw-append-{w}"),
                        &format!("tok-{w}"),
                        &frames,
                        1_800_000_000_000,
                        &limits,
                        false,
                    )
                    .invoke_async(&mut c)
                    .await
                    .unwrap();
                assert_eq!(out[0], redis::Value::BulkString(b"ok".to_vec()));
            })
        }),
    ));
    let c = conn.clone();
    ops_list.push((
        "set",
        Arc::new(move |i| {
            let mut c = c.clone();
            let key = format!("{prefix}set-{i}");
            Box::pin(async move {
                let _: () = redis::cmd("SET")
                    .arg(key)
                    .arg("v")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            })
        }),
    ));
    let trivial = Arc::new(redis::Script::new("return 1"));
    let c = conn.clone();
    ops_list.push((
        "eval",
        Arc::new(move |_| {
            let (mut c, script) = (c.clone(), trivial.clone());
            Box::pin(async move {
                let _: i64 = script.invoke_async(&mut c).await.unwrap();
            })
        }),
    ));

    // Interleaved rounds: each operation runs a slice of its calls in turn, so a change in
    // the machine's load during the run falls on all of them alike.
    let mut elapsed = vec![0f64; ops_list.len()];
    for round in 0..rounds {
        for (k, (_, op)) in ops_list.iter().enumerate() {
            elapsed[k] += timed(op.clone(), round * per_round, per_round, workers).await;
        }
    }
    let rate = |name: &str| {
        let k = ops_list.iter().position(|(n, _)| *n == name).unwrap();
        ops as f64 / elapsed[k]
    };
    let eval = rate("eval");

    println!();
    println!(
        "Redis operations, {ops} each in {rounds} interleaved rounds, {workers} concurrent callers, one process"
    );
    println!(
        "{:<22} {:>12} {:>22} {:>14} {:>22}",
        "operation",
        "store ops/s",
        "same script, raw ops/s",
        "store / raw",
        "store / EVALSHA ret 1"
    );
    for (name, ours, raw) in [
        ("claim (Lua)", rate("claim"), rate("raw claim")),
        ("append 1 frame (Lua)", rate("append"), rate("raw append")),
    ] {
        println!(
            "{:<22} {:>12.0} {:>22.0} {:>14.2} {:>22.2}",
            name,
            ours,
            raw,
            ours / raw,
            ours / eval
        );
    }
    println!("{:<22} {:>12} {:>22.0}", "SET (raw)", "", rate("set"));
    println!("{:<22} {:>12} {:>22.0}", "EVALSHA return 1 (raw)", "", eval);
}
