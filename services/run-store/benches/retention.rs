//! What retention does to the database's size under a steady stream of runs, against
//! the same stream with retention off, measured side by side in one run.
//!
//! Two run stores, each on a fresh Postgres database of its own and with its background
//! rounds started (`RunStore::start()`: the deadline sweep and the retention sweep, as a
//! deployed replica runs them), take the same load at the same time:
//!
//! - **Load.** [`RUNS_PER_SECOND`] runs a second, each over real gRPC: CreateRun,
//!   IssueRunKey, then as the runner (bearer = the run key) Hello, AppendEvents of
//!   [`EVENTS_PER_RUN`] stdout events of [`EVENT_BYTES`] bytes in [`BATCHES_PER_RUN`]
//!   batches, and SubmitResult `succeeded`. Every id, key and line is derived from the
//!   run's number: no randomness. Both stores get run `n` at the same tick; at most
//!   [`MAX_IN_FLIGHT`] runs are in flight per store (a store that falls behind gets
//!   fewer runs, which the "runs created" column shows).
//! - **Retention on:** `ended_run_retention_seconds = 10` (its minimum), events with the
//!   run (`event_retention_seconds = 0`), `retention_sweep_interval_ms = 1000`.
//!   **Retention off:** the defaults (runs kept 30 days; the sweep still runs every 5 s
//!   and finds nothing to delete). Receipts are kept in both.
//!
//! Every [`SAMPLE_EVERY`] for [`SAMPLES`] samples, `pg_database_size` of each database
//! (read from a connection to the `postgres` database) and the row counts of `runs` and
//! `events` (read over a connection of the bench's own, not the store's pool). The
//! table prints as it goes; then verdicts (is the size with retention on flat over the
//! last [`FLAT_SAMPLES`] samples: the largest at most 10 % above the smallest; the final
//! ratio on/off)
//! and where the space is at the end, table by table. Timings and sizes are printed,
//! never asserted.
//!
//! Postgres gives deleted rows' space back to new rows only after a VACUUM, so the
//! server's `autovacuum` setting decides whether the size with retention on can level
//! off; the bench prints it. `RETENTION_BENCH_VACUUM=1` runs a plain `VACUUM` on both
//! databases after each sample, standing in for autovacuum on a server that has it off.
//!
//! Run: `cargo bench -p runplane-run-store --bench retention` (needs the local Postgres;
//! takes about two minutes).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestDatabase, authed};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tonic::transport::Channel;

const TOKEN: &str = "bench-service-token-0123456789abcdef0123";
const RUNS_PER_SECOND: u64 = 20;
const EVENTS_PER_RUN: usize = 50;
const BATCHES_PER_RUN: usize = 2;
/// Bytes of each event's text.
const EVENT_BYTES: usize = 200;
/// Runs one store has in flight at most; past it the load waits.
const MAX_IN_FLIGHT: usize = 100;
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
const SAMPLES: u32 = 10;
/// `ended_run_retention_seconds` with retention on.
const RETENTION_SECONDS: u32 = 10;
/// `retention_sweep_interval_ms` with retention on.
const SWEEP_INTERVAL_MS: u32 = 1000;
/// The size with retention on is flat when, over the last this many samples, the
/// largest is at most [`FLAT_TOLERANCE`] above the smallest.
const FLAT_SAMPLES: usize = 3;
const FLAT_TOLERANCE: f64 = 0.10;
/// Failed runs reported on stderr one by one; past it only counted.
const ERRORS_SHOWN: u64 = 5;

const MIB: f64 = 1024.0 * 1024.0;

/// One run store on its own database, and what the load did to it.
struct Side {
    db: TestDatabase,
    server: InProcessRunStore,
    channel: Channel,
    /// The bench's own connection to the store's database, for row counts.
    reader: DatabaseConnection,
    created: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    in_flight: Arc<Semaphore>,
}

