//! What watchers cost the database, and how late a watcher on another replica sees a
//! change.
//!
//! Two run-store replicas share one Postgres database, each on its own socket, as in
//! production. Two tables:
//!
//! - **Idle watchers.** 1,000 WatchRun streams (half on each replica, heartbeats at the
//!   default 5 s) follow runs that do nothing. The database's transactions per second
//!   come from `pg_stat_database` (`xact_commit + xact_rollback` of the bench database,
//!   read from another database so the reading does not count). Every query the
//!   replicas send outside a transaction is one transaction, so this counts queries.
//!   The row with no watchers is the replicas' own idle cost, for comparison.
//! - **Event latency.** One runner appends one event at a time on replica A; a watcher
//!   on replica B (and, for comparison, one on A) receives it. Latency runs from the
//!   append being sent to the event arriving.
//!
//! Run: `cargo bench -p runplane-run-store --bench watchers` (needs the local Postgres).

use std::time::{Duration, Instant};

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestDatabase, authed};
use sea_orm::{ConnectionTrait, Statement};
use tonic::transport::Channel;

const TOKEN: &str = "bench-service-token-0123456789abcdef0123";
const WATCHERS: usize = 1000;
/// Watch streams per connection, below the server's `max_concurrent_streams`.
const STREAMS_PER_CONNECTION: usize = 100;
const MEASURE: Duration = Duration::from_secs(65);
const APPENDS: usize = 200;

/// Serves one replica on the bench database.
async fn replica(db: &TestDatabase) -> InProcessRunStore {
    InProcessRunStore::start(&runplane_testkit::config::run_store(TOKEN, db.url())).await
}

async fn connect(endpoint: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn create_run(channel: &Channel, n: usize) -> String {
    RunServiceClient::new(channel.clone())
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: format!("watchers-bench-{n:06}-request"),
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
        .unwrap()
        .id
}

async fn watch(channel: &Channel, run_id: &str) -> tonic::Streaming<runstore_pb::WatchRunResponse> {
    let mut stream = RunServiceClient::new(channel.clone())
        .watch_run(authed(
            runstore_pb::WatchRunRequest {
                run_id: run_id.to_owned(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner();
    // The snapshot: the stream is open and the watcher is waiting.
    stream.message().await.unwrap().unwrap();
    stream
}

/// Transactions the bench database has committed or rolled back so far.
async fn transactions(admin: &sea_orm::DatabaseConnection, database: &str) -> i64 {
    // Statistics reach pg_stat_database when a backend reports them (about every
    // second): read a fresh snapshot.
    admin
        .execute_unprepared("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    let row = admin
        .query_one_raw(Statement::from_sql_and_values(
            admin.get_database_backend(),
            "SELECT (xact_commit + xact_rollback)::bigint AS n FROM pg_stat_database WHERE datname = $1",
            [database.into()],
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get("", "n").unwrap()
}

async fn idle_rate(admin: &sea_orm::DatabaseConnection, database: &str) -> f64 {
    // An idle backend reports its statistics up to 10 s late (PGSTAT_IDLE_INTERVAL):
    // let what came before finish reaching pg_stat_database before counting.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(admin, database).await;
    let started = Instant::now();
    tokio::time::sleep(MEASURE).await;
    let after = transactions(admin, database).await;
    (after - before) as f64 / started.elapsed().as_secs_f64()
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

/// Appends one event at a time on `appender`, each awaited by `watcher`; the latencies
/// from sending the append to the event arriving.
async fn latencies(appender: &Channel, watcher: &Channel, n: usize) -> Vec<Duration> {
    let run_id = create_run(appender, 1_000_000 + n).await;
    let key = RunServiceClient::new(appender.clone())
        .issue_run_key(authed(
            runstore_pb::IssueRunKeyRequest {
                run_id: run_id.clone(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: format!("bench-key-{run_id}"),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run_key;
    let mut stream = watch(watcher, &run_id).await;
    let mut runner = RunnerServiceClient::new(appender.clone());
    let mut out = Vec::with_capacity(APPENDS);
    for i in 0..APPENDS {
        let started = Instant::now();
        runner
            .append_events(authed(
                runstore_pb::AppendEventsRequest {
                    run_id: run_id.clone(),
                    batch_key: format!("latency-batch-{i:06}"),
                    events: vec![runstore_pb::EventInput {
                        kind: runstore_pb::EventKind::Stdout as i32,
                        text: format!("line {i}"),
                        ..Default::default()
                    }],
                },
                &key,
            ))
            .await
            .unwrap();
        loop {
            let item = stream.message().await.unwrap().expect("watch open");
            if let Some(runstore_pb::watch_run_response::Update::Event(e)) = item.update
                && e.sequence == i as u64 + 1
            {
                break;
            }
        }
        out.push(started.elapsed());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    out.sort();
    out
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let db = TestDatabase::new().await;
    let database = db.url().rsplit('/').next().unwrap().to_owned();
    let admin = runplane_db::connect(&db.url().replace(&database, "postgres"))
        .await
        .unwrap();
    let (a, b) = (replica(&db).await, replica(&db).await);
    let channels_a: Vec<Channel> = channels_to(a.endpoint()).await;
    let channels_b: Vec<Channel> = channels_to(b.endpoint()).await;

    println!("Idle watchers: database transactions per second, two replicas on one Postgres");
    println!("{:>9} | {:>12} | {:>7}", "watchers", "queries/s", "goal");
    let baseline = idle_rate(&admin, &database).await;
    println!("{:>9} | {:>12.2} | {:>7}", 0, baseline, "-");
    let mut streams = Vec::with_capacity(WATCHERS);
    for n in 0..WATCHERS {
        let channels = if n % 2 == 0 { &channels_a } else { &channels_b };
        let channel = &channels[(n / 2) % channels.len()];
        let run_id = create_run(channel, n).await;
        streams.push(watch(channel, &run_id).await);
    }
    let watched = idle_rate(&admin, &database).await;
    println!("{:>9} | {:>12.2} | {:>7}", WATCHERS, watched, "<= 10");
    drop(streams);

    println!();
    println!(
        "Event latency: AppendEvents on replica A to the event at a watcher, {APPENDS} appends"
    );
    println!(
        "{:>16} | {:>8} {:>8} {:>8} | {:>10}",
        "watcher on", "p50 ms", "p99 ms", "max ms", "goal p50"
    );
    let same = latencies(&channels_a[0], &channels_a[0], 1).await;
    println!(
        "{:>16} | {:>8} {:>8} {:>8} | {:>10}",
        "A (same)",
        ms(percentile(&same, 0.5)),
        ms(percentile(&same, 0.99)),
        ms(*same.last().unwrap()),
        "-"
    );
    let across = latencies(&channels_a[0], &channels_b[0], 2).await;
    println!(
        "{:>16} | {:>8} {:>8} {:>8} | {:>10}",
        "B (other)",
        ms(percentile(&across, 0.5)),
        ms(percentile(&across, 0.99)),
        ms(*across.last().unwrap()),
        "<= 50"
    );
    println!(
        "p50 other/same replica = {:.2}x",
        percentile(&across, 0.5).as_secs_f64() / percentile(&same, 0.5).as_secs_f64()
    );
}

/// Enough connections to one replica for half the watchers.
async fn channels_to(endpoint: &str) -> Vec<Channel> {
    let mut channels = Vec::new();
    for _ in 0..WATCHERS.div_ceil(2 * STREAMS_PER_CONNECTION) {
        channels.push(connect(endpoint).await);
    }
    channels
}
