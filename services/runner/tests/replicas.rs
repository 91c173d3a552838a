//! Two run-store replicas on one database, each its own process. One is SIGSTOPped for
//! good in the middle of a runner's appends: a frozen pod keeps its connections open and
//! answers nothing, so only an attempt deadline and a fresh connection get the runner
//! past it. The appends finish on the other replica, and nothing is applied twice.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TOKEN, connected};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_runner::Bearer;
use runplane_testkit::run_store::serve_at;
use runplane_transport::{RetryConfig, RetryLayer};

const ENV_ADDR: &str = "RUNPLANE_TEST_REPLICA_ADDR";
const ENV_DB: &str = "RUNPLANE_TEST_REPLICA_DB";
const ENV_SEED: &str = "RUNPLANE_TEST_REPLICA_SEED";

/// Not a test of its own: the replica process the test below starts (this same binary,
/// run with this test's name and the replica's settings in its environment).
#[test]
fn replica_process() {
    let (Ok(addr), Ok(db), Ok(seed)) = (
        std::env::var(ENV_ADDR),
        std::env::var(ENV_DB),
        std::env::var(ENV_SEED),
    ) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(serve_at(
        &runplane_testkit::config::run_store_signing_with(TOKEN, &db, &seed),
        &addr,
    ));
}

/// A replica process, killed (and woken first, if stopped) when dropped.
struct Replica(Child);

impl Replica {
    fn start(addr: &str, db: &str, seed: &str) -> Self {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "replica_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_ADDR, addr)
            .env(ENV_DB, db)
            .env(ENV_SEED, seed)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self(child)
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.0.id() as i32), signal).unwrap();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0.id() as i32), Signal::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_mid_call_is_left_behind_and_nothing_is_applied_twice() {
    let db = runplane_testkit::TestDatabase::new().await;
    let seed = runplane_testkit::config::fresh_receipt_seed();
    let a = runplane_testkit::free_local_addr().to_string();
    let b = runplane_testkit::free_local_addr().to_string();
    // One after the other: replicas migrating the same database at once collide.
    let replica_a = Replica::start(&a, db.url(), &seed);
    let a_channel = connected(&format!("http://{a}")).await;
    let _replica_b = Replica::start(&b, db.url(), &seed);
    connected(&format!("http://{b}")).await;

    let mut op = RunServiceClient::new(a_channel);
    let (run, key) = common::run_with_key(
        &mut op,
        "replica-stop-request-01",
        "agent",
        vec![],
        "replica-stop-key-000001",
    )
    .await;

    // The runner knows both replicas; replica A comes first.
    let layer = RetryLayer::new(RetryConfig {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(100),
        attempt_timeout: Duration::from_millis(1500),
        handshake_timeout: Duration::from_millis(500),
        ordinary_budget: Duration::from_secs(20),
        ..RetryConfig::default()
    });
    let channel =
        runplane_transport::connect_lazy(&format!("http://{a},http://{b}"), &layer).unwrap();
    let upstream = channel.upstream().clone();
    let client = RunnerServiceClient::with_interceptor(channel, Bearer::new(key));
    client
        .clone()
        .hello(runstore_pb::HelloRequest {
            run_id: run.id.clone(),
            nonce: "replica-stop-nonce-01".into(),
            runner_version: "test".into(),
        })
        .await
        .unwrap();

    const BATCHES: usize = 20;
    let append = |i: usize| {
        let mut client = client.clone();
        let run_id = run.id.clone();
        async move {
            client
                .append_events(runstore_pb::AppendEventsRequest {
                    run_id,
                    batch_key: format!("replica-stop-batch-{i:04}"),
                    events: vec![runstore_pb::EventInput {
                        kind: runstore_pb::EventKind::Stdout as i32,
                        text: format!("line {i}"),
                        ..Default::default()
                    }],
                })
                .await
        }
    };
    for i in 0..BATCHES {
        if i == BATCHES / 2 {
            // Frozen with the call on the wire: A never answers it, and never will.
            let call = tokio::spawn(append(i));
            tokio::time::sleep(Duration::from_millis(2)).await;
            replica_a.signal(Signal::SIGSTOP);
            call.await
                .unwrap()
                .expect("the call moved on to the other replica");
        } else {
            append(i).await.unwrap();
        }
    }
    assert!(upstream.replacements() >= 1, "left the frozen replica");

    let store = RunStore::open(
        &runplane_testkit::config::run_store_signing_with(TOKEN, db.url(), &seed),
        runplane_clock::SystemClock::shared(),
    )
    .await
    .unwrap();
    let stored = store.store().events_after(&run.id, 0, 1000).await.unwrap();
    let lines: Vec<&str> = stored
        .iter()
        .filter(|e| e.kind == runstore_pb::EventKind::Stdout as i32)
        .map(|e| e.text.as_str())
        .collect();
    let expected: Vec<String> = (0..BATCHES).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, expected, "every batch once, in order");
}
