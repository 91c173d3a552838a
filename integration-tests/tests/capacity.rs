//! A credential's capacity holds: with capacity 2, a third run waits QUEUED (and says
//! why, in the run and in the fleet view) and starts when one of the two ends. Driven
//! through `runplane dev` with its dispatch on, agents that write their pids.

use std::path::Path;
use std::time::Duration;

use runplane_integration_tests::{channel, process_alive, start_dev_with_env, wait_for};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;

fn agent(pid_file: &Path) -> Vec<String> {
    vec![
        "-c".into(),
        format!("echo $$ > {}; exec sleep 300", pid_file.display()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_capacity_two_a_third_run_waits_queued_and_starts_when_a_slot_frees() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        r#"
[[credential_health.profiles]]
name = "small"
credential_id = "local"
capacity = 2
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#,
    )
    .unwrap();
    let dev = start_dev_with_env(
        &dir.path().join("data"),
        &[
            ("RUNPLANE_CONFIG", config.to_str().unwrap()),
            // The agents write their pids to the test's files, as the host numbers them:
            // uncontained, or the pid namespace and private /tmp would hide both.
            ("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none"),
        ],
    )
    .await;
    let token = std::fs::read_to_string(dir.path().join("data/operator-token"))
        .unwrap()
        .trim()
        .to_owned();
    let mut op = RunServiceClient::new(channel(&dev.endpoint()).await);
    let mut fleet = CredentialHealthServiceClient::new(channel(&dev.endpoint()).await);

    let mut runs = Vec::new();
    for i in 0..3 {
        let pid_file = dir.path().join(format!("agent-{i}.pid"));
        let run = op
            .create_run(authed(
                runstore_pb::CreateRunRequest {
                    client_request_id: format!("capacity-run-{i:0>8}"),
                    org_id: "acme".into(),
                    lead_id: "lead-1".into(),
                    target: Some(runstore_pb::create_run_request::Target::Profile(
                        "small".into(),
                    )),
                    command: "sh".into(),
                    args: agent(&pid_file),
                    ..Default::default()
                },
                &token,
            ))
            .await
            .expect("admitted: a full fleet is not an outage")
            .into_inner()
            .run
            .unwrap();
        runs.push((run.id, pid_file));
        // Oldest first: each run is created after the one before it is on its way.
        if i < 2 {
            let pid_file = runs[i].1.clone();
            wait_for("the agent starts", Duration::from_secs(30), async || {
                pid_file.exists()
            })
            .await;
        }
    }
    let get = async |op: &mut RunServiceClient<tonic::transport::Channel>, id: &str| {
        op.get_run(authed(
            runstore_pb::GetRunRequest { run_id: id.into() },
            &token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap()
    };
    let third = runs[2].0.clone();
    wait_for(
        "the third run says why it waits",
        Duration::from_secs(30),
        async || {
            get(&mut op, &third).await.waiting_reason
                == "credential local is full: 2 of 2 slots busy"
        },
    )
    .await;
    let waiting = get(&mut op, &third).await;
    assert_eq!(waiting.state(), runstore_pb::RunState::Queued);
    assert!(!runs[2].1.exists(), "the third agent did not start");

    let view = fleet
        .get_fleet(authed(credentials_pb::GetFleetRequest::default(), &token))
        .await
        .unwrap()
        .into_inner();
    let local = view
        .credentials
        .iter()
        .find(|c| c.credential_id == "local")
        .unwrap();
    assert_eq!(
        (local.capacity, local.busy, local.free, local.queued),
        (2, 2, 0, 1),
        "{local:?}"
    );

    // What an operator sees: the run waiting and why, and the fleet's queue.
    let cli = async |args: &[&str]| {
        let out = tokio::process::Command::new(runplane_integration_tests::runplane_bin())
            .args(args)
            .args(["--endpoint", &dev.endpoint()])
            .env_remove("RUNPLANE_CONFIG")
            .env("RUNPLANE_TOKEN", &token)
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let queued = cli(&["runs", "--state", "queued", "--org", "acme"]).await;
    assert!(
        queued.contains(&third) && queued.contains("credential local is full: 2 of 2 slots busy"),
        "{queued}"
    );
    let table = cli(&["credentials"]).await;
    let header = table.lines().next().unwrap();
    let row = table.lines().find(|l| l.starts_with("local ")).unwrap();
    let column = header.find("QUEUED").expect("a QUEUED column");
    assert_eq!(&row[column..column + 1], "1", "{table}");

    // One of the two ends: the waiting run gets its slot.
    op.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: runs[0].0.clone(),
            reason: "make room".into(),
            idempotency_key: "capacity-cancel-first".into(),
        },
        &token,
    ))
    .await
    .unwrap();
    let third_pid = runs[2].1.clone();
    wait_for(
        "the third agent starts",
        Duration::from_secs(30),
        async || third_pid.exists(),
    )
    .await;
    wait_for("the third run runs", Duration::from_secs(30), async || {
        get(&mut op, &third).await.state() == runstore_pb::RunState::Running
    })
    .await;
    assert_eq!(get(&mut op, &third).await.waiting_reason, "");
    assert_eq!(
        get(&mut op, &runs[1].0).await.state(),
        runstore_pb::RunState::Running
    );
    // The two still running end, and leave nothing behind (their sandboxes would
    // otherwise outlive this test's runplane dev, as sandboxes are meant to).
    for (i, (run_id, pid_file)) in runs.iter().enumerate().skip(1) {
        op.cancel_run(authed(
            runstore_pb::CancelRunRequest {
                run_id: run_id.clone(),
                reason: "test over".into(),
                idempotency_key: format!("capacity-cancel-{i:0>8}"),
            },
            &token,
        ))
        .await
        .unwrap();
        let pid: i32 = std::fs::read_to_string(pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        wait_for("the agent is gone", Duration::from_secs(15), async || {
            !process_alive(pid)
        })
        .await;
    }
}
