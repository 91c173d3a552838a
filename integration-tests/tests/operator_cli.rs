//! The operator commands against `runplane dev`, through the real binary: `runs`, `get`,
//! `logs`, `steer`, `interrupt`, `cancel`, `receipt get | receipt verify` and
//! `run --max-duration`. Each test has its own data directory and port.

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

use runplane_integration_tests::{Process, channel, runplane_bin, start_dev, start_dev_on};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::free_local_addr;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

/// `runplane dev` in its own directory, and the CLI pointed at it.
struct Dev {
    process: Process,
    data: tempfile::TempDir,
}

impl Dev {
    async fn start() -> Self {
        let data = tempfile::tempdir().unwrap();
        let process = start_dev(data.path()).await;
        Self { process, data }
    }

    /// On a fixed address, so a restart keeps the CLI's endpoint.
    async fn start_restartable() -> Self {
        let data = tempfile::tempdir().unwrap();
        let addr = free_local_addr().to_string();
        let process = start_dev_on(data.path(), &addr, &[]).await;
        Self { process, data }
    }

    async fn restart(&mut self) {
        self.restart_with(&[]).await;
    }

    async fn restart_with(&mut self, env: &[(&str, &str)]) {
        assert!(self.process.terminate().await.success());
        let addr = self.process.address.clone();
        self.process = start_dev_on(self.data.path(), &addr, env).await;
    }

    fn token_file(&self) -> PathBuf {
        self.data.path().join("operator-token")
    }

    /// `runplane <args> --endpoint … --token-file …`, the flags `runplane run` takes too.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(runplane_bin());
        command
            .args(args)
            .arg("--endpoint")
            .arg(self.process.endpoint())
            .arg("--token-file")
            .arg(self.token_file())
            .current_dir(self.data.path())
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("RUNPLANE_TOKEN")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn cli(&self, args: &[&str]) -> Output {
        let output = self.command(args).output();
        tokio::time::timeout(Duration::from_secs(60), output)
            .await
            .unwrap_or_else(|_| panic!("runplane {args:?} ended within 60 s"))
            .unwrap()
    }

