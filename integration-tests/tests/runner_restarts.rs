//! A run survives control-plane restarts: a real run-store process on Postgres is
//! SIGKILLed and restarted on the same port while a real runner runs a real command.

use std::time::Duration;

use futures::StreamExt;
use runplane_integration_tests::{Process, channel, runplane_bin, start_serve};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::{TestDatabase, free_local_addr};
use tokio::process::Command;

const TOKEN: &str = "restart-test-operator-token-0123456789abc";
const RECEIPT_KEY: &str = "1f2e3d4c5b6a79887766554433221100ffeeddccbbaa99887766554433221100";

struct ControlPlane {
    env: Vec<(&'static str, String)>,
    process: Process,
    endpoint: String,
}

impl ControlPlane {
    async fn start(db: &TestDatabase) -> Self {
        let addr = free_local_addr().to_string();
        let env = vec![
            ("RUNPLANE_SERVER__LISTEN", addr.clone()),
            ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN.to_owned()),
            ("RUNPLANE_RUN_STORE__DATABASE_URL", db.url().to_owned()),
            (
                "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY",
                RECEIPT_KEY.to_owned(),
            ),
            // Not about admission: runs are created on the credential they name.
            ("RUNPLANE_RUN_STORE__ADMISSION", "false".to_owned()),
        ];
        let process = Self::spawn(&env).await;
        Self {
            endpoint: format!("http://{addr}"),
            env,
            process,
        }
    }

