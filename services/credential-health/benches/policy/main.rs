//! Credential health under a fleet of 10,000 credentials: start-up cost, classification +
//! outage-policy throughput, and admission latency, each beside a raw baseline.
//!
//! Setup: one config with 10,000 profiles (`p{i}` on `cred-{i}`, capacity 4, the default
//! patterns), a run store and credential health on their own Postgres databases, both on
//! ONE gRPC server on a real socket, called with the service token. The clock is the
//! system clock, so cool-offs are real: incidents opened by the reports are still cooling
//! off (60 s) when admission is measured right after.
//!
//! 1. `ReportTurnFailure` with ~2 KiB failure tails (78% end in `API Error: No response
//!    from API`, 20% match nothing, 2% `Your credit balance is too low`), each turn a new
//!    run spread over the 10,000 credentials, with 1, 16 and 64 concurrent callers.
//!    Baselines: (a) the same classification and policy in process (no I/O, one thread)
//!    and (b) one plain SQL `UPDATE` by primary key per failure on Postgres, same callers.
//!    The ratio is runplane / raw-SQL failures per second. A second table splits the
//!    latency by what each report did (counted, opened or absorbed into an incident,
//!    quarantined, other) beside `Store::report` called in process on fresh runs, which
//!    separates the database transaction from the gRPC path.
//! 2. `CheckAdmission` by credential id and by profile name, at 1 and 16 callers, beside a
//!    plain `SELECT` by primary key of the same `credentials` table. A refusal
//!    (FAILED_PRECONDITION, COOLING_OFF or EXHAUSTED) is an answered call.
//! 3. Peer check: the same reports on `runplane_grpc::serve` and on a plain tonic server
//!    whose accepted sockets set TCP_NODELAY. This table found ~40 ms steps (Nagle on the
//!    server's socket against the client's delayed ACK, hit by answers that carry an
//!    incident, ~310 bytes); `runplane_grpc::serve` now turns Nagle off, and the two rows
//!    should match.
//!
//! Client, server and the benchmark share one process on this machine's cores; every
//! database pool is runplane's (16 connections). The credential-health outbox loop is not
//! started: MarkBackendError delivery is not part of a report's cost.
//!
//! Run: `cargo bench -p runplane-credential-health --bench policy` (needs the local
//! Postgres). Start-up timings are printed first; the whole run takes under 2 minutes.

mod measure;
mod workload;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use measure::{Stats, drive, ms, stats};
use runplane_config::{Config, ProfileConfig};
use runplane_credential_health::CredentialHealth;
use runplane_credential_health::domain::policy::{CredentialState, ErrorEffect, PolicyConfig};
use runplane_credential_health::domain::profiles::Profiles;
use runplane_credential_health::store::entities::{credential, incident};
use runplane_credential_health::store::{Report, Store};
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::check_admission_request::Target;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_run_store::RunStore;
use runplane_testkit::TestDatabase;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, PaginatorTrait,
    QueryFilter, Statement,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use workload::{CREDENTIALS, Kind, Tails, credential_of, kind_of, report_request, splitmix};

const TOKEN: &str = "bench-service-token-0123456789abcdef0123";
/// (callers, reports) for the classification + policy table.
const REPORT_ROUNDS: [(usize, usize); 3] = [(1, 2_000), (16, 10_000), (64, 20_000)];
const ADMISSION_CALLS: usize = 5_000;
const ADMISSION_CALLERS: [usize; 2] = [1, 16];

type HealthClient = CredentialHealthServiceClient<InterceptedService<Channel, Bearer>>;

// --- setup ----------------------------------------------------------------------------

fn fleet() -> Vec<ProfileConfig> {
    (0..CREDENTIALS)
        .map(|i| ProfileConfig {
            name: format!("p{i}"),
            credential_id: format!("cred-{i}"),
            capacity: 4,
            ..ProfileConfig::default()
        })
        .collect()
}

struct Bench {
    endpoint: String,
    health: CredentialHealth,
    config: Config,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dbs: (TestDatabase, TestDatabase),
}

