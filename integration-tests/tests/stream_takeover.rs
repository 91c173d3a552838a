//! A real runner streams its output as frames under its lease; the coordinator takes the
//! stream over (the lease lapsed, or Redis lost it), the claim reaches the runner as
//! resume_stream, and the runner continues with the new token: a tail sees every line
//! once, in order.

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::Secret;
use runplane_grpc::ServiceSet;
use runplane_grpc::client::Bearer;
use runplane_integration_tests::runplane_bin;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_stream_recovery::StreamRecovery;
use runplane_stream_recovery::domain::policy::BufferLimits;
use runplane_stream_recovery::store::RecoveryStore;
use runplane_stream_recovery::store::redis::RedisStore;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestDatabase, TestRedis};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const TOKEN: &str = "takeover-test-service-token-0123456789ab";
const SCRIPT: &str = "for i in $(seq 1 10); do echo line $i; done; sleep 4; for i in $(seq 11 20); do echo line $i; done";

type Recovery = StreamRecoveryServiceClient<InterceptedService<Channel, Bearer>>;

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

struct World {
    clock: ManualClock,
    coordinator_endpoint: String,
    run_store: InProcessRunStore,
    _db: TestDatabase,
}

impl World {
    async fn new(redis_url: &str, prefix: &str) -> Self {
        Self::with_limits(redis_url, prefix, BufferLimits::default()).await
    }

    async fn with_limits(redis_url: &str, prefix: &str, limits: BufferLimits) -> Self {
        let db = TestDatabase::new().await;
        let mut config = runplane_testkit::config::run_store(TOKEN, db.url());
        config.auth.service_token = Secret::new(runplane_integration_tests::SERVICE_TOKEN);
        let run_store = InProcessRunStore::start(&config).await;
        config.run_store.endpoint = run_store.endpoint().to_owned();

        let clock = ManualClock::new(chrono::Utc::now());
        let store = RedisStore::connect(redis_url, prefix).await.unwrap();
        let coordinator =
            StreamRecovery::with_store(Arc::new(store), &config, Arc::new(clock.clone()))
                .unwrap()
                .with_limits(limits);
        let mut services = ServiceSet::new();
        coordinator.register(&mut services);
        coordinator.start();
        let coordinator_endpoint = serve(services).await;
        Self {
            clock,
            coordinator_endpoint,
            run_store,
            _db: db,
        }
    }

    async fn recovery(&self) -> Recovery {
        StreamRecoveryServiceClient::with_interceptor(
            channel(&self.coordinator_endpoint).await,
            Bearer::new(TOKEN),
        )
    }

