//! The recovery storm through the real Tail route, in real time.
//!
//! A run store on Postgres and the coordinator on Redis, each served over gRPC on
//! loopback. A run's runner acquires the stream lease, appends, and dies. Then 1 or 3
//! readers hold `Tail {follow: true}` streams open, as UI tabs or `runplane logs` would;
//! nothing else plans. Each controller a takeover hands the run to (a `resume_stream`
//! message in the run store) dies one second later: it releases its lease. Over at most
//! 60 s the table counts the `resume_stream` messages the tails caused, the aborts, how
//! the run ended and when. The seed's bar is at most 6 resume requests; its "before"
//! (claim whenever the lease is free, one plan a second) would send one a second.
//!
//! Run: `cargo bench -p runplane-stream-recovery --bench tail_storm` (needs the local
//! Postgres and Redis; about a minute per row).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use runplane_config::{Config, Secret};
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::{TestDatabase, TestRedis};
use tonic::transport::Channel;

const TOKEN: &str = "tail-storm-bench-service-token-0123456789";
const WINDOW: Duration = Duration::from_secs(60);
/// A controller dies this long after a takeover handed it the run.
const CONTROLLER_LIFE: Duration = Duration::from_secs(1);

struct Outcome {
    resumes: usize,
    aborts: usize,
    state: runstore_pb::RunState,
    reason: String,
    ended_after: Option<Duration>,
    tail_items: usize,
}

async fn serve(services: ServiceSet) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    endpoint
}