/// Times each part of start-up, then starts the server the measurements use.
async fn start() -> Bench {
    let (run_db, health_db) = (TestDatabase::new().await, TestDatabase::new().await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let mut config = runplane_testkit::config::run_store(TOKEN, run_db.url());
    config.run_store.endpoint = endpoint.clone();
    config.credential_health.database_url = health_db.url().to_owned();
    config.credential_health.endpoint = endpoint.clone();
    config.credential_health.profiles = fleet();

    let t = Instant::now();
    config.validate().unwrap();
    let validate = t.elapsed();
    let t = Instant::now();
    let profiles = Profiles::compile(&config).unwrap();
    let compile = t.elapsed();
    drop(profiles);
    let clock = runplane_clock::SystemClock::shared();
    let t = Instant::now();
    let health = CredentialHealth::open(&config, clock.clone())
        .await
        .unwrap();
    let open_fresh = t.elapsed();
    let t = Instant::now();
    let again = CredentialHealth::open(&config, clock.clone())
        .await
        .unwrap();
    let open_migrated = t.elapsed();
    drop(again);
    let mut one = config.clone();
    one.credential_health.profiles.truncate(1);
    let t = Instant::now();
    let single = CredentialHealth::open(&one, clock.clone()).await.unwrap();
    let open_one = t.elapsed();
    drop(single);

    println!("start-up with {CREDENTIALS} profiles");
    println!("{:<58} {:>10}", "step", "ms");
    for (step, d) in [
        ("Config::validate (10,000 profiles)", validate),
        ("Profiles::compile (10,000 profiles)", compile),
        (
            "CredentialHealth::open, fresh database (incl. migrations)",
            open_fresh,
        ),
        ("CredentialHealth::open, migrated database", open_migrated),
        (
            "CredentialHealth::open, migrated, 1 profile (baseline)",
            open_one,
        ),
    ] {
        println!("{:<58} {:>10}", step, ms(d));
    }

    let run_store = RunStore::open(&config, clock).await.unwrap();
    let mut services = ServiceSet::new();
    run_store.register(&mut services);
    health.register(&mut services);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        async {
            let _ = stopped.await;
        },
        Duration::from_secs(1),
    ));
    Bench {
        endpoint,
        health,
        config,
        _stop: stop,
        _dbs: (run_db, health_db),
    }
}

async fn client(endpoint: &str) -> HealthClient {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    CredentialHealthServiceClient::with_interceptor(channel, Bearer::new(TOKEN))
}

// --- 1. classification + policy -------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reported {
    Counted,
    Opened,
    Absorbed,
    Exhausted,
    Other,
    Failed,
}

async fn report(
    client: &HealthClient,
    request: credentials_pb::ReportTurnFailureRequest,
) -> Reported {
    let run_id = request.run_id.clone();
    match client.clone().report_turn_failure(request).await {
        Ok(answer) => reported(&answer.into_inner(), &run_id),
        Err(status) => {
            eprintln!("ReportTurnFailure {run_id}: {status}");
            Reported::Failed
        }
    }
}

/// The same report straight into `Store::report` (classified here): no gRPC, no auth,
/// no request digest.
async fn report_direct(
    store: &Store,
    profiles: &Profiles,
    r: credentials_pb::ReportTurnFailureRequest,
) -> Reported {
    let profile = profiles
        .for_failure(&r.profile, &r.credential_id)
        .expect("known credential");
    let (outcome, reason) = profile.classify(&r.failure_tail);
    let report = Report {
        request_digest: r.turn_id.clone(),
        turn_id: r.turn_id,
        run_id: r.run_id,
        org_id: r.org_id,
        lead_id: r.lead_id,
        credential_id: r.credential_id.clone(),
        outcome,
        reason,
        capacity: profile.capacity,
        profiles: vec![profile.name.clone()],
        shared: profiles.shared(&r.credential_id),
    };
    match store.report(&report).await {
        Ok((answer, _)) => reported(&answer, &report.run_id),
        Err(e) => {
            eprintln!("Store::report {}: {e}", report.run_id);
            Reported::Failed
        }
    }
}

fn reported(answer: &credentials_pb::ReportTurnFailureResponse, run_id: &String) -> Reported {
    match answer.outcome() {
        credentials_pb::TurnOutcome::BackendExhausted => Reported::Exhausted,
        credentials_pb::TurnOutcome::BackendError => match &answer.incident {
            Some(i) if i.opening_run_ids.contains(run_id) => Reported::Opened,
            Some(_) => Reported::Absorbed,
            None => Reported::Counted,
        },
        _ => Reported::Other,
    }
}

