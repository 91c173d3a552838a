//! Weighted fair share under a deep queue: what ClaimSlots costs with 10,000 runs
//! waiting, whether each org gets the share of starts its weight says, and how evenly
//! the orgs wait.
//!
//! One run store on Postgres, over real gRPC on a real socket. 100 orgs queue 100 runs
//! each (10,000) on one credential of capacity 50; orgs 0–9 have weight 3, the other 90
//! weight 1 (`[run_store.tenancy.orgs]`), so a heavy org should get 3/120 of the starts
//! and a light one 1/120. The runs are created org by org, one burst of 100 per org in
//! a fixed shuffled order, so the oldest runs of the queue all belong to a few orgs —
//! the worst case for first-come-first-served.
//!
//! Then a dispatcher loop: it calls ClaimSlots (capacity 50, `max_runs` 100), gives
//! every run it claimed a simulated duration (uniformly 20–60 ms from a fixed-seed RNG)
//! after which the run is cancelled, which frees its slot, waits for a slot to free and
//! claims again, until [`STARTS`] runs have started. No org can run out of queued runs
//! in that window (a heavy org starts about 75 of its 100), so every org stays
//! backlogged and the share is the scheduler's alone. Three tables:
//!
//! - **ClaimSlots latency** over the loop's calls, beside a raw baseline: one plain
//!   `SELECT count(*) FROM runs WHERE state = 'queued'` through sea-orm on the same
//!   database, sent after each claim (so at the same queue depth). The ratio is
//!   ClaimSlots / baseline at p50. Goal: ClaimSlots p99 ≤ [`GOAL_P99_MS`] ms. The
//!   rows below split the calls: the first (which also writes the waiting reason of
//!   every run it passes over) and the later ones by how many runs they claimed, since
//!   a claim's statements grow with the runs and orgs it starts.
//! - **Fairness**: starts per weight class against the share their weights give, and
//!   each org's starts against its own expected share. Goal: every org within ±10 %.
//! - **Start delay**: each org's mean wait, from the run's `created_at` to the claim
//!   (which includes when its burst was created), and from the dispatcher's start to
//!   the claim (the part the scheduler decides); the spread is the largest over the
//!   smallest per-org mean.
//!
//! Timings are printed, never asserted. Run:
//! `cargo bench -p runplane-run-store --bench tenancy` (needs the local Postgres).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use runplane_config::OrgTenancy;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestDatabase, authed};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tonic::transport::Channel;

const TOKEN: &str = "bench-service-token-0123456789abcdef0123";
const ORGS: usize = 100;
const RUNS_PER_ORG: usize = 100;
/// Orgs `0..HEAVY_ORGS` have weight [`HEAVY_WEIGHT`]; the rest the default, 1.
const HEAVY_ORGS: usize = 10;
const HEAVY_WEIGHT: u32 = 3;
const CREDENTIAL: &str = "shared-credential";
const CAPACITY: u32 = 50;
const MAX_RUNS: u32 = 100;
/// Starts the dispatcher makes before the measurement ends.
const STARTS: usize = 3000;
/// A claimed run lives this long (uniformly, in ms) before it is cancelled.
const DURATION_MS: std::ops::RangeInclusive<u64> = 20..=60;
/// CreateRun calls in flight within one org's burst.
const CREATE_CONCURRENCY: usize = 16;
const SEED: u64 = 0x7e4a_2c0f_5eed_0001;
const GOAL_P99_MS: f64 = 50.0;
/// How far an org's starts may stray from its weight's share.
const GOAL_TOLERANCE: f64 = 0.10;

fn org_name(org: usize) -> String {
    format!("org-{org:02}")
}

fn weight(org: usize) -> u32 {
    if org < HEAVY_ORGS { HEAVY_WEIGHT } else { 1 }
}

fn total_weight() -> u32 {
    (0..ORGS).map(weight).sum()
}

fn micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

fn timestamp_us(t: &prost_types::Timestamp) -> i64 {
    t.seconds * 1_000_000 + i64::from(t.nanos) / 1000
}

