//! The field report's outage end to end, through the binary: two `runplane run`s of org
//! `dev` on `runplane dev` die with "API Error: No response from API"; the third is
//! refused as cooling off, `runplane credentials` shows it, the lead's notice arrives
//! once, and the roster keeps both runs as backend_error. The default credential is
//! shared by every org, so the cool-off is org `dev`'s alone: a run of another org is
//! still admitted. Nothing here is driven by hand: the runner, both outboxes and
//! admission run as they do for a user.

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::{channel, runplane_bin, start_dev_on};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::free_local_addr;
use tokio::process::Command;

const OUTAGE: &str = "echo working; echo 'API Error: No response from API' >&2; exit 1";

fn runplane(data: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(runplane_bin());
    cmd.args(args)
        .arg("--token-file")
        .arg(data.join("operator-token"))
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

async fn output(mut cmd: Command) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("finishes within a minute")
        .expect("runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_dying_on_a_backend_error_cool_the_credential_off_for_the_third() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let _dev = start_dev_on(data.path(), &addr, &[]).await;
    let endpoint = format!("http://{addr}");
    let run = |script: &str| {
        let mut cmd = runplane(
            data.path(),
            &["run", "--endpoint", &endpoint, "--lead", "lead-7"],
        );
        cmd.args(["--", "sh", "-c", script]);
        output(cmd)
    };

    for _ in 0..2 {
        let (code, _, stderr) = run(OUTAGE).await;
        assert_eq!(code, Some(1), "{stderr}");
    }

    // The failures reach credential health through the run store's outbox; the fleet
    // shows the credential cooling off once they did.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    // A cell of the row of credential `local` in the table whose header holds `column`.
    let cell = |table: &str, column: &str| -> String {
        let mut lines = table.lines().skip_while(|l| !l.contains(column));
        let header = lines.next().unwrap_or_default();
        let row = lines.find(|l| l.starts_with("local ")).unwrap_or_default();
        let at = header.find(column).expect("column");
        row.get(at..)
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let table = loop {
        let (code, stdout, stderr) = output(runplane(
            data.path(),
            &["credentials", "--endpoint", &endpoint],
        ))
        .await;
        assert_eq!(code, Some(0), "{stderr}");
        if stdout.contains("OUT FOR ORG") || tokio::time::Instant::now() > deadline {
            break stdout;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Out for org dev, whose runs reported it; not for every org.
    assert_eq!(cell(&table, "OUT FOR ORG"), "dev", "{table}");
    let org_table = table
        .split("\n\n")
        .find(|t| t.contains("OUT FOR ORG"))
        .expect("the table of orgs a credential is out for");
    let cooling = cell(org_table, "COOLING OFF");
    let left: u32 = cooling.trim_end_matches('s').parse().expect("seconds");
    assert!((40..=60).contains(&left), "{table}");
    assert_eq!(cell(&table, "COOLING OFF"), "-", "{table}");
    assert_eq!(cell(&table, "FREE"), "8", "{table}");

    let (code, _, stderr) = run("echo never runs").await;
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("cooling off after repeated backend errors")
            && stderr.contains("for org dev")
            && stderr.contains("s left"),
        "{stderr}"
    );
    // Another org's run on the same credential is admitted and runs.
    let mut other = runplane(
        data.path(),
        &[
            "run",
            "--endpoint",
            &endpoint,
            "--org",
            "beta",
            "--lead",
            "lead-8",
        ],
    );
    other.args(["--", "echo", "beta runs"]);
    let (code, stdout, stderr) = output(other).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("beta runs"), "{stdout}");

    let (code, stdout, stderr) = output(runplane(
        data.path(),
        &[
            "notices",
            "--endpoint",
            &endpoint,
            "--lead",
            "lead-7",
            "--count",
            "1",
        ],
    ))
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("incident_opened"), "{stdout}");
    assert!(
        stdout.contains("credential local cooling off for org dev only"),
        "{stdout}"
    );

    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let request = runplane_testkit::authed(
        runstore_pb::ListRunsRequest {
            lead_id: "lead-7".into(),
            ..Default::default()
        },
        token.trim(),
    );
    let runs = RunServiceClient::new(channel(&endpoint).await)
        .list_runs(request)
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(runs.len(), 2, "the refused run was never created");
    for run in runs {
        assert_eq!(run.state(), runstore_pb::RunState::BackendError, "{run:?}");
        assert_eq!(run.failure_reason, "API Error: No response from API");
    }
}