/// Classification and policy alone: what a report costs without gRPC or a database.
fn in_process(config: &Config, tails: &Tails, reports: usize) {
    let profiles = Profiles::compile(config).unwrap();
    let policy = PolicyConfig::from_config(config);
    let requests: Vec<_> = (0..reports).map(|n| report_request(n, tails)).collect();
    let classify = |r: &credentials_pb::ReportTurnFailureRequest| {
        profiles
            .for_failure(&r.profile, &r.credential_id)
            .expect("known credential")
            .classify(&r.failure_tail)
    };
    // Warm-up: the regexes' lazy DFAs fill their caches on first use.
    for r in &requests {
        std::hint::black_box(classify(r));
    }

    println!("baseline (a): classification + policy in process, 1 thread, no I/O, no gRPC");
    println!(
        "{:<44} {:>7} {:>12} {:>9} {:>8}",
        "step", "reports", "failures/s", "µs each", "opened"
    );
    let row = |step: &str, n: usize, elapsed: Duration, opened: String| {
        println!(
            "{:<44} {:>7} {:>12.0} {:>9.2} {:>8}",
            step,
            n,
            n as f64 / elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e6 / n as f64,
            opened
        );
    };
    for (step, kind) in [
        ("classify, outage tails", Some(Kind::Outage)),
        ("classify, tails matching nothing", Some(Kind::Other)),
        ("classify, credit-balance tails", Some(Kind::Spent)),
        ("classify, the mix (78/20/2)", None),
    ] {
        let chosen: Vec<_> = requests
            .iter()
            .enumerate()
            .filter(|(n, _)| kind.is_none_or(|k| kind_of(*n) == k))
            .map(|(_, r)| r)
            .collect();
        let t = Instant::now();
        for r in &chosen {
            std::hint::black_box(classify(r));
        }
        row(step, chosen.len(), t.elapsed(), String::new());
    }

    let mut states: HashMap<String, CredentialState> = HashMap::new();
    let now = || chrono::Utc::now().timestamp_millis();
    let mut opened = 0usize;
    let mut incident = 0u64;
    let t = Instant::now();
    for r in &requests {
        let (outcome, _reason) = classify(r);
        let state = states.entry(r.credential_id.clone()).or_default();
        match outcome {
            credentials_pb::TurnOutcome::BackendError => {
                let effect =
                    state.backend_error(&policy, &r.run_id, &r.org_id, &r.lead_id, now(), || {
                        incident += 1;
                        format!("inc-{incident}")
                    });
                opened += usize::from(matches!(effect, ErrorEffect::Opened { .. }));
            }
            credentials_pb::TurnOutcome::BackendExhausted => {
                state.exhausted(&policy, now());
            }
            _ => {}
        }
    }
    row(
        "classify + policy (HashMap of states), mix",
        reports,
        t.elapsed(),
        opened.to_string(),
    );
}

async fn incidents(db: &DatabaseConnection) -> u64 {
    incident::Entity::find().count(db).await.unwrap()
}

/// Latency of the calls in `results` that did `kind`: (count, stats), or `None`.
fn of_kind(results: &[(Duration, Reported)], kind: Reported) -> Option<(usize, Stats)> {
    let latencies: Vec<Duration> = results
        .iter()
        .filter(|(_, r)| *r == kind)
        .map(|(d, _)| *d)
        .collect();
    let n = latencies.len();
    (n > 0).then(|| (n, stats(latencies, Duration::from_secs(1))))
}

/// `reports` fresh runs from `first` over gRPC to `endpoint`, from `callers` tasks.
async fn grpc_reports(
    client: &HealthClient,
    tails: &Arc<Tails>,
    first: usize,
    reports: usize,
    callers: usize,
) -> (Stats, Vec<(Duration, Reported)>) {
    let (c, t) = (client.clone(), tails.clone());
    drive(reports, callers, move |i| {
        let (c, request) = (c.clone(), report_request(first + i, &t));
        async move { report(&c, request).await }
    })
    .await
}

