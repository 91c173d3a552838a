//! An agent is untrusted code. An adversarial agent, run through `runplane run` next to
//! another run, looks for the control plane's secrets in `/proc` and on the filesystem,
//! signals the other sandbox's processes and writes outside its workspace: on
//! `runplane dev`, and on the split topology where a node agent runs the sandboxes. Each
//! attempt must fail, and its output must hold no token, no run key, no other sandbox's
//! pid. The secrets it must not find are fetched first, to compare against.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::sandboxes::{
    ReapSession, eventually, process_state, run_key_in_memory, session_members, start_node,
};
use runplane_integration_tests::split::{Split, TOKEN as SPLIT_TOKEN};
use runplane_integration_tests::{channel, runplane_bin, start_dev};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tokio::io::{AsyncBufReadExt, BufReader};

/// What the agent tries, in order, once the test steers it on (a line on its stdin).
/// `$1`: the control plane's data directory; `$2`: the other sandbox's directory; `$3`: a
/// name to create in /tmp; the rest: the other sandbox's pids (as the host numbers them).
const ADVERSARY: &str = r#"
read go
data="$1"; victim="$2"; marker="$3"; shift 3
echo "uid: $(id -u)"
grep NoNewPrivs /proc/self/status
echo "pids: $(ls /proc | grep -E '^[0-9]+$' | tr '\n' ' ')"
for f in /proc/[0-9]*/environ; do
  tr '\0' '\n' < "$f" 2>/dev/null | grep -E '^[A-Z_]*(RUN_KEY|TOKEN|SIGNING_KEY)=' \
    | sed "s|^|environ $f: |"
done
for f in /proc/[0-9]*/cmdline; do
  tr '\0' ' ' < "$f" 2>/dev/null | grep -E '^[^ ]*runplane (runner|dev|serve|node)' \
    | sed "s|^|cmdline $f: |"
done
timeout 120 find / \( -path /proc -o -path /sys \) -prune -o \( -name operator-token \
  -o -name receipt-signing-key -o -name '*.sqlite' -o -name .runplane -o -name sandboxes \
  -o -name "$(basename "$victim")" \) -print 2>/dev/null | sed 's/^/found: /'
for f in "$data/operator-token" "$data/receipt-signing-key" "$data/run-store.sqlite" \
  "$victim/runner.log"; do
  head -c 200 "$f" 2>/dev/null && echo "read: $f"
done
for pid in "$@"; do kill -KILL "$pid" 2>/dev/null && echo "killed: $pid"; done
for f in "$data/$marker" "$victim/$marker" "$victim/workspace/$marker" "/usr/$marker" \
  "/etc/$marker" "/tmp/$marker"; do
  (echo pwned > "$f") 2>/dev/null && echo "wrote: $f"
done
(echo mine > /workspace/mine) 2>/dev/null && echo "own workspace: writable"
echo "adversary done"
"#;

/// Where the adversary runs and what it must not find.
struct Target {
    /// The run store, for `runplane run`.
    endpoint: String,
    token: String,
    /// The state directory of the process driver that runs the sandboxes.
    sandboxes: PathBuf,
    /// The control plane's data directory (the dev data dir; for the split topology, the
    /// directory holding the reconciler's and the node's state).
    data: PathBuf,
    /// Secrets of the control plane itself (the operator token, the signing key).
    secrets: Vec<String>,
}

/// The sandbox directory that is not `except`, once one exists.
async fn sandbox_dir(sandboxes: &Path, except: Option<&Path>) -> PathBuf {
    eventually(Duration::from_secs(60), "a sandbox directory", || async {
        std::fs::read_dir(sandboxes)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| Some(p.as_path()) != except && p.join("pid").exists())
    })
    .await
}