async fn create_run(channel: Channel, org: usize, n: usize) -> i64 {
    let run = RunServiceClient::new(channel)
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: format!("tenancy-bench-{org:03}-{n:04}-request"),
                org_id: org_name(org),
                lead_id: "bench".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    CREDENTIAL.into(),
                )),
                command: "agent".into(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    timestamp_us(run.created_at.as_ref().expect("created_at"))
}

async fn claim(client: &mut RunServiceClient<Channel>, max_runs: u32) -> Vec<runstore_pb::Run> {
    client
        .claim_slots(authed(
            runstore_pb::ClaimSlotsRequest {
                credentials: vec![runstore_pb::CredentialSlots {
                    credential_id: CREDENTIAL.into(),
                    capacity: CAPACITY,
                    unavailable: String::new(),
                    ..Default::default()
                }],
                unlimited: false,
                max_runs,
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .claimed
}

/// Lets `run_id` run for `after`, then cancels it, freeing its slot, and says so.
async fn finish_after(
    channel: Channel,
    run_id: String,
    after: Duration,
    freed: mpsc::UnboundedSender<()>,
) {
    tokio::time::sleep(after).await;
    RunServiceClient::new(channel)
        .cancel_run(authed(
            runstore_pb::CancelRunRequest {
                idempotency_key: format!("tenancy-bench-cancel-{run_id}"),
                run_id,
                reason: "simulated run finished".into(),
            },
            TOKEN,
        ))
        .await
        .unwrap();
    let _ = freed.send(());
}

/// The baseline: one plain query against the same database; the runs queued.
async fn count_queued(db: &DatabaseConnection) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT count(*) AS n FROM runs WHERE state = 'queued'",
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get("", "n").unwrap()
}

/// One start the dispatcher made.
struct Start {
    org: usize,
    /// From the run's `created_at` to the claim's answer.
    since_created: Duration,
    /// From the dispatcher's first claim to the claim's answer.
    since_dispatch: Duration,
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

fn mean(ds: &[Duration]) -> Duration {
    ds.iter().sum::<Duration>() / ds.len().max(1) as u32
}

/// The smallest and largest of `values`, and the largest over the smallest.
fn spread(values: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    (lo, hi, hi / lo)
}

#[tokio::main]
async fn main() {
    let db = TestDatabase::new().await;
    let mut config = runplane_testkit::config::run_store(TOKEN, db.url());
    for org in 0..HEAVY_ORGS {
        config.run_store.tenancy.orgs.insert(
            org_name(org),
            OrgTenancy {
                weight: Some(HEAVY_WEIGHT),
                ..Default::default()
            },
        );
    }
    let server = InProcessRunStore::start(&config).await;
    let channel = tonic::transport::Endpoint::from_shared(server.endpoint().to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let baseline_db = runplane_db::connect(db.url()).await.unwrap();
    let mut rng = StdRng::seed_from_u64(SEED);

    // The queue: one burst of RUNS_PER_ORG per org, the orgs in a shuffled order.
    let mut order: Vec<usize> = (0..ORGS).collect();
    order.shuffle(&mut rng);
    let created = Instant::now();
    let mut created_at: Vec<(i64, usize)> = Vec::with_capacity(ORGS * RUNS_PER_ORG);
    for &org in &order {
        let burst: Vec<i64> = futures::stream::iter(0..RUNS_PER_ORG)
            .map(|n| create_run(channel.clone(), org, n))
            .buffer_unordered(CREATE_CONCURRENCY)
            .collect()
            .await;
        created_at.extend(burst.into_iter().map(|at| (at, org)));
    }
    let creation = created.elapsed();
    created_at.sort_unstable();
    let fifo_orgs: std::collections::BTreeSet<usize> = created_at
        .iter()
        .take(STARTS)
        .map(|&(_, org)| org)
        .collect();

    // The dispatcher.
    let mut client = RunServiceClient::new(channel.clone());
    let (freed_tx, mut freed_rx) = mpsc::unbounded_channel();
    let mut cancels = JoinSet::new();
    // Each call's latency and the runs it claimed.
    let mut claim_calls: Vec<(Duration, usize)> = Vec::new();
    let mut baseline_latencies = Vec::new();
    let mut queued_seen = Vec::new();
    let mut starts: Vec<Start> = Vec::with_capacity(STARTS);
    let mut running = 0usize;
    let org_of: HashMap<String, usize> = (0..ORGS).map(|o| (org_name(o), o)).collect();
    let dispatch_start = SystemTime::now();
    let dispatching = Instant::now();
    while starts.len() < STARTS {
        let max_runs = MAX_RUNS.min((STARTS - starts.len()) as u32);
        let t = Instant::now();
        let claimed = claim(&mut client, max_runs).await;
        claim_calls.push((t.elapsed(), claimed.len()));
        let now = micros(SystemTime::now());
        for run in claimed {
            let created_us = timestamp_us(run.created_at.as_ref().expect("created_at"));
            starts.push(Start {
                org: org_of[&run.org_id],
                since_created: Duration::from_micros((now - created_us).max(0) as u64),
                since_dispatch: Duration::from_micros((now - micros(dispatch_start)).max(0) as u64),
            });
            let after = Duration::from_millis(rng.random_range(DURATION_MS));
            running += 1;
            cancels.spawn(finish_after(
                channel.clone(),
                run.id,
                after,
                freed_tx.clone(),
            ));
        }
        let t = Instant::now();
        queued_seen.push(count_queued(&baseline_db).await);
        baseline_latencies.push(t.elapsed());
        // Claim again once a slot is free, with every slot freed meanwhile.
        if starts.len() < STARTS && running > 0 {
            if tokio::time::timeout(Duration::from_secs(5), freed_rx.recv())
                .await
                .is_ok()
            {
                running -= 1;
            }
            while freed_rx.try_recv().is_ok() {
                running -= 1;
            }
        }
    }
    let window = dispatching.elapsed();
    while cancels.join_next().await.is_some() {}

    // 1. ClaimSlots latency.
    let first_claim = claim_calls[0].0;
    let mut claim_latencies: Vec<Duration> = claim_calls.iter().map(|c| c.0).collect();
    claim_latencies.sort();
    baseline_latencies.sort();
    let claim_p99 = percentile(&claim_latencies, 0.99);
    let base_p50 = percentile(&baseline_latencies, 0.5);
    println!(
        "ClaimSlots on Postgres over gRPC: {ORGS} orgs, {} runs queued on one credential \
         of capacity {CAPACITY}, max_runs {MAX_RUNS}",
        ORGS * RUNS_PER_ORG
    );
    println!();
    println!(
        "| {:<46} | {:>5} | {:>9} | {:>8} | {:>8} | {:>8} | {:>9} |",
        "call", "calls", "runs/call", "p50 ms", "p99 ms", "max ms", "ratio p50"
    );
    println!(
        "|{:-<48}|{:->7}|{:->11}|{:->10}|{:->10}|{:->10}|{:->11}|",
        "", "", "", "", "", "", ""
    );
    let row = |label: &str, calls: &[(Duration, usize)]| {
        if calls.is_empty() {
            return;
        }
        let mut latencies: Vec<Duration> = calls.iter().map(|c| c.0).collect();
        latencies.sort();
        let runs: usize = calls.iter().map(|c| c.1).sum();
        println!(
            "| {:<46} | {:>5} | {:>9.1} | {:>8} | {:>8} | {:>8} | {:>9.1} |",
            label,
            calls.len(),
            runs as f64 / calls.len() as f64,
            ms(percentile(&latencies, 0.5)),
            ms(percentile(&latencies, 0.99)),
            ms(*latencies.last().unwrap()),
            percentile(&latencies, 0.5).as_secs_f64() / base_p50.as_secs_f64(),
        );
    };
    row("ClaimSlots (gRPC, in-process run store)", &claim_calls);
    row(
        "- first call (also marks the rest waiting)",
        &claim_calls[..1],
    );
    for (lo, hi) in [(1, 10), (11, 25), (26, 100)] {
        let calls: Vec<(Duration, usize)> = claim_calls[1..]
            .iter()
            .copied()
            .filter(|c| (lo..=hi).contains(&c.1))
            .collect();
        row(&format!("- later calls claiming {lo}–{hi} runs"), &calls);
    }
    println!(
        "| {:<46} | {:>5} | {:>9} | {:>8} | {:>8} | {:>8} | {:>9.1} |",
        "raw baseline: SELECT count(*) queued (sea-orm)",
        baseline_latencies.len(),
        "-",
        ms(base_p50),
        ms(percentile(&baseline_latencies, 0.99)),
        ms(*baseline_latencies.last().unwrap()),
        1.0,
    );
    println!();
    println!(
        "Queued runs during the calls: {} after the first claim, {} after the last. \
         Creating the {} runs took {:.1} s; the {} starts took {:.1} s \
         ({:.0} starts/s). First call (claims {CAPACITY}, marks the rest waiting): {} ms.",
        queued_seen.first().unwrap(),
        queued_seen.last().unwrap(),
        ORGS * RUNS_PER_ORG,
        creation.as_secs_f64(),
        starts.len(),
        window.as_secs_f64(),
        starts.len() as f64 / window.as_secs_f64(),
        ms(first_claim),
    );

    // 2. Fairness.
    let mut per_org: BTreeMap<usize, Vec<&Start>> = (0..ORGS).map(|o| (o, Vec::new())).collect();
    for s in &starts {
        per_org.get_mut(&s.org).unwrap().push(s);
    }
    let total = starts.len() as f64;
    let tw = f64::from(total_weight());
    let expected = |org: usize| total * f64::from(weight(org)) / tw;
    // The weight classes: (name, weight; None for every org).
    let classes: [(&str, Option<u32>); 3] = [
        ("all", None),
        ("weight 3", Some(HEAVY_WEIGHT)),
        ("weight 1", Some(1)),
    ];
    let member = |o: usize, class: Option<u32>| class.is_none_or(|w| weight(o) == w);
    println!();
    println!(
        "Fairness over the {} starts (every org backlogged: the most starts of one org was {} \
         of its {RUNS_PER_ORG})",
        starts.len(),
        per_org.values().map(Vec::len).max().unwrap(),
    );
    println!();
    println!(
        "| {:<9} | {:>4} | {:>6} | {:>7} | {:>8} | {:>15} | {:>22} |",
        "orgs", "orgs", "starts", "share", "expected", "actual/expected", "org actual/exp min–max"
    );
    println!(
        "|{:-<11}|{:->6}|{:->8}|{:->9}|{:->10}|{:->17}|{:->24}|",
        "", "", "", "", "", "", ""
    );
    for &(name, class) in &classes {
        let orgs: Vec<usize> = (0..ORGS).filter(|&o| member(o, class)).collect();
        let n: usize = orgs.iter().map(|o| per_org[o].len()).sum();
        let exp: f64 = orgs.iter().map(|&o| expected(o)).sum();
        let (lo, hi, _) = spread(orgs.iter().map(|&o| per_org[&o].len() as f64 / expected(o)));
        println!(
            "| {:<9} | {:>4} | {:>6} | {:>6.2}% | {:>7.2}% | {:>15.3} | {:>22} |",
            name,
            orgs.len(),
            n,
            100.0 * n as f64 / total,
            100.0 * exp / total,
            n as f64 / exp,
            format!("{lo:.3}–{hi:.3}"),
        );
    }
    let (lo, hi, ratio) =
        spread((0..ORGS).map(|o| per_org[&o].len() as f64 / f64::from(weight(o))));
    println!();
    println!(
        "Starts / weight over the orgs: min {lo:.1}, max {hi:.1}, max/min {ratio:.3} \
         (expected {:.1} each).",
        total / tw
    );
    println!(
        "First-come-first-served would have given these {} starts to {} of the {ORGS} orgs \
         (the oldest runs), none to the other {}.",
        STARTS,
        fifo_orgs.len(),
        ORGS - fifo_orgs.len(),
    );

    // 3. Start delay.
    let mean_wait = |o: usize, f: fn(&Start) -> Duration| {
        let waits: Vec<Duration> = per_org[&o].iter().map(|s| f(s)).collect();
        mean(&waits).as_secs_f64() * 1000.0
    };
    let from_created: fn(&Start) -> Duration = |s| s.since_created;
    let from_dispatch: fn(&Start) -> Duration = |s| s.since_dispatch;
    println!();
    println!(
        "Start delay: each org's mean wait (ms) over its starts, from the run's created_at \
         and from the dispatcher's start; spread = largest / smallest org mean"
    );
    println!();
    println!(
        "| {:<9} | {:>9} | {:>9} | {:>6} | {:>9} | {:>9} | {:>6} |",
        "orgs", "created:min", "max", "spread", "dispatch:min", "max", "spread"
    );
    println!(
        "|{:-<11}|{:->13}|{:->11}|{:->8}|{:->14}|{:->11}|{:->8}|",
        "", "", "", "", "", "", ""
    );
    for &(name, class) in &classes {
        let orgs: Vec<usize> = (0..ORGS).filter(|&o| member(o, class)).collect();
        let (c_lo, c_hi, c_ratio) = spread(orgs.iter().map(|&o| mean_wait(o, from_created)));
        let (d_lo, d_hi, d_ratio) = spread(orgs.iter().map(|&o| mean_wait(o, from_dispatch)));
        println!(
            "| {:<9} | {:>11.0} | {:>9.0} | {:>6.2} | {:>12.0} | {:>9.0} | {:>6.2} |",
            name, c_lo, c_hi, c_ratio, d_lo, d_hi, d_ratio
        );
    }
    println!();
    println!(
        "Per org: starts · mean wait from created_at (s) · from dispatch start (s); \
         orgs 00–09 have weight {HEAVY_WEIGHT}; burst = the org's place in the creation order"
    );
    println!();
    let burst_of: HashMap<usize, usize> = order.iter().enumerate().map(|(i, &o)| (o, i)).collect();
    print!("| org |");
    for col in 0..5 {
        print!(" {:<22} |", format!("+{col}"));
    }
    println!();
    print!("|-----|");
    for _ in 0..5 {
        print!("{:->24}|", "");
    }
    println!();
    for row in (0..ORGS).step_by(5) {
        print!("| {row:02}  |");
        for o in row..row + 5 {
            print!(
                " {:>3} · {:>4.1} · {:>3.1} ({:>2})  |",
                per_org[&o].len(),
                mean_wait(o, from_created) / 1000.0,
                mean_wait(o, from_dispatch) / 1000.0,
                burst_of[&o],
            );
        }
        println!();
    }

    // Verdicts.
    let p99_ms = claim_p99.as_secs_f64() * 1000.0;
    println!();
    println!(
        "goal ClaimSlots p99 <= {GOAL_P99_MS:.0} ms: {} (p99 {p99_ms:.2} ms with {}–{} runs queued)",
        if p99_ms <= GOAL_P99_MS {
            "ok"
        } else {
            "MISSED"
        },
        queued_seen.last().unwrap(),
        queued_seen.first().unwrap(),
    );
    let off: Vec<(usize, f64)> = (0..ORGS)
        .map(|o| (o, per_org[&o].len() as f64 / expected(o)))
        .filter(|(_, r)| (r - 1.0).abs() > GOAL_TOLERANCE)
        .collect();
    let (lo, hi, _) = spread((0..ORGS).map(|o| per_org[&o].len() as f64 / expected(o)));
    println!(
        "goal each org within ±{:.0}% of its weight's share: {} ({} of {ORGS} orgs outside; \
         actual/expected {lo:.3}–{hi:.3})",
        GOAL_TOLERANCE * 100.0,
        if off.is_empty() { "ok" } else { "MISSED" },
        off.len(),
    );
    drop(server);
}