async fn bench_reports(bench: &Bench, tails: Arc<Tails>, raw: &DatabaseConnection) -> usize {
    let client = client(&bench.endpoint).await;
    let db = bench.health.database().clone();
    let profiles = Arc::new(Profiles::compile(&bench.config).unwrap());
    println!();
    println!(
        "classification + policy: ReportTurnFailure over gRPC, {CREDENTIALS} credentials, \
         ~{} B tails (78% outage, 20% other, 2% spent), each report a new run",
        tails.outage[0].len()
    );
    println!(
        "baseline (b): one plain SQL UPDATE by primary key per failure (Postgres, same callers); \
         ratio = runplane / raw failures/s"
    );
    println!(
        "{:>7} {:>7} | {:>10} {:>7} {:>7} {:>7} | {:>6} {:>8} {:>8} {:>11} {:>6} | {:>9} {:>7} {:>7} | {:>6}",
        "callers",
        "reports",
        "failures/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "opened",
        "absorbed",
        "counted",
        "quarantined",
        "errors",
        "raw f/s",
        "raw p50",
        "raw p99",
        "ratio"
    );
    let mut rounds = Vec::new();
    let mut next = 0usize;
    for (callers, reports) in REPORT_ROUNDS {
        let before = incidents(&db).await;
        let first = next;
        next += reports;
        let (ours, results) = grpc_reports(&client, &tails, first, reports, callers).await;
        let opened = incidents(&db).await - before;
        let count = |k: Reported| results.iter().filter(|(_, r)| *r == k).count();

        let raw_db = raw.clone();
        let (theirs, _) = drive(reports, callers, move |i| {
            let db = raw_db.clone();
            let n = first + i;
            async move {
                db.execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "UPDATE raw_credentials SET failures = failures + 1, last_seen_ms = $1 \
                     WHERE credential_id = $2",
                    [
                        chrono::Utc::now().timestamp_millis().into(),
                        format!("cred-{}", credential_of(n)).into(),
                    ],
                ))
                .await
                .unwrap();
            }
        })
        .await;
        println!(
            "{:>7} {:>7} | {:>10.0} {:>7} {:>7} {:>7} | {:>6} {:>8} {:>8} {:>11} {:>6} | {:>9.0} {:>7} {:>7} | {:>6.3}",
            callers,
            reports,
            ours.rate,
            ms(ours.p50),
            ms(ours.p99),
            ms(ours.max),
            opened,
            count(Reported::Absorbed),
            count(Reported::Counted),
            count(Reported::Exhausted),
            count(Reported::Failed),
            theirs.rate,
            ms(theirs.p50),
            ms(theirs.p99),
            ours.rate / theirs.rate,
        );

        // Half as many fresh runs straight into the store, without gRPC.
        let first = next;
        next += reports / 2;
        let (store, p, t) = (
            bench.health.store().clone(),
            profiles.clone(),
            tails.clone(),
        );
        let (store_only, direct) = drive(reports / 2, callers, move |i| {
            let (store, p, request) = (store.clone(), p.clone(), report_request(first + i, &t));
            async move { report_direct(&store, &p, request).await }
        })
        .await;
        rounds.push((callers, ours, results, store_only, direct));
    }

    println!();
    println!(
        "where a report's time goes: the gRPC calls above beside Store::report called in process \
         (classified in the caller; no gRPC, no auth) on half as many fresh runs"
    );
    println!(
        "{:>7} {:<12} | {:>7} {:>10} {:>7} {:>7} {:>7} | {:>7} {:>10} {:>7} {:>7} {:>7}",
        "callers",
        "did",
        "gRPC n",
        "failures/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "store n",
        "failures/s",
        "p50 ms",
        "p99 ms",
        "max ms"
    );
    for (callers, ours, results, store_only, direct) in &rounds {
        println!(
            "{:>7} {:<12} | {:>7} {:>10.0} {:>7} {:>7} {:>7} | {:>7} {:>10.0} {:>7} {:>7} {:>7}",
            callers,
            "(all)",
            results.len(),
            ours.rate,
            ms(ours.p50),
            ms(ours.p99),
            ms(ours.max),
            direct.len(),
            store_only.rate,
            ms(store_only.p50),
            ms(store_only.p99),
            ms(store_only.max),
        );
        for (name, kind) in [
            ("other", Reported::Other),
            ("counted", Reported::Counted),
            ("opened", Reported::Opened),
            ("absorbed", Reported::Absorbed),
            ("quarantined", Reported::Exhausted),
        ] {
            let cell = |x: Option<(usize, Stats)>| match x {
                Some((n, s)) => format!(
                    "{:>7} {:>10} {:>7} {:>7} {:>7}",
                    n,
                    "",
                    ms(s.p50),
                    ms(s.p99),
                    ms(s.max)
                ),
                None => format!("{:>7} {:>10} {:>7} {:>7} {:>7}", 0, "", "-", "-", "-"),
            };
            println!(
                "{:>7} {:<12} | {} | {}",
                callers,
                name,
                cell(of_kind(results, kind)),
                cell(of_kind(direct, kind))
            );
        }
    }
    next
}