/// The session leader's pid of the sandbox in `dir`, once its runner runs, and that
/// runner's run key (read from its memory, as root on the host could: a runner's key is
/// in no environment, which is checked here too).
async fn runner_of(dir: &Path) -> (u32, String) {
    eventually(Duration::from_secs(60), "the sandbox's runner", || async {
        let sid: u32 = std::fs::read_to_string(dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let members = session_members(sid);
        for pid in &members {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            assert!(
                !String::from_utf8_lossy(&env).contains("RUNPLANE_RUN_KEY="),
                "a run key in the environment of {pid} ({})",
                comm(*pid)
            );
        }
        let key = members
            .into_iter()
            .filter(|pid| comm(*pid) == "runplane")
            .find_map(run_key_in_memory)?;
        Some((sid, key))
    })
    .await
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

async fn adversary_finds_nothing(target: Target) {
    let mut runs = RunServiceClient::new(channel(&target.endpoint).await);

    // The other sandbox: an agent that sleeps.
    let victim_run = runs
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: format!("victim-run-{:0>16}", std::process::id()),
                org_id: "acme".into(),
                lead_id: "lead-1".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "sh".into(),
                args: vec!["-c".into(), "exec sleep 300".into()],
                ..Default::default()
            },
            &target.token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let victim_dir = sandbox_dir(&target.sandboxes, None).await;
    let (victim_sid, victim_key) = runner_of(&victim_dir).await;
    let _reap_victim = ReapSession(victim_sid);
    let victim_pids = eventually(Duration::from_secs(30), "the other agent", || async {
        let members = session_members(victim_sid);
        members
            .iter()
            .any(|pid| comm(*pid) == "sleep")
            .then_some(members)
    })
    .await;

    // The adversary, through the CLI.
    let marker = format!("adversary-{}", std::process::id());
    let mut cli = tokio::process::Command::new(runplane_bin())
        .args(["run", "--endpoint", &target.endpoint, "--", "sh", "-c"])
        .arg(ADVERSARY)
        .arg("adversary")
        .arg(&target.data)
        .arg(&victim_dir)
        .arg(&marker)
        .args(victim_pids.iter().map(u32::to_string))
        .env("RUNPLANE_TOKEN", &target.token)
        .env_remove("RUNPLANE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(cli.stderr.take().unwrap()).lines();
    let run_id = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = stderr.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix("runplane: run ") {
                return rest.split_whitespace().next().map(str::to_owned);
            }
        }
        None
    })
    .await
    .expect("runplane run created its run")
    .expect("a run id");
    let adversary_dir = sandbox_dir(&target.sandboxes, Some(&victim_dir)).await;
    let (adversary_sid, adversary_key) = runner_of(&adversary_dir).await;
    let _reap_adversary = ReapSession(adversary_sid);
    runs.steer(authed(
        runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "go".into(),
            idempotency_key: format!("adversary-go-{}", std::process::id()),
        },
        &target.token,
    ))
    .await
    .unwrap();
    let stderr_rest = tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(line)) = stderr.next_line().await {
            rest.push_str(&line);
            rest.push('\n');
        }
        rest
    });
    let output = tokio::time::timeout(Duration::from_secs(240), cli.wait_with_output())
        .await
        .expect("the adversary's run ends")
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    let err = stderr_rest.await.unwrap();
    let written: Vec<PathBuf> = [
        target.data.clone(),
        victim_dir.clone(),
        victim_dir.join("workspace"),
        PathBuf::from("/usr"),
        PathBuf::from("/etc"),
        std::env::temp_dir(),
    ]
    .into_iter()
    .map(|dir| dir.join(&marker))
    // Removed before the verdict, so a failing run leaves nothing behind on the host.
    .filter(|path| std::fs::remove_file(path).is_ok())
    .collect();
    assert!(output.status.success(), "{out}\n{err}");
    assert!(out.contains("adversary done"), "{out}\n{err}");
    // What is its own stays usable: its workspace and its private /tmp.
    assert!(out.contains("own workspace: writable"), "{out}");
    assert!(out.contains(&format!("wrote: /tmp/{marker}")), "{out}");

    // No secret: not the control plane's, not either run's key.
    for (what, secret) in target
        .secrets
        .iter()
        .map(|s| ("a control-plane secret", s.as_str()))
        .chain([
            ("the other run's key", victim_key.as_str()),
            ("its own run key", adversary_key.as_str()),
            ("a run key variable", "RUNPLANE_RUN_KEY="),
        ])
    {
        assert!(!out.contains(secret), "{what} reached the agent:\n{out}");
    }
    for line in out.lines() {
        for leak in [
            "environ ", "cmdline ", "found: ", "read: ", "killed: ", "wrote: ",
        ] {
            // Writing /tmp succeeds in a private /tmp; checked on the host below.
            let private_tmp = line == format!("wrote: /tmp/{marker}");
            assert!(
                private_tmp || !line.starts_with(leak),
                "the agent got through: {line}\n{out}"
            );
        }
    }
    // Its /proc shows none of the other sandbox's processes, and it is not root.
    let pids = out
        .lines()
        .find_map(|l| l.strip_prefix("pids: "))
        .unwrap_or_else(|| panic!("no pid listing:\n{out}"));
    for pid in pids.split_whitespace() {
        let pid: u32 = pid.parse().unwrap();
        assert!(!victim_pids.contains(&pid), "it sees pid {pid}:\n{out}");
    }
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    let uid = out
        .lines()
        .find_map(|l| l.strip_prefix("uid: "))
        .unwrap_or_else(|| panic!("no uid:\n{out}"));
    assert_ne!(uid, "0", "the agent ran as root");
    if let Ok(victim_uid) = std::fs::read_to_string(victim_dir.join("uid")) {
        assert_ne!(uid, victim_uid.trim(), "two sandboxes share a uid");
    }
    // Nothing it wrote landed outside its workspace, and the other sandbox lives on.
    assert!(written.is_empty(), "the agent wrote {written:?}");
    for pid in &victim_pids {
        assert!(
            process_state(*pid).is_some(),
            "the other sandbox's {pid} died"
        );
    }
    let victim = runs
        .get_run(authed(
            runstore_pb::GetRunRequest {
                run_id: victim_run.id.clone(),
            },
            &target.token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(victim.state(), runstore_pb::RunState::Running, "{victim:?}");

    runs.cancel_run(authed(
        runstore_pb::CancelRunRequest {
            run_id: victim_run.id.clone(),
            idempotency_key: format!("victim-cancel-{}", std::process::id()),
            ..Default::default()
        },
        &target.token,
    ))
    .await
    .unwrap();
    eventually(
        Duration::from_secs(60),
        "the other sandbox to end",
        || async { session_members(victim_sid).is_empty().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adversarial_agent_on_runplane_dev_finds_and_reaches_nothing() {
    // Not under /tmp: a private /tmp alone must not be what hides the data directory.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = dir.path().join("data");
    let dev = start_dev(&data).await;
    assert!(
        dev.stdout_lines
            .iter()
            .any(|l| l.trim_start().starts_with("isolation:      bwrap")),
        "{:?}",
        dev.stdout_lines
    );
    let read = |name: &str| {
        std::fs::read_to_string(data.join(name))
            .unwrap()
            .trim()
            .to_owned()
    };
    adversary_finds_nothing(Target {
        endpoint: dev.endpoint(),
        token: read("operator-token"),
        sandboxes: data.join("sandboxes"),
        secrets: vec![read("operator-token"), read("receipt-signing-key")],
        data,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adversarial_agent_on_a_node_agent_finds_and_reaches_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let node_state = dir.path().join("node");
    // Sandboxes run on the node only: the reconciler runs none of its own.
    let split = Split::start(
        None,
        &dir.path().join("reconciler"),
        &[("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false")],
    )
    .await;
    let _node = start_node(
        "node-adversarial",
        &runplane_testkit::free_local_addr().to_string(),
        &split.url("sandbox-reconciler"),
        &split.url("stream-recovery"),
        &node_state,
        SPLIT_TOKEN,
    );
    adversary_finds_nothing(Target {
        endpoint: split.url("run-store"),
        token: SPLIT_TOKEN.to_owned(),
        sandboxes: node_state,
        // The services and the node hold the operator token in their environment.
        secrets: vec![SPLIT_TOKEN.to_owned()],
        data: dir.path().to_path_buf(),
    })
    .await;
}

/// On a host without bubblewrap (a fresh machine with only Rust), `runplane dev` still
/// starts and runs a run, uncontained, and its banner says so in capitals with the
/// package that contains agents; `runplane node`, which runs strangers' agents, refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_bubblewrap_dev_runs_uncontained_and_says_so_while_a_node_refuses() {
    let dir = tempfile::tempdir().unwrap();
    // A host without bubblewrap: a PATH with a shell and nothing else.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink("/bin/sh", bin.join("sh")).unwrap();
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(runplane_bin())
            .arg("node")
            .env("RUNPLANE_NODE__ID", "node-no-bwrap")
            .env("PATH", &bin)
            .env("RUNPLANE_NODE_TOKEN", "rpn_not-a-real-credential")
            .env("RUNPLANE_NODE__STATE_DIR", dir.path().join("node"))
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("runplane node exits")
    .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "it started: {stderr}");
    assert!(
        stderr.contains("bubblewrap cannot contain agents on this host")
            && stderr.contains(r#"sandbox_reconciler.isolation = "none""#),
        "{stderr}"
    );

    let data = dir.path().join("dev");
    let dev =
        runplane_integration_tests::start_dev_with_env(&data, &[("PATH", bin.to_str().unwrap())])
            .await;
    let banner = dev.stdout_lines.join("\n");
    assert!(
        dev.stdout_lines
            .iter()
            .any(|l| l.trim_start().starts_with("isolation:      none")),
        "{banner}"
    );
    assert!(
        banner.contains("NOT CONTAINED:  agents run as this user")
            && banner.contains("apt-get install bubblewrap"),
        "{banner}"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(runplane_bin())
            .args(["run", "--endpoint", &dev.endpoint(), "--token-file"])
            .arg(data.join("operator-token"))
            .args(["--", "sh", "-c", "echo ran"])
            .env_remove("RUNPLANE_CONFIG")
            .env_remove("RUNPLANE_TOKEN")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the run ends")
    .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ran"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// With local sandboxes off, `runplane dev` runs no agent itself: its banner says where
/// agents run instead of a containment it does not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runplane_dev_without_local_sandboxes_says_agents_run_on_node_agents() {
    let data = tempfile::tempdir().unwrap();
    let addr = runplane_testkit::free_local_addr().to_string();
    let dev = runplane_integration_tests::start_dev_on(
        data.path(),
        &addr,
        &[("RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES", "false")],
    )
    .await;
    assert!(
        dev.stdout_lines.iter().any(|l| l
            .trim_start()
            .starts_with("isolation:      no local sandboxes")),
        "{:?}",
        dev.stdout_lines
    );
}
