//! A recovery storm, and what the Lua steps cost.
//!
//! Storm: a run whose controllers keep dying (each takeover's lease lapses a second
//! later) is tailed by 1 or 3 readers that each plan a recovery once a second, as `Tail`
//! does. Over 60 s of simulated time the table counts resume requests (claims handed to
//! the runner) with runplane's budget and with an unbounded baseline that claims whenever
//! the lease is free (the seed's "before"). Time is simulated, so the 60 s take
//! milliseconds and the counts are exact.
//!
//! Throughput: claim and append scripts against real Redis, beside a plain SET and an
//! EVALSHA of a trivial script, all with 16 concurrent callers.
//!
//! Run: `cargo bench -p runplane-stream-recovery --bench storm` (needs the local Redis).

use std::sync::Arc;
use std::time::Instant;

use runplane_stream_recovery::policy::BufferLimits;
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

async fn rate<F, Fut>(ops: usize, workers: usize, f: F) -> f64
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            for i in (w..ops).step_by(workers) {
                f(i).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    ops as f64 / started.elapsed().as_secs_f64()
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

    let ops = 20_000;
    let workers = 16;
    let client = redis::Client::open(redis.url()).unwrap();
    let conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let prefix = redis.prefix().to_owned();

    // Claims: each run's first controller held its lease and lost it.
    for i in 0..ops {
        store
            .acquire(
                &format!("claim-{i}"),
                "first",
                "first",
                5_000,
                1_700_000_000_000,
            )
            .await
            .unwrap();
    }
    let claim_store = store.clone();
    let claim = rate(ops, workers, move |i| {
        let store = claim_store.clone();
        async move {
            let token = format!("tok-{i}");
            store
                .claim(
                    &format!("claim-{i}"),
                    &ClaimArgs {
                        now_ms: 1_800_000_000_000,
                        token: &token,
                        controller: "bench",
                        lease_ttl_ms: 30_000,
                        jitter: 0.5,
                    },
                )
                .await
                .unwrap();
        }
    })
    .await;
    // Appends: each worker its own run and lease, one frame per call.
    for w in 0..workers {
        store
            .acquire(
                &format!("append-{w}"),
                "bench-controller",
                &format!("tok-{w}"),
                600_000,
                1_800_000_000_000,
            )
            .await
            .unwrap();
    }
    let append_store = store.clone();
    let limits = BufferLimits::default();
    let append = rate(ops, workers, move |i| {
        let store = append_store.clone();
        async move {
            let w = i % 16;
            let sequence = (i / 16) as u64 + 1;
            store
                .append(
                    &format!("append-{w}"),
                    &format!("tok-{w}"),
                    &[(
                        sequence,
                        b"a line of agent output of typical length".to_vec(),
                    )],
                    1_800_000_000_000,
                    &limits,
                    false,
                )
                .await
                .unwrap();
        }
    })
    .await;
    let set_conn = conn.clone();
    let set_prefix = prefix.clone();
    let set = rate(ops, workers, move |i| {
        let mut conn = set_conn.clone();
        let key = format!("{set_prefix}set-{i}");
        async move {
            let _: () = redis::cmd("SET")
                .arg(key)
                .arg("v")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    })
    .await;
    let trivial = Arc::new(redis::Script::new("return 1"));
    let eval_conn = conn.clone();
    let eval = rate(ops, workers, move |_| {
        let mut conn = eval_conn.clone();
        let script = trivial.clone();
        async move {
            let _: i64 = script.invoke_async(&mut conn).await.unwrap();
        }
    })
    .await;

    println!();
    println!("Redis operations, {ops} each, {workers} concurrent callers");
    println!(
        "{:<30} {:>12} {:>18} {:>20}",
        "operation", "ops/s", "vs SET", "vs EVALSHA return 1"
    );
    for (name, r) in [
        ("claim (Lua)", claim),
        ("append 1 frame (Lua)", append),
        ("SET (raw)", set),
        ("EVALSHA return 1 (raw)", eval),
    ] {
        println!(
            "{:<30} {:>12.0} {:>18.2} {:>20.2}",
            name,
            r,
            r / set,
            r / eval
        );
    }
}