impl Side {
    async fn start(retention: bool) -> Self {
        let db = TestDatabase::new().await;
        let mut config = runplane_testkit::config::run_store(TOKEN, db.url());
        if retention {
            config.run_store.ended_run_retention_seconds = RETENTION_SECONDS;
            config.run_store.event_retention_seconds = 0;
            config.run_store.retention_sweep_interval_ms = SWEEP_INTERVAL_MS;
        }
        let server = InProcessRunStore::start(&config).await;
        // The rounds a deployed replica runs: InProcessRunStore leaves them to the caller.
        server.store().start();
        let channel = tonic::transport::Endpoint::from_shared(server.endpoint().to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let reader = runplane_db::connect(db.url()).await.unwrap();
        Self {
            db,
            server,
            channel,
            reader,
            created: Arc::default(),
            failed: Arc::default(),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        }
    }
}

/// The text of run `n`'s event `i`: [`EVENT_BYTES`] printable bytes.
fn line(n: u64, i: usize) -> String {
    const FILL: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789 ";
    let mut text = format!("run {n:06} line {i:03} ");
    let head = text.len();
    text.extend(
        FILL.iter()
            .cycle()
            .skip(i % FILL.len())
            .take(EVENT_BYTES - head)
            .map(|&b| char::from(b)),
    );
    text
}

/// Run `n`'s whole life on one store: created, keyed, said hello to, its events
/// appended, ended succeeded.
async fn life(channel: Channel, n: u64, created: &AtomicU64) -> Result<(), tonic::Status> {
    let mut operator = RunServiceClient::new(channel.clone());
    let run_id = operator
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: format!("retention-bench-{n:06}-request"),
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
        .await?
        .into_inner()
        .run
        .expect("CreateRun answers with the run")
        .id;
    created.fetch_add(1, Ordering::Relaxed);
    let key = operator
        .issue_run_key(authed(
            runstore_pb::IssueRunKeyRequest {
                run_id: run_id.clone(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: format!("retention-bench-key-{n:06}"),
                ..Default::default()
            },
            TOKEN,
        ))
        .await?
        .into_inner()
        .run_key;
    let mut runner = RunnerServiceClient::new(channel);
    runner
        .hello(authed(
            runstore_pb::HelloRequest {
                run_id: run_id.clone(),
                nonce: format!("retention-bench-nonce-{n:06}"),
                runner_version: "bench".into(),
            },
            &key,
        ))
        .await?;
    let per_batch = EVENTS_PER_RUN.div_ceil(BATCHES_PER_RUN);
    for batch in 0..BATCHES_PER_RUN {
        let events = (batch * per_batch..EVENTS_PER_RUN.min((batch + 1) * per_batch))
            .map(|i| runstore_pb::EventInput {
                kind: runstore_pb::EventKind::Stdout as i32,
                text: line(n, i),
                ..Default::default()
            })
            .collect();
        runner
            .append_events(authed(
                runstore_pb::AppendEventsRequest {
                    run_id: run_id.clone(),
                    batch_key: format!("retention-bench-{n:06}-batch-{batch}"),
                    events,
                },
                &key,
            ))
            .await?;
    }
    runner
        .submit_result(authed(
            runstore_pb::SubmitResultRequest {
                run_id,
                verdict: Some(runstore_pb::Verdict {
                    outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
                    reason: "exit_zero".into(),
                    exit_code: Some(0),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &key,
        ))
        .await?;
    Ok(())
}

/// What one store needs to take the load: its channel, counters and in-flight limit.
#[derive(Clone)]
struct Target {
    name: &'static str,
    channel: Channel,
    created: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    in_flight: Arc<Semaphore>,
}

impl Target {
    fn of(name: &'static str, side: &Side) -> Self {
        Self {
            name,
            channel: side.channel.clone(),
            created: side.created.clone(),
            failed: side.failed.clone(),
            in_flight: side.in_flight.clone(),
        }
    }
}

/// Starts run `n` on every target each tick until `stop`, then waits for the runs in
/// flight; returns how many runs it started on each.
async fn drive(targets: Vec<Target>, mut stop: oneshot::Receiver<()>) -> u64 {
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / RUNS_PER_SECOND));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut runs = JoinSet::new();
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {
                for target in &targets {
                    let permit = target.in_flight.clone().acquire_owned().await.unwrap();
                    let target = target.clone();
                    runs.spawn(async move {
                        let _permit = permit;
                        if let Err(e) = life(target.channel, n, &target.created).await {
                            let failed = target.failed.fetch_add(1, Ordering::Relaxed);
                            if failed < ERRORS_SHOWN {
                                eprintln!("run {n} on retention {}: {e:?}", target.name);
                            }
                        }
                    });
                }
                n += 1;
                while runs.try_join_next().is_some() {}
            }
        }
    }
    while runs.join_next().await.is_some() {}
    n
}

/// One reading of one database.
#[derive(Debug, Clone, Copy)]
struct Reading {
    bytes: i64,
    runs: i64,
    events: i64,
}

async fn one_i64(db: &DatabaseConnection, sql: &str, values: Vec<sea_orm::Value>) -> i64 {
    db.query_one_raw(Statement::from_sql_and_values(
        db.get_database_backend(),
        sql,
        values,
    ))
    .await
    .unwrap()
    .unwrap()
    .try_get("", "n")
    .unwrap()
}

async fn read(admin: &DatabaseConnection, side: &Side) -> Reading {
    let bytes = one_i64(
        admin,
        "SELECT pg_database_size($1::name)::bigint AS n",
        vec![side.db.name().into()],
    )
    .await;
    let runs = one_i64(
        &side.reader,
        "SELECT count(*)::bigint AS n FROM runs",
        vec![],
    )
    .await;
    let events = one_i64(
        &side.reader,
        "SELECT count(*)::bigint AS n FROM events",
        vec![],
    )
    .await;
    Reading {
        bytes,
        runs,
        events,
    }
}

/// Each table of the store's database, with its indexes and TOAST: (name, bytes, dead
/// rows as the statistics last saw them).
async fn tables(side: &Side) -> Vec<(String, i64, i64)> {
    let db = &side.reader;
    db.query_all_raw(Statement::from_string(
        db.get_database_backend(),
        "SELECT c.relname::text AS name, pg_total_relation_size(c.oid)::bigint AS bytes, \
                COALESCE(s.n_dead_tup, 0)::bigint AS dead \
         FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
         WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace",
    ))
    .await
    .unwrap()
    .into_iter()
    .map(|row| {
        (
            row.try_get("", "name").unwrap(),
            row.try_get("", "bytes").unwrap(),
            row.try_get("", "dead").unwrap(),
        )
    })
    .collect()
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / MIB
}

/// `a`, or `a / b` when the two stores differ.
fn pair(a: u64, b: u64) -> String {
    if a == b {
        a.to_string()
    } else {
        format!("{a} / {b}")
    }
}

/// Growth in MiB per minute between two samples `seconds` apart.
fn per_minute(from: i64, to: i64, seconds: f64) -> f64 {
    mib(to - from) * 60.0 / seconds
}

#[tokio::main]
async fn main() {
    let off = Side::start(false).await;
    let on = Side::start(true).await;
    let admin_url = off.db.url().replace(off.db.name(), "postgres");
    let admin = runplane_db::connect(&admin_url).await.unwrap();
    let autovacuum = admin
        .query_one_raw(Statement::from_string(
            admin.get_database_backend(),
            "SELECT current_setting('autovacuum') AS v",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get::<String>("", "v")
        .unwrap();
    let vacuum = std::env::var_os("RETENTION_BENCH_VACUUM").is_some_and(|v| v != "0");

    println!(
        "Database size under load: {RUNS_PER_SECOND} runs/s, each {EVENTS_PER_RUN} stdout \
         events of {EVENT_BYTES} B in {BATCHES_PER_RUN} batches, then succeeded; \
         retention on = runs and events deleted {RETENTION_SECONDS} s after the run ends \
         (sweep every {SWEEP_INTERVAL_MS} ms), off = the defaults (30 days)"
    );
    println!(
        "Postgres autovacuum: {autovacuum}; bench VACUUM after each sample: {}",
        if vacuum { "yes" } else { "no" }
    );
    println!();
    println!(
        "| {:>9} | {:>12} | {:>14} | {:>13} | {:>12} | {:>15} | {:>14} | {:>13} | {:>12} |",
        "elapsed s",
        "runs created",
        "size off (MiB)",
        "size on (MiB)",
        "ratio on/off",
        "events rows off",
        "events rows on",
        "runs rows off",
        "runs rows on",
    );
    println!(
        "|{:->11}|{:->14}|{:->16}|{:->15}|{:->14}|{:->17}|{:->16}|{:->15}|{:->14}|",
        "", "", "", "", "", "", "", "", ""
    );
    let row = |elapsed: f64, created: String, a: Reading, b: Reading| {
        println!(
            "| {:>9.0} | {:>12} | {:>14.2} | {:>13.2} | {:>12.3} | {:>15} | {:>14} | {:>13} | {:>12} |",
            elapsed,
            created,
            mib(a.bytes),
            mib(b.bytes),
            b.bytes as f64 / a.bytes as f64,
            a.events,
            b.events,
            a.runs,
            b.runs,
        );
    };

    let (empty_off, empty_on) = tokio::join!(read(&admin, &off), read(&admin, &on));
    row(0.0, "0".into(), empty_off, empty_on);

    let (stop, stopped) = oneshot::channel();
    let started = Instant::now();
    let driver = tokio::spawn(drive(
        vec![Target::of("off", &off), Target::of("on", &on)],
        stopped,
    ));
    // (elapsed s, created on, reading off, reading on)
    let mut samples: Vec<(f64, u64, Reading, Reading)> = Vec::new();
    for k in 1..=SAMPLES {
        tokio::time::sleep_until((started + SAMPLE_EVERY * k).into()).await;
        let elapsed = started.elapsed().as_secs_f64();
        let (created_off, created_on) = (
            off.created.load(Ordering::Relaxed),
            on.created.load(Ordering::Relaxed),
        );
        let (a, b) = tokio::join!(read(&admin, &off), read(&admin, &on));
        row(elapsed, pair(created_off, created_on), a, b);
        samples.push((elapsed, created_on, a, b));
        if vacuum {
            for side in [&off, &on] {
                side.reader.execute_unprepared("VACUUM").await.unwrap();
            }
        }
    }
    let _ = stop.send(());
    let ticks = driver.await.unwrap();

    // Verdicts.
    let (last_s, _, last_off, last_on) = *samples.last().unwrap();
    let tail = &samples[samples.len() - FLAT_SAMPLES..];
    let sizes: Vec<f64> = tail.iter().map(|s| mib(s.3.bytes)).collect();
    let (smallest, largest) = sizes
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
    let spread = largest / smallest - 1.0;
    let (first_s, _, first_off, first_on) = tail[0];
    let span = last_s - first_s;
    let reached = samples
        .iter()
        .find(|(_, created, _, on)| (on.runs as u64) < *created)
        .map(|s| format!("{:.0} s", s.0));
    println!();
    println!(
        "Load: {ticks} runs started on each store over {:.1} s ({:.1} runs/s); ended \
         with errors: off {}, on {}.",
        started.elapsed().as_secs_f64(),
        ticks as f64 / started.elapsed().as_secs_f64(),
        off.failed.load(Ordering::Relaxed),
        on.failed.load(Ordering::Relaxed),
    );
    println!(
        "Retention reached (first sample with runs deleted): {}.",
        reached.as_deref().unwrap_or("never")
    );
    println!(
        "Size with retention on over the last {FLAT_SAMPLES} samples ({:.0}–{:.0} s): {} \
         ({:.2}–{:.2} MiB, largest {:.1} % above smallest; flat within {:.0} %); growth \
         there: on {:+.2} MiB/min, off {:+.2} MiB/min.",
        first_s,
        last_s,
        if spread <= FLAT_TOLERANCE {
            "flat"
        } else {
            "NOT flat"
        },
        smallest,
        largest,
        spread * 100.0,
        FLAT_TOLERANCE * 100.0,
        per_minute(first_on.bytes, last_on.bytes, span),
        per_minute(first_off.bytes, last_off.bytes, span),
    );
    if autovacuum != "on" && !vacuum {
        println!(
            "Note: autovacuum is {autovacuum} on this server, so nothing vacuums the rows \
             retention deletes and their space is never reused: the size with retention on \
             can grow as with it off. RETENTION_BENCH_VACUUM=1 vacuums after each sample."
        );
    }
    println!(
        "Final size ratio on/off: {:.3} ({:.2} MiB / {:.2} MiB); above the empty database: \
         on {:.2} MiB / off {:.2} MiB = {:.3}.",
        last_on.bytes as f64 / last_off.bytes as f64,
        mib(last_on.bytes),
        mib(last_off.bytes),
        mib(last_on.bytes - empty_on.bytes),
        mib(last_off.bytes - empty_off.bytes),
        (last_on.bytes - empty_on.bytes) as f64 / (last_off.bytes - empty_off.bytes) as f64,
    );

    // Where the space is.
    let (tables_off, tables_on) = tokio::join!(tables(&off), tables(&on));
    let mut rows: Vec<(String, i64, i64, i64)> = tables_off
        .iter()
        .map(|(name, bytes, _)| {
            let (on_bytes, on_dead) = tables_on
                .iter()
                .find(|t| &t.0 == name)
                .map_or((0, 0), |t| (t.1, t.2));
            (name.clone(), *bytes, on_bytes, on_dead)
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1.max(r.2)));
    println!();
    println!(
        "Where the space is at the end: each table with its indexes and TOAST; dead rows as \
         the statistics last saw them"
    );
    println!();
    println!(
        "| {:<20} | {:>14} | {:>13} | {:>12} |",
        "table", "size off (MiB)", "size on (MiB)", "dead rows on"
    );
    println!("|{:-<22}|{:->16}|{:->15}|{:->14}|", "", "", "", "");
    for (name, off_bytes, on_bytes, on_dead) in rows.iter().take(8) {
        println!(
            "| {:<20} | {:>14.2} | {:>13.2} | {:>12} |",
            name,
            mib(*off_bytes),
            mib(*on_bytes),
            on_dead
        );
    }

    for side in [off, on] {
        side.server.shutdown().await;
        drop(side.db);
    }
}
