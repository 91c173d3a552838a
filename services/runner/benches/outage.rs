//! A thousand runners through a 10-second control-plane outage.
//!
//! 1,000 simulated runners in this process (each with its own run, key, channel and
//! retry layer, as separate sandboxes would have) append a batch every 2 s to a real run
//! store on Postgres. The run store is killed (its runtime shut down: listener and every
//! connection closed at once), left down for 10 s, and restarted on the same port. For
//! runplane's policy and, in the same run, for the seed's ([`RetryConfig::seed`]: 500 ms
//! base, 10 s cap, equal jitter, the same backoff for a refused connect as for any other
//! failure, no retry throttle) it prints: resume lag after the port reopens (p50, p99,
//! max), requests sent during the outage, the requests the run store handled in the first
//! second after it and their peak rate, the calls it refused for overload (shed with
//! pushback, then retried) and the calls that failed for overload, and the ratio of
//! runplane's p99 to the seed's.
//!
//! Two tables: the run store with `[server]`'s default limits, and the same run store
//! capped at [`CAPACITY`] concurrent requests (`max_concurrent_requests`), whose load
//! shedding answers the excess with pushback; there the lag is bounded below by
//! runners ÷ capacity × service time (printed as "floor"), and a policy without a herd
//! stays near it.
//!
//! Run: `cargo bench -p runplane-runner --bench outage` (needs the local Postgres).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use runplane_config::Config;
use runplane_grpc::{ServerLimits, ServiceSet};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_testkit::{TestDatabase, authed};
use runplane_transport::{RetryConfig, RetryLayer, RetryStats};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::server::NamedService;
use tower_service::Service;

const RUNNERS: usize = 1000;
const OUTAGE: Duration = Duration::from_secs(10);
const APPEND_EVERY: Duration = Duration::from_secs(2);
/// The capacity-limited variant's `max_concurrent_requests`.
const CAPACITY: usize = 4;
const TOKEN: &str = "bench-outage-service-token-0123456789abcd";

/// Calls the handlers took: when each arrived and how long it took.
type Arrivals = Arc<Mutex<Vec<(Instant, Duration)>>>;

#[derive(Clone)]
struct Count<S> {
    inner: S,
    arrivals: Arrivals,
}

impl<S: NamedService> NamedService for Count<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Count<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let arrived = Instant::now();
        let call = self.inner.call(request);
        let arrivals = self.arrivals.clone();
        Box::pin(async move {
            let response = call.await;
            arrivals.lock().unwrap().push((arrived, arrived.elapsed()));
            response
        })
    }
}

/// The run store on a runtime of its own, so stopping it drops every connection at once.
struct Server {
    runtime: tokio::runtime::Runtime,
    /// When its port was bound.
    listening: Arc<Mutex<Option<Instant>>>,
}

