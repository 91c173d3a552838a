//! `runplane run` against `runplane dev`: output live, the verdict, and a run that
//! survives a restart of the whole control plane (its sandbox is re-adopted).

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::{channel, runplane_bin, start_dev_on};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_testkit::free_local_addr;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn run_cli(addr: &str, data: &std::path::Path, script: &str) -> tokio::process::Child {
    run_command(addr, data, &["sh", "-c", script])
}

/// `runplane run -- <argv…>` against the dev control plane at `addr`.
fn run_command(addr: &str, data: &std::path::Path, argv: &[&str]) -> tokio::process::Child {
    Command::new(runplane_bin())
        .args([
            "run",
            "--endpoint",
            &format!("http://{addr}"),
            "--token-file",
        ])
        .arg(data.join("operator-token"))
        .arg("--")
        .args(argv)
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start runplane run")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_prints_live_survives_a_dev_restart_and_ends_succeeded() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let mut dev = start_dev_on(data.path(), &addr, &[]).await;

    let mut cli = run_cli(
        &addr,
        data.path(),
        "for i in $(seq 1 50); do echo $i; sleep 0.1; done",
    );
    let mut out = BufReader::new(cli.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    // Lines arrive while the run is going, not at its end.
    while lines.len() < 10 {
        let line = tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .expect("output arrives live")
            .unwrap()
            .expect("more output");
        lines.push(line);
    }

    // Restart the whole control plane under the running agent.
    assert!(dev.terminate().await.success());
    let _dev = start_dev_on(data.path(), &addr, &[]).await;

    // The restarted reconciler re-adopts the sandbox by pid: its ticks see it alive, so
    // no loss is stamped.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let request =
        runplane_testkit::authed(reconciler_pb::ListSandboxesRequest::default(), token.trim());
    let sandboxes = SandboxServiceClient::new(channel(&format!("http://{addr}")).await)
        .list_sandboxes(request)
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(sandboxes.len(), 1);
    assert_eq!(sandboxes[0].status(), reconciler_pb::SandboxStatus::Started);
    assert!(
        sandboxes[0].loss_observed_at.is_none(),
        "re-adopted, not presumed lost"
    );

    while let Some(line) = tokio::time::timeout(Duration::from_secs(60), out.next_line())
        .await
        .expect("the run keeps printing after the restart")
        .unwrap()
    {
        lines.push(line);
    }
    let status = cli.wait().await.unwrap();
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut cli.stderr.take().unwrap(), &mut err)
        .await
        .unwrap();
    assert!(status.success(), "runplane run exit {status:?}: {err}");
    let expected: Vec<String> = (1..=50).map(|i| i.to_string()).collect();
    assert_eq!(lines, expected, "every line once, in order");
    assert!(err.contains("succeeded (exit_zero, exit code 0)"), "{err}");
    assert!(err.contains("receipt: 50 events"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_command_ends_with_its_exit_code() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let mut dev = start_dev_on(data.path(), &addr, &[]).await;
    let mut cli = run_cli(&addr, data.path(), "echo broken >&2; exit 7");
    let stderr = cli.stderr.take().unwrap();
    let cli_err = tokio::spawn(async move {
        let mut text = String::new();
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let status = match tokio::time::timeout(Duration::from_secs(60), cli.wait()).await {
        Ok(status) => status.unwrap(),
        Err(_) => {
            let _ = cli.start_kill();
            dev.kill().await;
            let mut runners = String::new();
            for entry in std::fs::read_dir(data.path().join("sandboxes"))
                .into_iter()
                .flatten()
            {
                let path = entry.unwrap().path().join("runner.log");
                runners += &format!("{}:\n", path.display());
                runners += &std::fs::read_to_string(&path).unwrap_or_default();
            }
            panic!(
                "runplane run did not end within 60 s\n--- run stderr\n{}\n--- dev logs\n{}\n--- runner logs\n{runners}",
                cli_err.await.unwrap(),
                dev.stderr().await
            );
        }
    };
    let err = cli_err.await.unwrap();
    assert_eq!(status.code(), Some(7), "{err}");
    assert!(err.contains("broken"), "{err}");
    assert!(err.contains("failed (exit_nonzero, exit code 7)"), "{err}");
}

/// An agent command that cannot be started at all ends its run at once, failed with the
/// reason, instead of leaving a run Hello made RUNNING to the loss grace (90 s) because
/// its runner is gone. Uncontained, the runner itself spawns the command, and the spawn
/// fails (under bubblewrap the wrapper starts and a missing command exits 127).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_start_ends_its_run_at_once_with_the_reason() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let _dev = start_dev_on(
        data.path(),
        &addr,
        &[("RUNPLANE_SANDBOX_RECONCILER__ISOLATION", "none")],
    )
    .await;
    let cli = run_command(&addr, data.path(), &["/nonexistent/runplane-test-agent"]);
    let out = tokio::time::timeout(Duration::from_secs(30), cli.wait_with_output())
        .await
        .expect("the run did not end within 30 s")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("failed (agent_not_started)"), "{err}");
}

/// An agent that prints past its run's event quota (`run_store.max_events_per_run`, 40
/// here): the run still succeeds, the first 40 lines are stored and print, and one `events_lost` event,
/// stored with the verdict, names the quota and counts every line not stored, so none is
/// lost in silence; the runner stops sending once refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_the_runs_event_quota_is_counted_in_one_marker_and_the_run_succeeds() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let _dev = start_dev_on(
        data.path(),
        &addr,
        &[("RUNPLANE_RUN_STORE__MAX_EVENTS_PER_RUN", "40")],
    )
    .await;
    let cli = run_cli(
        &addr,
        data.path(),
        "for i in $(seq 1 300); do echo $i; done",
    );
    let out = tokio::time::timeout(Duration::from_secs(120), cli.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let printed: Vec<u32> = stdout.lines().map(|l| l.parse().unwrap()).collect();
    // What fits is stored (the refused batch's parts that fit), the start of the output
    // in order.
    assert_eq!(printed.len(), 40, "{stdout}\n{stderr}");
    assert_eq!(printed, (1..=printed.len() as u32).collect::<Vec<_>>());
    let markers: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("[events_lost]"))
        .collect();
    assert_eq!(markers.len(), 1, "{stderr}");
    let expected = format!(
        "{} events were not stored: the run reached its quota run_store.max_events_per_run",
        300 - printed.len()
    );
    assert!(markers[0].contains(&expected), "{stderr}");
}

/// An agent that prints a NUL byte loses no line: the runner writes it as U+FFFD (as it
/// does invalid UTF-8), which every store keeps, and the run store refuses a raw NUL the
/// same on SQLite and PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_in_the_output_is_kept_as_a_replacement_character() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_local_addr().to_string();
    let _dev = start_dev_on(data.path(), &addr, &[]).await;
    let cli = run_cli(
        &addr,
        data.path(),
        r"printf 'before\000after\n'; printf 'err\000\n' >&2; echo next",
    );
    let output = tokio::time::timeout(Duration::from_secs(60), cli.wait_with_output())
        .await
        .expect("runplane run ends")
        .unwrap();
    let (out, err) = (
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    assert_eq!(out, "before\u{FFFD}after\nnext\n", "{err}");
    assert!(err.contains("err\u{FFFD}"), "{err}");
    assert!(err.contains("succeeded (exit_zero, exit code 0)"), "{err}");
    assert!(err.contains("receipt: 3 events"), "{err}");
}