    /// A run of the two-part script and its real runner process.
    async fn start_run(&self) -> (String, tokio::process::Child) {
        let mut op = RunServiceClient::with_interceptor(
            channel(self.run_store.endpoint()).await,
            Bearer::new(TOKEN),
        );
        let run = op
            .create_run(runstore_pb::CreateRunRequest {
                client_request_id: "takeover-request-000001".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: "sh".into(),
                args: vec!["-c".into(), SCRIPT.into()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        let key = op
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: run.id.clone(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: "takeover-sandbox-key-1".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .run_key;
        let runner = tokio::process::Command::new(runplane_bin())
            .arg("runner")
            .env("RUNPLANE_ENDPOINT", self.run_store.endpoint())
            .env("RUNPLANE_RECOVERY_ENDPOINT", &self.coordinator_endpoint)
            .env("RUNPLANE_RUN_ID", &run.id)
            .env("RUNPLANE_RUN_KEY", &key)
            .env_remove("RUNPLANE_CONFIG")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        (run.id, runner)
    }

    /// Waits until the first ten frames are in the buffer.
    async fn first_frames(&self, run_id: &str) {
        let mut recovery = self.recovery().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let b = recovery
                .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
                    run_id: run_id.to_owned(),
                })
                .await
                .unwrap()
                .into_inner();
            if b.next_sequence >= 11 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the first frames arrive"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Presumes the controller dead (its lease lapses on the coordinator's clock) and plans
    /// recoveries until one claims the stream. A renewal racing the jump can keep the
    /// lease for a moment; the next jump takes it.
    async fn claim(&self, run_id: &str) -> recovery_pb::PlanRecoveryResponse {
        let mut recovery = self.recovery().await;
        for _ in 0..20 {
            self.clock.advance(Duration::from_secs(31));
            if let Ok(plan) = recovery
                .plan_recovery(recovery_pb::PlanRecoveryRequest {
                    run_id: run_id.to_owned(),
                    reason: "test".into(),
                })
                .await
                && plan.get_ref().decision() == recovery_pb::RecoveryDecision::Claimed
            {
                return plan.into_inner();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the stream was never claimed");
    }

    /// Every frame of the run's buffer, as text.
    async fn lines(&self, run_id: &str) -> Vec<String> {
        let mut tail = self
            .recovery()
            .await
            .tail(recovery_pb::TailRequest {
                run_id: run_id.to_owned(),
                from_sequence: 0,
                follow: false,
                heartbeat_interval: None,
            })
            .await
            .unwrap()
            .into_inner();
        let mut lines = Vec::new();
        while let Some(item) = tail.message().await.unwrap() {
            if let Some(recovery_pb::tail_response::Item::Frame(f)) = item.item {
                lines.push(String::from_utf8(f.data).unwrap());
            }
        }
        lines
    }
}

impl World {
    async fn attempts(&self, run_id: &str) -> u32 {
        self.recovery()
            .await
            .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
                run_id: run_id.to_owned(),
            })
            .await
            .unwrap()
            .into_inner()
            .budget
            .unwrap()
            .attempts
    }
}

fn expected() -> Vec<String> {
    (1..=20).map(|i| format!("line {i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_over_stream_continues_with_the_new_token() {
    let redis = TestRedis::new().await;
    let w = World::new(redis.url(), redis.prefix()).await;
    let (run_id, mut runner) = w.start_run().await;
    w.first_frames(&run_id).await;
    let claimed = w.claim(&run_id).await;
    assert_eq!(claimed.next_sequence, 11);
    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        w.lines(&run_id).await,
        expected(),
        "every line once, in order, across the takeover"
    );
    let budget = w
        .recovery()
        .await
        .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(budget.budget.unwrap().attempts, 1);
}

/// A Redis of this test's own, so it can be killed and restarted without touching
/// anyone else's keys.
struct PrivateRedis {
    port: u16,
    child: Option<std::process::Child>,
}

impl PrivateRedis {
    fn start(port: u16) -> Self {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is installed (see scripts/test)");
        Self {
            port,
            child: Some(child),
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn wait_ready(&self) {
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server did not start on port {}", self.port);
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_serves_again_when_redis_returns_and_the_run_finishes() {
    let port = runplane_testkit::free_local_addr().port();
    let mut redis = PrivateRedis::start(port);
    redis.wait_ready().await;
    let w = World::new(&format!("redis://127.0.0.1:{port}"), "restart:").await;
    let (run_id, mut runner) = w.start_run().await;
    w.first_frames(&run_id).await;

    // Redis dies (and, without persistence, forgets everything).
    redis.kill();
    let down = w
        .recovery()
        .await
        .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(down.code(), tonic::Code::Unavailable);
    let mut redis = PrivateRedis::start(port);
    redis.wait_ready().await;

    // Served again. The lost lease is no fence and there is no lost controller to claim:
    // the runner's next renewal or append takes the lease back, and it re-sends what it
    // holds from where the emptied buffer starts.
    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the run finishes");
    assert_eq!(w.lines(&run_id).await, expected());
    assert_eq!(w.attempts(&run_id).await, 0, "nothing was taken over");
    redis.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_whose_keys_were_flushed_mid_run_resyncs_and_its_run_finishes() {
    let redis = TestRedis::new().await;
    let w = World::new(redis.url(), redis.prefix()).await;
    let (run_id, mut runner) = w.start_run().await;
    w.first_frames(&run_id).await;
    // Every key of the run vanishes (eviction, the 24 h TTL, a flush) while it runs.
    RedisStore::connect(redis.url(), redis.prefix())
        .await
        .unwrap()
        .forget(&run_id)
        .await
        .unwrap();
    // Watchers keep planning meanwhile; none of them takes the stream over.
    for _ in 0..3 {
        w.clock.advance(Duration::from_secs(31));
        let plan = w
            .recovery()
            .await
            .plan_recovery(recovery_pb::PlanRecoveryRequest {
                run_id: run_id.clone(),
                reason: "test".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(plan.decision(), recovery_pb::RecoveryDecision::Claimed);
    }
    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the run finishes");
    assert_eq!(
        w.lines(&run_id).await,
        expected(),
        "the runner re-sent what the flush lost"
    );
    assert_eq!(w.attempts(&run_id).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_refusal_ends_the_stream_turn_and_the_run_goes_on() {
    let redis = TestRedis::new().await;
    // Room for about ten "line N" frames, not twenty.
    let limits = BufferLimits {
        stream_bytes: 70,
        ..BufferLimits::default()
    };
    let w = World::with_limits(redis.url(), redis.prefix(), limits).await;
    let (run_id, mut runner) = w.start_run().await;
    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the agent ran to the end");
    let run = w.run_state(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Succeeded);

    let events = w
        .run_store
        .store()
        .store()
        .events_after(&run_id, 0, 1000)
        .await
        .unwrap();
    let events: Vec<runstore_pb::Event> = events
        .iter()
        .map(runplane_run_store::convert::event)
        .collect();
    let stdout: Vec<String> = events
        .iter()
        .filter(|e| e.kind() == runstore_pb::EventKind::Stdout)
        .map(|e| e.text.clone())
        .collect();
    assert_eq!(stdout, expected(), "the run store got every line");
    let ended: Vec<&runstore_pb::Event> = events
        .iter()
        .filter(|e| e.name == "live_stream_ended")
        .collect();
    assert_eq!(ended.len(), 1, "one event says what was dropped");
    let streamed = w.lines(&run_id).await;
    assert!(
        !streamed.is_empty() && streamed.len() < 20,
        "the stream kept what fitted: {streamed:?}"
    );
    assert_eq!(streamed[..], expected()[..streamed.len()]);
    assert!(
        ended[0]
            .text
            .contains(&format!("frame {}", streamed.len() + 1)),
        "{}",
        ended[0].text
    );
    assert_eq!(w.attempts(&run_id).await, 0, "a refusal is not a hand-off");
}

impl World {
    async fn run_state(&self, run_id: &str) -> runstore_pb::Run {
        RunServiceClient::with_interceptor(
            channel(self.run_store.endpoint()).await,
            Bearer::new(TOKEN),
        )
        .get_run(runstore_pb::GetRunRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
    }
}