/// The same credential-health service on a plain tonic server whose accepted sockets
/// set TCP_NODELAY, as the peer `runplane_grpc::serve` must match.
async fn nodelay_server(health: &CredentialHealth) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let incoming = futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(socket, _)| {
            socket.set_nodelay(true).unwrap();
            socket
        });
        Some((accepted, listener))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health.service())
            .serve_with_incoming(incoming),
    );
    endpoint
}

/// Peer check: the same reports on `runplane_grpc::serve` and on a TCP_NODELAY server.
async fn bench_nodelay(bench: &Bench, tails: Arc<Tails>, mut next: usize) {
    let ours = client(&bench.endpoint).await;
    let nodelay = client(&nodelay_server(&bench.health).await).await;
    println!();
    println!(
        "peer check: the same ReportTurnFailure calls (fresh runs) on runplane_grpc::serve and on a \
         plain tonic server whose sockets set TCP_NODELAY"
    );
    println!(
        "{:>7} {:<22} {:>7} | {:>10} {:>7} {:>7} {:>7} | {:>8} {:>13} {:>13}",
        "callers",
        "server",
        "reports",
        "failures/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "incident",
        "incident p50",
        "others p50"
    );
    for (callers, reports) in [(1, 1_000), (16, 4_000)] {
        for (name, client) in [
            ("runplane_grpc::serve", &ours),
            ("tonic + TCP_NODELAY", &nodelay),
        ] {
            let (s, results) = grpc_reports(client, &tails, next, reports, callers).await;
            next += reports;
            // Answers carrying an incident (opened or absorbed) are the ~310-byte ones.
            let (incident, others): (Vec<_>, Vec<_>) = results
                .iter()
                .partition(|(_, r)| matches!(r, Reported::Opened | Reported::Absorbed));
            let p50 = |calls: &[&(Duration, Reported)]| match calls.len() {
                0 => "-".to_owned(),
                _ => ms(stats(
                    calls.iter().map(|(d, _)| *d).collect(),
                    Duration::from_secs(1),
                )
                .p50),
            };
            println!(
                "{:>7} {:<22} {:>7} | {:>10.0} {:>7} {:>7} {:>7} | {:>8} {:>13} {:>13}",
                callers,
                name,
                reports,
                s.rate,
                ms(s.p50),
                ms(s.p99),
                ms(s.max),
                incident.len(),
                p50(&incident),
                p50(&others),
            );
        }
    }
}

// --- 2. admission ---------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admitted {
    Yes,
    Refused,
    Failed,
}

/// The credential admission call `i` asks about.
fn admission_target(i: usize, round: usize) -> usize {
    (splitmix(0xad00_0000 + (round * ADMISSION_CALLS + i) as u64) % CREDENTIALS as u64) as usize
}