/// A fresh run store (its own pool) on its own runtime, as a restarted process would be;
/// `capacity` caps its concurrent ordinary calls (else `[server]`'s default limits).
fn start_server(
    config: &Config,
    addr: &str,
    arrivals: &Arrivals,
    capacity: Option<usize>,
) -> Server {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = config.clone();
    let arrivals = arrivals.clone();
    let addr = addr.to_owned();
    let listening = Arc::new(Mutex::new(None));
    let bound = listening.clone();
    runtime.spawn(async move {
        let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
            .await
            .expect("run store");
        let (runner, run) = store.services();
        let mut services = ServiceSet::new();
        services
            .authenticate(runplane_grpc::auth::Tokens::from_config(&config.auth))
            .add(Count {
                inner: runner,
                arrivals: arrivals.clone(),
            })
            .add(Count {
                inner: run,
                arrivals: arrivals.clone(),
            });
        if let Some(n) = capacity {
            services.limits(ServerLimits {
                max_concurrent_requests: Some(n),
                ..ServerLimits::default()
            });
        }
        let listener = loop {
            match tokio::net::TcpListener::bind(&addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        *bound.lock().unwrap() = Some(Instant::now());
        let _ = runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        )
        .await;
    });
    Server { runtime, listening }
}

struct Row {
    lag_p50: Duration,
    lag_p99: Duration,
    lag_max: Duration,
    during_outage: u64,
    first_second: usize,
    peak_100ms_rate: usize,
    /// Calls the run store refused for overload (shed, then retried by the transport).
    shed: u64,
    /// Appends that failed for overload (the caller saw RESOURCE_EXHAUSTED).
    failed_overload: u64,
    gave_up: u64,
    /// Mean handler time of the calls after the restart.
    service_time: Duration,
}

async fn scenario(
    name: &str,
    config: &Config,
    addr: &str,
    retry: RetryConfig,
    capacity: Option<usize>,
) -> Row {
    let arrivals: Arrivals = Arc::default();
    // Runs are created without a cap: the cap is for the fleet's appends.
    let server = start_server(config, addr, &arrivals, None);
    let endpoint = format!("http://{addr}");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let channel = loop {
        match tonic::transport::Endpoint::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut op = RunServiceClient::new(channel);
    let mut runners = Vec::new();
    for r in 0..RUNNERS {
        let run = op
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("outage-{name}-{r:05}-request"),
                    org_id: "bench".into(),
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
        let key = op
            .issue_run_key(authed(
                runstore_pb::IssueRunKeyRequest {
                    run_id: run.id.clone(),
                    sandbox_id: "sbx".into(),
                    sandbox_generation: 1,
                    idempotency_key: format!("outage-key-{}", run.id),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .run_key;
        runners.push((run.id, key));
    }
    drop(op);
    // The fleet runs against the run store as configured for this table.
    server.runtime.shutdown_background();
    let server = start_server(config, addr, &arrivals, capacity);

    let stop = Arc::new(tokio::sync::Notify::new());
    let failed_overload = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let mut all_stats: Vec<Arc<RetryStats>> = Vec::new();
    for (i, (run_id, key)) in runners.into_iter().enumerate() {
        let layer = RetryLayer::new(retry.clone());
        all_stats.push(layer.stats());
        let channel = runplane_transport::connect_lazy(&endpoint, &layer).unwrap();
        let mut client = RunnerServiceClient::new(channel);
        let stop = stop.clone();
        let failed_overload = failed_overload.clone();
        tasks.push(tokio::spawn(async move {
            // Spread the runners over the append period, as independent sandboxes are.
            tokio::time::sleep(APPEND_EVERY * i as u32 / RUNNERS as u32).await;
            let mut successes = Vec::new();
            let mut batch = 0u64;
            loop {
                batch += 1;
                let append = client.append_events(authed(
                    runstore_pb::AppendEventsRequest {
                        run_id: run_id.clone(),
                        batch_key: format!("outage-batch-{batch:08}"),
                        events: vec![runstore_pb::EventInput {
                            kind: runstore_pb::EventKind::Stdout as i32,
                            text: format!("line {batch}"),
                            ..Default::default()
                        }],
                    },
                    &key,
                ));
                tokio::select! {
                    result = append => match result {
                        Ok(_) => successes.push(Instant::now()),
                        Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                            failed_overload.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {}
                    },
                    () = stop.notified() => return successes,
                }
                tokio::select! {
                    () = tokio::time::sleep(APPEND_EVERY) => {}
                    () = stop.notified() => return successes,
                }
            }
        }));
    }

    tokio::time::sleep(Duration::from_secs(4)).await;
    let attempts = || -> u64 {
        all_stats
            .iter()
            .map(|s| s.attempts.load(Ordering::Relaxed))
            .sum()
    };
    let before = attempts();
    server.runtime.shutdown_background();
    tokio::time::sleep(OUTAGE).await;
    let during_outage = attempts() - before;
    let server = start_server(config, addr, &arrivals, capacity);
    let reopened = loop {
        if let Some(at) = *server.listening.lock().unwrap() {
            break at;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    tokio::time::sleep(Duration::from_secs(25)).await;
    stop.notify_waiters();
    let mut lags = Vec::new();
    for t in tasks {
        stop.notify_waiters();
        let successes = t.await.unwrap();
        if let Some(first) = successes.iter().find(|s| **s >= reopened) {
            lags.push(*first - reopened);
        }
    }
    server.runtime.shutdown_background();
    lags.sort();
    let at = |q: f64| lags[((lags.len() as f64 - 1.0) * q).round() as usize];
    let arrivals = arrivals.lock().unwrap().clone();
    let after: Vec<(Duration, Duration)> = arrivals
        .iter()
        .filter(|(a, _)| *a >= reopened)
        .map(|(a, took)| (*a - reopened, *took))
        .collect();
    let first_second: Vec<Duration> = after
        .iter()
        .map(|(a, _)| *a)
        .filter(|a| *a < Duration::from_secs(1))
        .collect();
    let peak_100ms = (0..10)
        .map(|w| {
            let from = Duration::from_millis(w * 100);
            first_second
                .iter()
                .filter(|d| **d >= from && **d < from + Duration::from_millis(100))
                .count()
        })
        .max()
        .unwrap_or(0);
    let service_time =
        after.iter().map(|(_, took)| *took).sum::<Duration>() / after.len().max(1) as u32;
    assert_eq!(lags.len(), RUNNERS, "every runner resumed within 25 s");
    let sum = |f: fn(&RetryStats) -> u64| all_stats.iter().map(|s| f(s)).sum::<u64>();
    Row {
        lag_p50: at(0.5),
        lag_p99: at(0.99),
        lag_max: *lags.last().unwrap(),
        during_outage,
        first_second: first_second.len(),
        peak_100ms_rate: peak_100ms * 10,
        shed: sum(|s| s.rate_limited.load(Ordering::Relaxed)),
        failed_overload: failed_overload.load(Ordering::Relaxed),
        gave_up: sum(|s| s.gave_up.load(Ordering::Relaxed)),
        service_time,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

async fn table(config: &Config, addr: &str, capacity: Option<usize>) {
    let policies = [
        (
            "runplane (1s base, 6s cap, full jitter; connect 100ms-1s)",
            RetryConfig::default(),
        ),
        (
            "seed (500ms base, 10s cap, equal jitter)",
            RetryConfig::seed(),
        ),
    ];
    match capacity {
        None => println!("\nrun store with [server]'s default limits"),
        Some(n) => {
            println!("\nrun store capped at {n} concurrent requests (max_concurrent_requests)")
        }
    }
    println!(
        "{:<58} | {:>8} {:>8} {:>8} | {:>14} | {:>13} {:>14} | {:>6} {:>11} {:>7} | {:>8} {:>8}",
        "policy",
        "lag p50",
        "lag p99",
        "lag max",
        "reqs in outage",
        "handled 1st s",
        "peak rate (/s)",
        "shed",
        "failed (RE)",
        "gave up",
        "service",
        "floor"
    );
    let mut p99s = Vec::new();
    for (name, retry) in policies {
        let label = format!(
            "{}{}",
            &name[..4],
            capacity.map_or(String::new(), |n| format!("-cap{n}"))
        );
        let row = scenario(&label, config, addr, retry, capacity).await;
        // Lag no policy can beat: the fleet's appends one after another through the cap.
        let floor = capacity.map_or(Duration::ZERO, |n| {
            row.service_time * RUNNERS as u32 / n as u32
        });
        println!(
            "{:<58} | {:>6}ms {:>6}ms {:>6}ms | {:>14} | {:>13} {:>14} | {:>6} {:>11} {:>7} | {:>6.1}ms {:>6}ms",
            name,
            ms(row.lag_p50),
            ms(row.lag_p99),
            ms(row.lag_max),
            row.during_outage,
            row.first_second,
            row.peak_100ms_rate,
            row.shed,
            row.failed_overload,
            row.gave_up,
            row.service_time.as_secs_f64() * 1000.0,
            ms(floor),
        );
        p99s.push(row.lag_p99);
    }
    println!(
        "p99 runplane/seed = {:.2}x (goal <= 0.2x)",
        p99s[0].as_secs_f64() / p99s[1].as_secs_f64()
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let db = TestDatabase::new().await;
    let config = runplane_testkit::config::run_store(TOKEN, db.url());
    let addr = runplane_testkit::free_local_addr().to_string();
    println!(
        "{RUNNERS} runners, one append per {}s each, run store down {}s then back on the same port; lag from the port reopening",
        APPEND_EVERY.as_secs(),
        OUTAGE.as_secs()
    );
    table(&config, &addr, None).await;
    table(&config, &addr, Some(CAPACITY)).await;
}