    async fn spawn(env: &[(&'static str, String)]) -> Process {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        start_serve(&["run-store"], &env).await
    }

    /// SIGKILL, a moment down, then a new process on the same port.
    async fn crash_and_restart(&mut self, down: Duration) {
        self.process.kill().await;
        tokio::time::sleep(down).await;
        self.process = Self::spawn(&self.env).await;
    }

    async fn operator(
        &self,
    ) -> RunServiceClient<
        tonic::service::interceptor::InterceptedService<
            tonic::transport::Channel,
            impl tonic::service::Interceptor,
        >,
    > {
        RunServiceClient::with_interceptor(
            channel(&self.endpoint).await,
            |mut r: tonic::Request<()>| {
                r.metadata_mut()
                    .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
                Ok(r)
            },
        )
    }

    /// A run of `script` (run by `sh -c`) and its key, as the reconciler would mint it.
    async fn run(&self, name: &str, script: &str) -> (String, String) {
        let mut op = self.operator().await;
        let run = op
            .create_run(runstore_pb::CreateRunRequest {
                client_request_id: format!("{name}-request-0000001"),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "cred".into(),
                )),
                command: "sh".into(),
                args: vec!["-c".into(), script.into()],
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
                sandbox_id: "sbx-restart".into(),
                sandbox_generation: 1,
                idempotency_key: format!("{name}-sandbox-key-01"),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .run_key;
        (run.id, key)
    }

    async fn get_run(&self, run_id: &str) -> runstore_pb::Run {
        self.operator()
            .await
            .get_run(runstore_pb::GetRunRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    async fn events(&self, run_id: &str) -> Vec<runstore_pb::Event> {
        let mut stream = self
            .operator()
            .await
            .watch_run(runstore_pb::WatchRunRequest {
                run_id: run_id.into(),
                after_sequence: 0,
                states_only: false,
                heartbeat_interval: None,
            })
            .await
            .unwrap()
            .into_inner();
        let mut events = Vec::new();
        while let Some(item) = stream.next().await {
            if let Some(runstore_pb::watch_run_response::Update::Event(e)) = item.unwrap().update {
                events.push(e);
            }
        }
        events
    }

    async fn receipt(&self, run_id: &str) -> runstore_pb::ReceiptBody {
        self.operator()
            .await
            .get_receipt(runstore_pb::GetReceiptRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .receipt
            .unwrap()
            .body
            .unwrap()
    }
}

fn runner(endpoint: &str, run_id: &str, key: &str) -> tokio::process::Child {
    Command::new(runplane_bin())
        .arg("runner")
        .env("RUNPLANE_ENDPOINT", endpoint)
        .env("RUNPLANE_RUN_ID", run_id)
        .env("RUNPLANE_RUN_KEY", key)
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .kill_on_drop(true)
        .spawn()
        .expect("start runplane runner")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_lines_survive_three_run_store_crashes() {
    let db = TestDatabase::new().await;
    let mut cp = ControlPlane::start(&db).await;
    let (run_id, key) = cp
        .run(
            "two-thousand",
            "i=1; while [ $i -le 2000 ]; do echo \"line $i\"; i=$((i+1)); sleep 0.01; done",
        )
        .await;
    let mut runner = runner(&cp.endpoint, &run_id, &key);

    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        cp.crash_and_restart(Duration::from_millis(1500)).await;
    }
    let status = tokio::time::timeout(Duration::from_secs(240), runner.wait())
        .await
        .expect("the runner finishes")
        .unwrap();
    assert!(status.success(), "runner exit: {status:?}");

    let run = cp.get_run(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Succeeded);
    let body = cp.receipt(&run_id).await;
    assert_eq!(body.event_count, 2000, "every line once, nothing else");
    let events = cp.events(&run_id).await;
    let lines: Vec<String> = events.iter().map(|e| e.text.clone()).collect();
    let expected: Vec<String> = (1..=2000).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, expected, "in order, no duplicates, no gaps");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupt_sent_across_a_restart_is_applied_exactly_once() {
    let db = TestDatabase::new().await;
    let mut cp = ControlPlane::start(&db).await;
    let (run_id, key) = cp
        .run(
            "interrupt-restart",
            "trap 'echo interrupted; exit 130' INT; echo ready; while true; do sleep 0.05; done",
        )
        .await;
    let mut runner = runner(&cp.endpoint, &run_id, &key);
    // Wait for the agent to be up (its first line stored).
    for _ in 0..200 {
        if cp.get_run(&run_id).await.last_sequence >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cp.operator()
        .await
        .interrupt(runstore_pb::InterruptRequest {
            run_id: run_id.clone(),
            reason: "operator stop".into(),
            grace: None,
            idempotency_key: "interrupt-across-restart".into(),
        })
        .await
        .unwrap();
    // Crash right behind the enqueue: the poll answer, or the ack, dies with the process.
    cp.crash_and_restart(Duration::from_millis(1500)).await;

    let status = tokio::time::timeout(Duration::from_secs(120), runner.wait())
        .await
        .expect("the runner finishes")
        .unwrap();
    assert!(status.success(), "runner exit: {status:?}");
    let run = cp.get_run(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(run.verdict.unwrap().reason, "interrupted");
    let events = cp.events(&run_id).await;
    let interrupted = events.iter().filter(|e| e.text == "interrupted").count();
    assert_eq!(
        interrupted, 1,
        "the agent saw the interrupt exactly once: {events:#?}"
    );
    let applied = events
        .iter()
        .filter(|e| e.kind() == runstore_pb::EventKind::SteerApplied && e.name == "interrupt")
        .count();
    assert_eq!(applied, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_the_agent_cannot_take_is_dropped_once_after_three_attempts() {
    let db = TestDatabase::new().await;
    let cp = ControlPlane::start(&db).await;
    // The agent closes its stdin at once, then works for a while.
    let (run_id, key) = cp
        .run("steer-drop", "exec 0<&-; echo ready; sleep 8; echo done")
        .await;
    let mut runner = runner(&cp.endpoint, &run_id, &key);
    for _ in 0..200 {
        if cp.get_run(&run_id).await.last_sequence >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cp.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "nobody reads this".into(),
            idempotency_key: "steer-to-closed-stdin-1".into(),
        })
        .await
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), runner.wait())
        .await
        .expect("the runner finishes")
        .unwrap();
    assert!(status.success());
    let run = cp.get_run(&run_id).await;
    assert_eq!(
        run.state(),
        runstore_pb::RunState::Succeeded,
        "a dropped steer does not fail the run"
    );
    let events = cp.events(&run_id).await;
    let undeliverable: Vec<_> = events
        .iter()
        .filter(|e| e.kind() == runstore_pb::EventKind::SteerUndeliverable)
        .collect();
    assert_eq!(undeliverable.len(), 1, "{events:#?}");
    let data = undeliverable[0].data.clone().unwrap();
    let attempts = match data.fields["attempts"].kind {
        Some(prost_types::value::Kind::NumberValue(n)) => n,
        ref other => panic!("attempts: {other:?}"),
    };
    assert_eq!(attempts, 3.0);
}
