//! AppendEvents throughput and latency on Postgres, beside a raw baseline.
//!
//! For 1, 16 and 128 concurrent runners (each on its own run, with its own key) and
//! batches of 1, 10 and 100 events, every runner appends a fixed number of batches over
//! real gRPC to a run store on a real socket. The baseline inserts the same rows with a
//! plain sea-orm `insert_many` from the same number of tasks: no gRPC, no auth, no
//! dedupe, no row lock, no hash chain. The ratio is run store / baseline throughput;
//! the goal is a ratio of at least [`GOAL_RATIO`] in every row.
//!
//! Run: `cargo bench -p runplane-run-store --bench append` (needs the local Postgres).

use std::time::{Duration, Instant};

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::store::entities::event;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestDatabase, authed};
use sea_orm::{EntityTrait, IntoActiveModel};

const TOKEN: &str = "bench-service-token-0123456789abcdef0123";

/// The throughput AppendEvents should keep of a plain insert of the same rows.
const GOAL_RATIO: f64 = 0.5;

struct Stats {
    events_per_second: f64,
    p50: Duration,
    p99: Duration,
}

fn stats(mut latencies: Vec<Duration>, events: usize, elapsed: Duration) -> Stats {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        events_per_second: events as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

/// Batches each runner sends: enough to measure, bounded so the whole table stays short.
fn batches_per_runner(runners: usize, batch: usize) -> usize {
    (4000 / (runners * batch).max(1)).clamp(10, 200)
}

async fn bench_run_store(endpoint: &str, runners: usize, batch: usize, round: usize) -> Stats {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut operator = RunServiceClient::new(channel.clone());
    let mut keys = Vec::new();
    for r in 0..runners {
        let run = operator
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("bench-{round}-{runners}-{batch}-{r:04}-req"),
                    org_id: "bench".into(),
                    lead_id: "bench".into(),
                    target: Some(runstore_pb::create_run_request::Target::CredentialId(
                        "c".into(),
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
        let key = operator
            .issue_run_key(authed(
                runstore_pb::IssueRunKeyRequest {
                    run_id: run.id.clone(),
                    sandbox_id: "sbx".into(),
                    sandbox_generation: 1,
                    idempotency_key: format!("bench-key-{}", run.id),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run_key;
        keys.push((run.id, key));
    }
    let per_runner = batches_per_runner(runners, batch);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (run_id, key) in keys {
        let mut runner = RunnerServiceClient::new(channel.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_runner);
            for b in 0..per_runner {
                let events = (0..batch)
                    .map(|i| runstore_pb::EventInput {
                        kind: runstore_pb::EventKind::Stdout as i32,
                        text: format!(
                            "line {b}.{i}: the agent printed something of typical length"
                        ),
                        ..Default::default()
                    })
                    .collect();
                let t = Instant::now();
                runner
                    .append_events(authed(
                        runstore_pb::AppendEventsRequest {
                            run_id: run_id.clone(),
                            batch_key: format!("bench-batch-{b:08}"),
                            events,
                        },
                        &key,
                    ))
                    .await
                    .unwrap();
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    stats(latencies, runners * per_runner * batch, started.elapsed())
}

async fn bench_baseline(
    db: &sea_orm::DatabaseConnection,
    runners: usize,
    batch: usize,
    round: usize,
) -> Stats {
    let per_runner = batches_per_runner(runners, batch);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for r in 0..runners {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            let run_id = format!("baseline-{round}-{runners}-{batch}-{r}");
            let mut latencies = Vec::with_capacity(per_runner);
            for b in 0..per_runner {
                let rows: Vec<_> = (0..batch)
                    .map(|i| {
                        event::Model {
                            run_id: run_id.clone(),
                            sequence: (b * batch + i + 1) as i64,
                            kind: runstore_pb::EventKind::Stdout as i32,
                            text: format!(
                                "line {b}.{i}: the agent printed something of typical length"
                            ),
                            data: String::new(),
                            is_check: false,
                            name: String::new(),
                            observed_at_us: None,
                            recorded_at_us: 0,
                            digest: vec![0; 32],
                        }
                        .into_active_model()
                    })
                    .collect();
                let t = Instant::now();
                event::Entity::insert_many(rows)
                    .exec_without_returning(&db)
                    .await
                    .unwrap();
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    stats(latencies, runners * per_runner * batch, started.elapsed())
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let db = TestDatabase::new().await;
    let server =
        InProcessRunStore::start(&runplane_testkit::config::run_store(TOKEN, db.url())).await;
    let endpoint = server.endpoint();
    let baseline_db = runplane_db::connect(db.url()).await.unwrap();

    println!(
        "AppendEvents on Postgres: run store over gRPC vs plain sea-orm insert_many (baseline)"
    );
    println!(
        "{:>7} {:>5} {:>8} | {:>12} {:>9} {:>9} | {:>12} {:>9} {:>9} | {:>6} {:>6}",
        "runners",
        "batch",
        "batches",
        "events/s",
        "p50 ms",
        "p99 ms",
        "base ev/s",
        "base p50",
        "base p99",
        "ratio",
        "goal"
    );
    let mut missed = 0;
    for (round, runners) in [1usize, 16, 128].into_iter().enumerate() {
        for batch in [1usize, 10, 100] {
            let ours = bench_run_store(endpoint, runners, batch, round).await;
            let base = bench_baseline(&baseline_db, runners, batch, round).await;
            let ratio = ours.events_per_second / base.events_per_second;
            let goal = if ratio >= GOAL_RATIO {
                "ok"
            } else {
                missed += 1;
                "MISSED"
            };
            println!(
                "{:>7} {:>5} {:>8} | {:>12.0} {:>9} {:>9} | {:>12.0} {:>9} {:>9} | {:>6.2} {:>6}",
                runners,
                batch,
                batches_per_runner(runners, batch),
                ours.events_per_second,
                ms(ours.p50),
                ms(ours.p99),
                base.events_per_second,
                ms(base.p50),
                ms(base.p99),
                ratio,
                goal,
            );
        }
    }
    println!("goal: ratio >= {GOAL_RATIO:.1} in every row; {missed} of 9 rows missed it");
}
