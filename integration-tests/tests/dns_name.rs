//! A client given one DNS name with several addresses, as a headless
//! Kubernetes Service gives one: three run-store replicas, each its own `runplane serve`
//! on one Postgres, listening on 127.0.0.2, .3 and .4 at one port, and a name,
//! `replicas.test`, that resolves to all three. The name lives in a private `/etc/hosts`
//! that bubblewrap binds over the real one for the client's process alone (the machine's
//! resolver is not touched). The CLI reaches the run through the name while all three
//! answer, then with one replica SIGKILLed and one SIGSTOPped, whichever address it
//! starts at.

use std::time::Duration;

use runplane_integration_tests::start_serve;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_testkit::TestDatabase;

const TOKEN: &str = "dns-name-operator-token-0123456789abcdef01";
const RECEIPT_KEY: &str = "0505050505050505050505050505050505050505050505050505050505050505";
const NAME: &str = "replicas.test";
/// A hang guard per command, not a measurement: a CLI trapped on the frozen replica
/// would wait for its whole retry window.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// `runplane get RUN --endpoint http://replicas.test:PORT`, with `hosts` bound over
/// `/etc/hosts` for this process only; its stdout.
async fn get_through_the_name(hosts: &std::path::Path, port: u16, run_id: &str) -> String {
    let endpoint = format!("http://{NAME}:{port}");
    let out = tokio::time::timeout(
        HANG_GUARD,
        tokio::process::Command::new("bwrap")
            .args(["--dev-bind", "/", "/", "--ro-bind"])
            .arg(hosts)
            .args(["/etc/hosts", "--"])
            .arg(runplane_integration_tests::runplane_bin())
            .args(["get", run_id, "--endpoint", &endpoint])
            .env("RUNPLANE_TOKEN", TOKEN)
            .env_remove("RUNPLANE_CONFIG")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the CLI moved off the killed and the frozen replica")
    .expect("run bwrap (the test command installs bubblewrap)");
    assert!(
        out.status.success(),
        "runplane get through {endpoint} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_with_several_addresses_is_every_replica_and_the_cli_moves_off_failed_ones() {
    let db = TestDatabase::new().await;
    let port = runplane_testkit::free_local_addr().port();
    let mut replicas = Vec::new();
    // One after the other: replicas migrating one database at once wait for each other.
    for host in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        let listen = format!("{host}:{port}");
        replicas.push(
            start_serve(
                &["run-store"],
                &[
                    ("RUNPLANE_SERVER__LISTEN", listen.as_str()),
                    ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
                    ("RUNPLANE_RUN_STORE__DATABASE_URL", db.url()),
                    ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", RECEIPT_KEY),
                    ("RUNPLANE_RUN_STORE__ADMISSION", "false"),
                ],
            )
            .await,
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n127.0.0.4 {NAME}\n"),
    )
    .unwrap();

    let run = runstore_pb::run_service_client::RunServiceClient::new(
        runplane_integration_tests::channel(&replicas[2].endpoint()).await,
    )
    .create_run(runplane_testkit::authed(
        runstore_pb::CreateRunRequest {
            client_request_id: "dns-name-run-000000001".into(),
            org_id: "acme".into(),
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

    for _ in 0..3 {
        let shown = get_through_the_name(&hosts, port, &run.id).await;
        assert!(shown.contains(&run.id), "{shown}");
    }
    replicas[0].kill().await;
    replicas[1].signal("-STOP");
    // Each command starts at a random address of the three: most of these start at a
    // dead or a frozen one, and every one still answers, from the third.
    for _ in 0..6 {
        let shown = get_through_the_name(&hosts, port, &run.id).await;
        assert!(shown.contains(&run.id), "{shown}");
    }
    replicas[1].signal("-CONT");
}