async fn channel(endpoint: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn storm(tails: usize) -> Outcome {
    let db = TestDatabase::new().await;
    let redis = TestRedis::new().await;
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
    config.run_store.database_url = db.url().to_owned();
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    config.run_store.admission = false;
    let clock = runplane_clock::SystemClock::shared();
    let run_store = RunStore::open(&config, clock.clone()).await.unwrap();
    let (runner_service, run_service) = run_store.services();
    let mut services = ServiceSet::new();
    services
        .authenticate(runplane_grpc::auth::Tokens::from_config(&config.auth))
        .add(runner_service)
        .add(run_service);
    let run_store_endpoint = serve(services).await;
    config.run_store.endpoint = run_store_endpoint.clone();
    let store = RedisStore::connect(redis.url(), redis.prefix())
        .await
        .unwrap();
    let coordinator = StreamRecovery::with_store(Arc::new(store), &config, clock).unwrap();
    let mut services = ServiceSet::new();
    coordinator.register(&mut services);
    coordinator.start();
    let coordinator_endpoint = serve(services).await;

    let mut op =
        RunServiceClient::with_interceptor(channel(&run_store_endpoint).await, Bearer::new(TOKEN));
    let run_id = op
        .create_run(runstore_pb::CreateRunRequest {
            client_request_id: format!("tail-storm-{tails}-request"),
            org_id: "acme".into(),
            target: Some(runstore_pb::create_run_request::Target::CredentialId(
                "c".into(),
            )),
            command: "agent".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id;
    let key = op
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run_id.clone(),
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: format!("tail-storm-{tails}-key-0001"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .run_key;
    RunnerServiceClient::with_interceptor(
        channel(&run_store_endpoint).await,
        Bearer::new(key.clone()),
    )
    .hello(runstore_pb::HelloRequest {
        run_id: run_id.clone(),
        nonce: "tail-storm-runner-nonce".into(),
        runner_version: String::new(),
    })
    .await
    .unwrap();

    // The first controller: acquires, appends, dies.
    let mut runner = StreamRecoveryServiceClient::with_interceptor(
        channel(&coordinator_endpoint).await,
        Bearer::new(key),
    );
    let first = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: first.clone(),
            frames: (1..=3)
                .map(|s| recovery_pb::FrameInput {
                    sequence: s,
                    data: format!("frame {s}").into_bytes(),
                })
                .collect(),
            resync: false,
        })
        .await
        .unwrap();
    runner
        .release_lease(recovery_pb::ReleaseLeaseRequest {
            run_id: run_id.clone(),
            controller_token: first,
        })
        .await
        .unwrap();

    let started = Instant::now();
    let items = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut readers = Vec::new();
    for _ in 0..tails {
        let endpoint = coordinator_endpoint.clone();
        let run_id = run_id.clone();
        let items = items.clone();
        readers.push(tokio::spawn(async move {
            let mut tail = StreamRecoveryServiceClient::with_interceptor(
                channel(&endpoint).await,
                Bearer::new(TOKEN),
            )
            .tail(recovery_pb::TailRequest {
                run_id,
                from_sequence: 1,
                follow: true,
                heartbeat_interval: None,
            })
            .await
            .unwrap()
            .into_inner();
            while let Ok(Some(item)) = tail.message().await {
                items.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if matches!(item.item, Some(recovery_pb::tail_response::Item::Ended(_))) {
                    return;
                }
            }
        }));
    }

    // Each controller a takeover creates dies a second after it was handed the run.
    let mut seen = HashSet::new();
    let mut ended_after = None;
    let mut aborts = 0;
    let mut resumes = 0;
    while started.elapsed() < WINDOW {
        let messages = run_store
            .store()
            .pending_messages(&run_id, 100)
            .await
            .unwrap();
        let messages: Vec<runstore_pb::SteeringMessage> = messages
            .iter()
            .map(runplane_run_store::convert::message)
            .collect();
        resumes = 0;
        aborts = 0;
        for m in &messages {
            match m.kind() {
                runstore_pb::SteeringKind::Abort => aborts += 1,
                runstore_pb::SteeringKind::ResumeStream => {
                    resumes += 1;
                    if let Some(runstore_pb::steering_message::Payload::ResumeStream(p)) =
                        &m.payload
                        && seen.insert(p.controller_token.clone())
                    {
                        let mut runner = runner.clone();
                        let (run_id, token) = (run_id.clone(), p.controller_token.clone());
                        tokio::spawn(async move {
                            tokio::time::sleep(CONTROLLER_LIFE).await;
                            let _ = runner
                                .release_lease(recovery_pb::ReleaseLeaseRequest {
                                    run_id,
                                    controller_token: token,
                                })
                                .await;
                        });
                    }
                }
                _ => {}
            }
        }
        let run = op
            .get_run(runstore_pb::GetRunRequest {
                run_id: run_id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        if run.state().is_terminal() && ended_after.is_none() {
            ended_after = Some(started.elapsed());
        }
        // Once ended, a few more seconds show that nothing else arrives.
        if ended_after.is_some_and(|at| started.elapsed() > at + Duration::from_secs(3)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for reader in readers {
        reader.abort();
    }
    let run = op
        .get_run(runstore_pb::GetRunRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    Outcome {
        resumes,
        aborts,
        state: run.state(),
        reason: run.failure_reason.clone(),
        ended_after,
        tail_items: items.load(std::sync::atomic::Ordering::Relaxed),
    }
}

#[tokio::main]
async fn main() {
    println!(
        "storm through Tail: controllers die {} s after each takeover, only tails plan, window {} s",
        CONTROLLER_LIFE.as_secs(),
        WINDOW.as_secs()
    );
    println!(
        "{:<6} {:>16} {:>7} {:>34} {:>10} {:>11} {:>22}",
        "tails",
        "resume requests",
        "aborts",
        "run ended",
        "after s",
        "tail items",
        "unbounded (1/s plan)"
    );
    for tails in [1, 3] {
        let o = storm(tails).await;
        let ended = format!("{} {}", o.state.as_str_name(), o.reason);
        let after = o
            .ended_after
            .map(|d| format!("{:.1}", d.as_secs_f64()))
            .unwrap_or_else(|| "not ended".into());
        // Claim whenever the lease is free: each controller lives 1 s, a plan comes each
        // second, so one resume request a second for the whole window.
        let unbounded = WINDOW.as_secs() / CONTROLLER_LIFE.as_secs();
        println!(
            "{:<6} {:>16} {:>7} {:>34} {:>10} {:>11} {:>22}",
            tails, o.resumes, o.aborts, ended, after, o.tail_items, unbounded
        );
    }
}