async fn bench_admission(bench: &Bench, select_db: &DatabaseConnection) {
    let client = client(&bench.endpoint).await;
    let db = bench.health.database();
    let now = chrono::Utc::now().timestamp_millis();
    let rows = credential::Entity::find().count(db).await.unwrap();
    let cooling = credential::Entity::find()
        .filter(credential::Column::CoolOffUntilMs.gt(now))
        .count(db)
        .await
        .unwrap();
    let quarantined = credential::Entity::find()
        .filter(credential::Column::QuarantineUntilMs.gt(now))
        .count(db)
        .await
        .unwrap();
    println!();
    println!(
        "admission: CheckAdmission over gRPC, {ADMISSION_CALLS} calls each, random of \
         {CREDENTIALS} credentials ({rows} with state rows; at start {cooling} cooling off, \
         {quarantined} quarantined)"
    );
    println!(
        "raw: plain SELECT by primary key of the same credentials table (Postgres, same callers); \
         ratio = runplane / raw calls/s; refusals are answered calls"
    );
    println!(
        "{:<14} {:>7} | {:>8} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>6} | {:>8} {:>7} {:>7} {:>7} | {:>6}",
        "by",
        "callers",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "admitted",
        "refused",
        "errors",
        "raw c/s",
        "raw p50",
        "raw p99",
        "raw max",
        "ratio"
    );
    let mut round = 0;
    for by_profile in [false, true] {
        for callers in ADMISSION_CALLERS {
            round += 1;
            let c = client.clone();
            let (ours, results) = drive(ADMISSION_CALLS, callers, move |i| {
                let mut c = c.clone();
                let k = admission_target(i, round);
                let target = if by_profile {
                    Target::Profile(format!("p{k}"))
                } else {
                    Target::CredentialId(format!("cred-{k}"))
                };
                async move {
                    let call = c.check_admission(credentials_pb::CheckAdmissionRequest {
                        org_id: "acme".into(),
                        target: Some(target),
                    });
                    match call.await {
                        Ok(_) => Admitted::Yes,
                        Err(s) if s.code() == tonic::Code::FailedPrecondition => Admitted::Refused,
                        Err(s) => {
                            eprintln!("CheckAdmission: {s}");
                            Admitted::Failed
                        }
                    }
                }
            })
            .await;
            let count = |k: Admitted| results.iter().filter(|(_, r)| *r == k).count();
            let raw = select_db.clone();
            let (theirs, _) = drive(ADMISSION_CALLS, callers, move |i| {
                let db = raw.clone();
                let k = admission_target(i, round);
                async move {
                    credential::Entity::find_by_id(format!("cred-{k}"))
                        .one(&db)
                        .await
                        .unwrap()
                }
            })
            .await;
            println!(
                "{:<14} {:>7} | {:>8.0} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>6} | {:>8.0} {:>7} {:>7} {:>7} | {:>6.3}",
                if by_profile {
                    "profile"
                } else {
                    "credential_id"
                },
                callers,
                ours.rate,
                ms(ours.p50),
                ms(ours.p99),
                ms(ours.max),
                count(Admitted::Yes),
                count(Admitted::Refused),
                count(Admitted::Failed),
                theirs.rate,
                ms(theirs.p50),
                ms(theirs.p99),
                ms(theirs.max),
                ours.rate / theirs.rate,
            );
        }
    }
}

#[tokio::main]
async fn main() {
    let started = Instant::now();
    let bench = start().await;
    let tails = Arc::new(Tails::new());

    // The raw UPDATE baseline's table, on a database of its own.
    let raw_db = TestDatabase::new().await;
    let raw = runplane_db::connect(raw_db.url()).await.unwrap();
    raw.execute_unprepared(
        "CREATE TABLE raw_credentials (credential_id text PRIMARY KEY, failures bigint NOT NULL, \
         last_seen_ms bigint NOT NULL); \
         INSERT INTO raw_credentials SELECT 'cred-' || g, 0, 0 FROM generate_series(0, 9999) g",
    )
    .await
    .unwrap();
    // A plain pool on credential health's own database, for the SELECT baseline.
    let select_db = runplane_db::connect(&bench.config.credential_health.database_url)
        .await
        .unwrap();

    // Warm-up: connections on both pools and the HTTP/2 connection.
    let c = client(&bench.endpoint).await;
    drive(64, 16, move |i| {
        let mut c = c.clone();
        async move {
            let _ = c
                .check_admission(credentials_pb::CheckAdmissionRequest {
                    org_id: "acme".into(),
                    target: Some(Target::CredentialId(format!("cred-{i}"))),
                })
                .await;
        }
    })
    .await;

    println!();
    in_process(&bench.config, &tails, 20_000);
    let next = bench_reports(&bench, tails.clone(), &raw).await;
    bench_admission(&bench, &select_db).await;
    bench_nodelay(&bench, tails.clone(), next).await;
    println!();
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}
