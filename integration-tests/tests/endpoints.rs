//! Clients given several endpoints: three replicas of a service, each its own
//! `runplane serve` process on one Postgres; one is SIGKILLed (connects refused) and one
//! SIGSTOPped (the kernel still accepts, nothing answers, and the client already holds
//! a connection to it). Every call still succeeds through the third: first a client
//! built as services build theirs (`runplane_grpc::client::connect_lazy`), then a
//! service-to-service path, the run store asking credential-health replicas for
//! admission.

use std::time::Duration;

use runplane_grpc::client::Bearer;
use runplane_integration_tests::{Process, start_serve};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::TestDatabase;

const TOKEN: &str = "endpoints-operator-token-0123456789abcdef01";
const RECEIPT_KEY: &str = "0404040404040404040404040404040404040404040404040404040404040404";
/// A hang guard, not a measurement: a client trapped by the frozen replica never ends.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// Three replicas of `service`, started one after the other (replicas migrating one
/// database at once collide).
async fn replicas(service: &str, env: &[(&str, &str)]) -> [Process; 3] {
    let a = start_serve(&[service], env).await;
    let b = start_serve(&[service], env).await;
    let c = start_serve(&[service], env).await;
    [a, b, c]
}

fn list(replicas: &[Process]) -> String {
    let endpoints: Vec<String> = replicas.iter().map(Process::endpoint).collect();
    endpoints.join(",")
}

fn create_run(
    request_id: &str,
    target: runstore_pb::create_run_request::Target,
) -> runstore_pb::CreateRunRequest {
    runstore_pb::CreateRunRequest {
        client_request_id: request_id.into(),
        org_id: "acme".into(),
        lead_id: "lead".into(),
        target: Some(target),
        command: "agent".into(),
        ..Default::default()
    }
}

/// Calls `GetRun` through `client` until each of `rounds` calls answered.
async fn get_runs(client: &mut RunStoreClient, run_id: &str, rounds: usize) {
    tokio::time::timeout(HANG_GUARD, async {
        for i in 0..rounds {
            let run = client
                .get_run(runstore_pb::GetRunRequest {
                    run_id: run_id.into(),
                })
                .await
                .unwrap_or_else(|e| panic!("call {i} failed: {e}"))
                .into_inner()
                .run
                .unwrap();
            assert_eq!(run.id, run_id);
        }
    })
    .await
    .expect("the client moved off the killed and the frozen replica");
}

type RunStoreClient = RunServiceClient<
    tonic::service::interceptor::InterceptedService<runplane_grpc::client::TracedChannel, Bearer>,
>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_client_given_three_replicas_rides_out_one_killed_and_one_frozen() {
    let db = TestDatabase::new().await;
    let env = [
        ("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
        ("RUNPLANE_RUN_STORE__DATABASE_URL", db.url()),
        ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", RECEIPT_KEY),
        ("RUNPLANE_RUN_STORE__ADMISSION", "false"),
    ];
    let mut replicas = replicas("run-store", &env).await;
    let channel =
        runplane_grpc::client::connect_lazy(&list(&replicas)).expect("a list of three replicas");
    let mut client = RunServiceClient::with_interceptor(channel, Bearer::new(TOKEN));
    let run_id = client
        .create_run(create_run(
            "endpoints-run-00000001",
            runstore_pb::create_run_request::Target::CredentialId("c".into()),
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
        .id;
    // Round robin: every replica answered once, so the client holds a connection to
    // each, the frozen one's included.
    get_runs(&mut client, &run_id, 3).await;

    replicas[0].kill().await;
    replicas[1].signal("-STOP");
    get_runs(&mut client, &run_id, 6).await;
    replicas[1].signal("-CONT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_store_asks_the_credential_health_replica_that_answers() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        r#"
[[credential_health.profiles]]
name = "default"
credential_id = "local"
capacity = 100
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#,
    )
    .unwrap();
    let config = config.display().to_string();
    let (runs_db, health_db) = (TestDatabase::new().await, TestDatabase::new().await);
    let run_store_addr = runplane_testkit::free_local_addr().to_string();
    let run_store_url = format!("http://{run_store_addr}");
    let health_env = [
        ("RUNPLANE_CONFIG", config.as_str()),
        ("RUNPLANE_SERVER__LISTEN", "127.0.0.1:0"),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
        ("RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL", health_db.url()),
        ("RUNPLANE_RUN_STORE__ENDPOINT", run_store_url.as_str()),
    ];
    let mut health = replicas("credential-health", &health_env).await;
    let health_list = list(&health);
    let run_store = start_serve(
        &["run-store"],
        &[
            ("RUNPLANE_CONFIG", config.as_str()),
            ("RUNPLANE_SERVER__LISTEN", run_store_addr.as_str()),
            ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
            ("RUNPLANE_RUN_STORE__DATABASE_URL", runs_db.url()),
            ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", RECEIPT_KEY),
            ("RUNPLANE_RUN_STORE__ADMISSION", "true"),
            ("RUNPLANE_CREDENTIAL_HEALTH__ENDPOINT", health_list.as_str()),
        ],
    )
    .await;
    let mut client = RunServiceClient::with_interceptor(
        runplane_grpc::client::connect_lazy(&run_store.endpoint()).unwrap(),
        Bearer::new(TOKEN),
    );
    let mut create = async |n: usize| {
        tokio::time::timeout(
            HANG_GUARD,
            client.create_run(create_run(
                &format!("endpoints-admit-{n:08}"),
                runstore_pb::create_run_request::Target::Profile("default".into()),
            )),
        )
        .await
        .expect("the run store moved off the killed and the frozen replica")
        .unwrap_or_else(|e| panic!("run {n} was not admitted: {e}"))
    };
    // Every credential-health replica admits one, so the run store holds a connection
    // to each.
    for n in 0..3 {
        create(n).await;
    }
    health[0].kill().await;
    health[1].signal("-STOP");
    for n in 3..9 {
        create(n).await;
    }
    health[1].signal("-CONT");
}