    /// `runplane run -- CMD...` in the background, its run id read from its stderr.
    async fn start_run(&self, flags: &[&str], command: &[&str]) -> (Child, String, RunOutput) {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        let mut command_line = self.command(&args);
        command_line
            .arg("--")
            .args(command)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command_line.spawn().expect("start runplane run");
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = String::new();
        let id = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = stderr.next_line().await.unwrap() {
                seen.push_str(&line);
                seen.push('\n');
                if let Some(rest) = line.strip_prefix("runplane: run ")
                    && let Some(id) = rest.strip_suffix(" created")
                {
                    return id.to_owned();
                }
            }
            panic!("runplane run ended before creating a run:\n{seen}")
        })
        .await
        .expect("the run is created within 30 s");
        let stdout = child.stdout.take().unwrap();
        let output = RunOutput {
            stdout: tokio::spawn(read_all(stdout)),
            stderr: tokio::spawn(async move {
                let mut rest = String::new();
                stderr.into_inner().read_to_string(&mut rest).await.unwrap();
                seen + &rest
            }),
        };
        (child, id, output)
    }

    /// The run as `get --json` prints it.
    async fn get_json(&self, id: &str) -> serde_json::Value {
        let out = self.cli(&["get", id, "--json"]).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("get --json prints JSON")
    }

    /// Polls `get --json` until the run reaches `state` (a RunState name).
    async fn wait_for_state(&self, id: &str, state: &str) -> serde_json::Value {
        self.wait_until(id, state, |run| run["state"] == state)
            .await
    }

    /// Polls `get --json` until `done` holds of the run (`what` names it for the panic).
    async fn wait_until(
        &self,
        id: &str,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let wait = async {
            loop {
                let run = self.get_json(id).await;
                if done(&run) {
                    return run;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .unwrap_or_else(|_| panic!("run {id}: {what} within 60 s"))
    }
}

struct RunOutput {
    stdout: tokio::task::JoinHandle<String>,
    stderr: tokio::task::JoinHandle<String>,
}

async fn read_all(mut from: impl tokio::io::AsyncRead + Unpin) -> String {
    let mut text = String::new();
    from.read_to_string(&mut text).await.unwrap();
    text
}

/// Waits for a background `runplane run`: its exit code, stdout and stderr.
async fn finish(mut child: Child, output: RunOutput) -> (Option<i32>, String, String) {
    let status = tokio::time::timeout(Duration::from_secs(90), child.wait())
        .await
        .expect("runplane run ends within 90 s")
        .unwrap();
    (
        status.code(),
        output.stdout.await.unwrap(),
        output.stderr.await.unwrap(),
    )
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_lists_a_run_with_its_columns_and_get_shows_it() {
    let dev = Dev::start().await;
    let (child, id, output) = dev.start_run(&["--lead", "alice"], &["echo", "hi"]).await;
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");

    let out = dev.cli(&["runs"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "ID",
            "STATE",
            "LEAD",
            "CREDENTIAL",
            "AGE",
            "ATTEMPT",
            "REASON"
        ],
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{id} not listed:\n{table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1..4], ["succeeded", "alice", "local"], "{row}");
    assert!(cells[4].ends_with('s') || cells[4].ends_with('m'), "{row}");
    assert_eq!(cells[5..], ["1", "exit_zero"], "{row}");

    let out = dev.cli(&["runs", "--json", "--lead", "alice"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let runs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["id"], id.as_str());
    assert_eq!(runs[0]["state"], "RUN_STATE_SUCCEEDED");
    assert_eq!(runs[0]["credentialId"], "local");

    // Filters reach the server: no running run, and no run of another lead.
    for filter in [
        &["--state", "running"][..],
        &["--lead", "bob"],
        &["--state", "queued,failed"],
    ] {
        let mut args = vec!["runs", "--json"];
        args.extend_from_slice(filter);
        let out = dev.cli(&args).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout).trim(), "[]", "{filter:?}");
    }
    let out = dev
        .cli(&["runs", "--state", "BACKEND_ERROR", "--limit", "1"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 1, "only the header");

    let out = dev.cli(&["get", &id]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    for (key, value) in [
        ("id", id.as_str()),
        ("lead", "alice"),
        ("state", "succeeded"),
        ("verdict", "succeeded (exit_zero, exit code 0)"),
        ("credential", "local"),
        ("command", "echo hi"),
        ("sandbox_generation", "1"),
    ] {
        assert!(
            shown.lines().any(|l| l
                .split_once("  ")
                .is_some_and(|(k, v)| k.trim() == key && v.trim().starts_with(value))),
            "no {key}: {value} in\n{shown}"
        );
    }
    for key in [
        "sandbox_id",
        "last_sequence",
        "created",
        "started",
        "ended",
        "deadline",
        "labels",
    ] {
        assert!(
            shown.lines().any(|l| l.starts_with(key)),
            "no {key} in\n{shown}"
        );
    }
    let run = dev.get_json(&id).await;
    assert_eq!(run["verdict"]["reason"], "exit_zero");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_on_an_unknown_run_exits_1_naming_not_found() {
    let dev = Dev::start().await;
    let unknown = "0190a0b0-0000-7000-8000-000000000000";
    let out = dev.cli(&["get", unknown]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(stderr.starts_with("error: NOT_FOUND: "), "{stderr}");
    assert!(stderr.contains("(RUN_NOT_FOUND)"), "{stderr}");
    assert!(out.stdout.is_empty());

    // logs refuses at once instead of waiting for a run that does not exist.
    let out = dev.cli(&["logs", unknown, "--follow"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("NOT_FOUND"), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_prints_a_finished_run_once_and_follows_a_running_one_to_its_end() {
    let dev = Dev::start().await;
    let script = "for i in 1 2 3; do echo out $i; echo err $i >&2; done";
    let (child, done, output) = dev.start_run(&[], &["sh", "-c", script]).await;
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");

    let out = dev.cli(&["logs", &done]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "out 1\nout 2\nout 3\n");
    let stderr = text(&out.stderr);
    for i in 1..=3 {
        assert_eq!(stderr.matches(&format!("err {i}\n")).count(), 1, "{stderr}");
    }
    assert!(
        stderr.contains("succeeded (exit_zero, exit code 0)"),
        "{stderr}"
    );

    // --after skips what was already seen: nothing after the last sequence.
    let last = dev.get_json(&done).await["lastSequence"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = dev.cli(&["logs", &done, "--after", &last]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");

    let script = "echo first; sleep 2; for i in 2 3 4 5; do echo line $i; sleep 0.3; done";
    let (child, running, output) = dev.start_run(&[], &["sh", "-c", script]).await;
    dev.wait_for_state(&running, "RUN_STATE_RUNNING").await;
    let follow = dev
        .command(&["logs", &running, "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), follow.wait_with_output())
        .await
        .expect("logs --follow ends with the run")
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "first\nline 2\nline 3\nline 4\nline 5\n",
        "{}",
        text(&out.stderr)
    );
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");
    let run = dev.get_json(&running).await;
    assert_eq!(
        run["state"], "RUN_STATE_SUCCEEDED",
        "logs --follow returned only at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_resumes_across_a_control_plane_restart() {
    let mut dev = Dev::start_restartable().await;
    let script = "for i in $(seq 1 40); do echo $i; sleep 0.1; done";
    let (child, id, output) = dev.start_run(&[], &["sh", "-c", script]).await;
    let mut follow = dev
        .command(&["logs", &id, "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(follow.stdout.take().unwrap()).lines();
    let mut lines = Vec::new();
    while lines.len() < 5 {
        let line = tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .expect("lines arrive live")
            .unwrap()
            .expect("more lines");
        lines.push(line);
    }
    dev.restart().await;
    while let Some(line) = tokio::time::timeout(Duration::from_secs(60), out.next_line())
        .await
        .expect("logs --follow keeps printing after the restart")
        .unwrap()
    {
        lines.push(line);
    }
    let status = follow.wait().await.unwrap();
    let stderr = read_all(follow.stderr.take().unwrap()).await;
    assert!(status.success(), "{stderr}");
    let expected: Vec<String> = (1..=40).map(|i| i.to_string()).collect();
    assert_eq!(lines, expected, "every line once, in order: {stderr}");
    assert!(
        stderr.contains("succeeded (exit_zero, exit code 0)"),
        "{stderr}"
    );
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steer_reaches_the_agent() {
    let dev = Dev::start().await;
    let (child, id, output) = dev
        .start_run(&[], &["sh", "-c", "read l; echo got $l"])
        .await;
    dev.wait_for_state(&id, "RUN_STATE_RUNNING").await;
    let out = dev.cli(&["steer", &id, "hello there"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("steer msg_"), "{out:?}");
    let (code, stdout, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout, "got hello there\n", "{stderr}");

    // Steering an ended run is the server's refusal, exit 1.
    let out = dev.cli(&["steer", &id, "too late"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).starts_with("error: FAILED_PRECONDITION: "),
        "{}",
        text(&out.stderr)
    );
}

/// An agent blocked reading its stdin waits for input: `get`, `runs` and `runplane run`
/// say so, and a steer that sets it working clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waiting_for_input_says_so_until_a_steer_sets_its_agent_working() {
    let dev = Dev::start().await;
    let (child, id, output) = dev
        .start_run(&[], &["sh", "-c", "read l; echo got $l; sleep 300"])
        .await;
    let run = dev
        .wait_until(&id, "waiting for input", |run| {
            run["waitingForInputSince"].is_string()
        })
        .await;
    assert_eq!(run["state"], "RUN_STATE_RUNNING");
    let out = dev.cli(&["get", &id]).await;
    assert!(
        text(&out.stdout)
            .lines()
            .any(|l| l == "state               running (waiting_for_input)"),
        "{}",
        text(&out.stdout)
    );
    let out = dev.cli(&["runs"]).await;
    let row = text(&out.stdout)
        .lines()
        .find(|l| l.starts_with(&id))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(row.contains("running (waiting_for_input)"), "{row}");

    let out = dev.cli(&["steer", &id, "hello"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    dev.wait_until(&id, "working again", |run| {
        run["state"] == "RUN_STATE_RUNNING" && run["waitingForInputSince"].is_null()
    })
    .await;
    let out = dev.cli(&["cancel", &id, "--reason", "done"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (_, stdout, stderr) = finish(child, output).await;
    assert_eq!(stdout, "got hello\n", "{stderr}");
    let waiting = stderr.find("runplane: waiting for input");
    let working = stderr.find("runplane: working");
    assert!(
        waiting.is_some() && working > waiting,
        "runplane run says when the agent waits and when it works again: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_stops_the_agent_and_the_run_ends_cancelled() {
    let dev = Dev::start().await;
    let (child, id, output) = dev.start_run(&[], &["sleep", "300"]).await;
    dev.wait_for_state(&id, "RUN_STATE_RUNNING").await;
    let out = dev
        .cli(&["interrupt", &id, "--reason", "enough", "--grace", "1s"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("interrupt msg_"), "{out:?}");
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(130), "{stderr}");
    let run = dev.get_json(&id).await;
    assert_eq!(run["state"], "RUN_STATE_CANCELLED");
    assert_eq!(run["verdict"]["reason"], "interrupted");
    assert_eq!(
        run["verdict"]["message"], "enough",
        "the operator's reason is recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_running_run_cancelled() {
    let dev = Dev::start().await;
    let (child, id, output) = dev
        .start_run(&[], &["sh", "-c", "echo started; sleep 300"])
        .await;
    let wait = async {
        loop {
            let run = dev.get_json(&id).await;
            if run["state"] == "RUN_STATE_RUNNING" && run["lastSequence"].is_string() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .unwrap();
    // Without --follow, logs prints what is stored and exits while the run goes on.
    let out = dev.cli(&["logs", &id]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));

    let out = dev.cli(&["cancel", &id, "--reason", "not needed"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(&format!("run {id}: cancelled (cancelled: not needed)")),
        "{out:?}"
    );
    let run = dev.wait_for_state(&id, "RUN_STATE_CANCELLED").await;
    assert_eq!(run["verdict"]["reason"], "cancelled");
    assert_eq!(run["verdict"]["message"], "not needed");
    let (code, stdout, stderr) = finish(child, output).await;
    assert_eq!(code, Some(130), "{stderr}");
    assert_eq!(stdout, "started\n");

    // A second cancel is a new request (a fresh key), refused on an ended run.
    let out = dev.cli(&["cancel", &id]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("error: FAILED_PRECONDITION: "),
        "{stderr}"
    );
    assert!(stderr.contains("(RUN_TERMINAL)"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_get_piped_into_receipt_verify_passes() {
    let dev = Dev::start().await;
    let (child, id, output) = dev.start_run(&[], &["echo", "sealed"]).await;
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");

    // The token and endpoint rules of `runplane run`: RUNPLANE_TOKEN and the config's
    // endpoint (here from the environment) instead of flags.
    let token = std::fs::read_to_string(dev.token_file()).unwrap();
    let file = dev.data.path().join("receipt.json");
    let shell = format!(
        "{bin} receipt get {id} > {file} && {bin} receipt verify {file} --public-key \"$KEY\"",
        bin = runplane_bin().display(),
        file = file.display(),
    );
    let key = public_key(
        &dev.process.endpoint(),
        token.trim(),
        &receipt_key_id(&dev, &id).await,
    )
    .await;
    let out = Command::new("sh")
        .args(["-c", &shell])
        .env("KEY", &key)
        .env("RUNPLANE_TOKEN", token.trim())
        .env("RUNPLANE_RUN_STORE__ENDPOINT", dev.process.endpoint())
        .env_remove("RUNPLANE_CONFIG")
        .current_dir(dev.data.path())
        .output()
        .await
        .unwrap();
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("receipt verified: signed by ed25519:"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("run      {id} (org dev)")),
        "{stdout}"
    );
    assert!(
        stdout.contains("verdict  succeeded (exit_zero, exit code 0)"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("public key {key}")),
        "the hint names the key: {stderr}"
    );

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(
        json["receipt"]["body"]["runId"],
        id.as_str(),
        "grpcurl's JSON"
    );

    // A receipt that is not the signed one fails.
    let mut forged = json.clone();
    forged["receipt"]["signature"] = serde_json::json!("AAAA");
    std::fs::write(&file, forged.to_string()).unwrap();
    let out = Command::new(runplane_bin())
        .args([
            "receipt",
            "verify",
            file.to_str().unwrap(),
            "--public-key",
            &key,
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

/// `runplane receipt keygen`'s signing key and public key, as an operator copies them.
async fn keygen() -> (String, String) {
    let out = Command::new(runplane_bin())
        .args(["receipt", "keygen"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    let field = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("keygen prints {prefix}: {stdout}"))
            .trim()
            .trim_matches('"')
            .to_owned()
    };
    (field("receipt_signing_key = "), field("# public key:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_verifies_after_its_signing_key_is_rotated() {
    let (old_key, old_public) = keygen().await;
    let (new_key, _) = keygen().await;
    let mut dev = Dev::start_restartable().await;
    dev.restart_with(&[("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", &old_key)])
        .await;
    let (child, id, output) = dev.start_run(&[], &["echo", "sealed"]).await;
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(0), "{stderr}");
    let old_id = receipt_key_id(&dev, &id).await;
    let file = dev.data.path().join("receipt.json");
    let out = dev.cli(&["receipt", "get", &id]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::write(&file, &out.stdout).unwrap();
    let file = file.to_str().unwrap();

    // Rotated: the new signing key, the old one's public half retired.
    let retired = format!("[\"{old_public}\"]");
    dev.restart_with(&[
        ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", &new_key),
        ("RUNPLANE_RUN_STORE__RETIRED_RECEIPT_PUBLIC_KEYS", &retired),
    ])
    .await;
    let out = dev.cli(&["receipt", "verify", file]).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!("receipt verified: signed by {old_id}")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("run      {id} (org dev)")),
        "{stdout}"
    );
    // New runs are signed with the new key.
    let (child, new_run, output) = dev.start_run(&[], &["true"]).await;
    assert_eq!(finish(child, output).await.0, Some(0));
    assert_ne!(receipt_key_id(&dev, &new_run).await, old_id);

    // Without the retired key the server cannot vouch for the old receipt.
    dev.restart_with(&[("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", &new_key)])
        .await;
    let out = dev.cli(&["receipt", "verify", file]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains("RECEIPT_KEY_UNKNOWN"),
        "{}",
        text(&out.stderr)
    );
    // Offline, with the key the operator kept, it still verifies.
    let out = dev
        .cli(&["receipt", "verify", file, "--public-key", &old_public])
        .await;
    assert!(out.status.success(), "{out:?}");

    // A retired key that is not a public key stops the run store at start, naming it.
    assert!(dev.process.terminate().await.success());
    let bad = Command::new(runplane_bin())
        .args(["dev", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dev.data.path())
        .env(
            "RUNPLANE_RUN_STORE__RETIRED_RECEIPT_PUBLIC_KEYS",
            "[\"not-a-key\"]",
        )
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("run_store.retired_receipt_public_keys[0]"),
        "{}",
        text(&bad.stderr)
    );
}

async fn receipt_key_id(dev: &Dev, id: &str) -> String {
    let out = dev.cli(&["receipt", "get", id]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["receipt"]["keyId"].as_str().unwrap().to_owned()
}

/// GetReceiptPublicKey's key, as hex, asked without the CLI.
async fn public_key(endpoint: &str, token: &str, key_id: &str) -> String {
    let request = runplane_testkit::authed(
        runstore_pb::GetReceiptPublicKeyRequest {
            key_id: key_id.to_owned(),
        },
        token,
    );
    let key = RunServiceClient::new(channel(endpoint).await)
        .get_receipt_public_key(request)
        .await
        .unwrap()
        .into_inner()
        .public_key;
    key.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_max_duration_fails_deadline_exceeded() {
    let dev = Dev::start().await;
    let (child, id, output) = dev
        .start_run(&["--max-duration", "2s"], &["sleep", "60"])
        .await;
    let (code, _, stderr) = finish(child, output).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("failed (deadline_exceeded): the run outlived its 2 s deadline"),
        "the verdict's message is printed, not only its reason: {stderr}"
    );
    let run = dev.get_json(&id).await;
    assert_eq!(run["state"], "RUN_STATE_FAILED");
    assert_eq!(run["verdict"]["reason"], "deadline_exceeded");
    assert!(run["deadline"].is_string(), "{run}");
}
