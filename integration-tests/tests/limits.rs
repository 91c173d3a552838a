//! Every sandbox is bounded: a hostile agent on `runplane dev` (the process driver,
//! bubblewrap, cgroups) forks past its pids limit, allocates past its memory limit and
//! fills its workspace past its disk limit. Each is held at the limit, its run ends as
//! the limit says (`out_of_memory` for memory), and a run beside it is unaffected.

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::{run_script as run, runplane_bin, start_dev_with_env};
use tokio::process::Command;

/// A dev control plane whose sandboxes get `memory_mib` and `disk_mib` (and the default
/// 512 processes).
async fn dev(
    data: &std::path::Path,
    memory_mib: &str,
    disk_mib: &str,
) -> runplane_integration_tests::Process {
    let dev = start_dev_with_env(
        data,
        &[
            (
                "RUNPLANE_SANDBOX_RECONCILER__LIMITS__MEMORY_MIB",
                memory_mib,
            ),
            ("RUNPLANE_SANDBOX_RECONCILER__LIMITS__DISK_MIB", disk_mib),
        ],
    )
    .await;
    let isolation = dev
        .stdout_lines
        .iter()
        .find(|l| l.trim_start().starts_with("isolation:"))
        .cloned()
        .unwrap_or_default();
    assert!(
        isolation.contains(&format!(
            "limits: 2 cpus, {memory_mib} MiB memory, 512 processes, {disk_mib} MiB workspace"
        )) && !isolation.contains("NOT enforced"),
        "{isolation}"
    );
    dev
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_is_held_to_the_pids_limit_and_the_run_beside_it_is_not() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = dir.path().join("data");
    let dev = dev(&data, "4096", "10240").await;

    // 1,000 sleeping children, counted as they start; a fork that fails ends the loop.
    let bomb = r#"
        n=0
        while [ $n -lt 1000 ]; do
          sleep 300 &
          n=$((n+1))
          [ $((n % 100)) -eq 0 ] && echo "started $n"
        done
        echo "all 1000 started"
    "#;
    let dev_endpoint = dev.endpoint();
    let bomb_run = {
        let data = data.clone();
        let dev = &dev;
        async move { run(dev, &data, bomb).await }
    };
    // The run beside it starts while the bomb holds its sandbox's processes.
    let beside = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        run(&dev, &data, "echo beside; sh -c 'echo child'").await
    };
    let ((bomb_status, bomb_out, bomb_err), (beside_status, beside_out, beside_err)) =
        tokio::join!(bomb_run, beside);
    assert!(
        !bomb_out.contains("all 1000 started") && !bomb_out.contains("started 600"),
        "the agent started more processes than its limit: {bomb_out}\n{bomb_err}"
    );
    assert!(!bomb_status.success(), "{bomb_out}\n{bomb_err}");
    assert!(
        beside_status.success() && beside_out.contains("beside") && beside_out.contains("child"),
        "{beside_out}\n{beside_err} (endpoint {dev_endpoint})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_past_its_memory_limit_is_killed_and_its_run_ends_out_of_memory() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = dir.path().join("data");
    let dev = dev(&data, "64", "10240").await;

    // 256 MiB held in the shell's memory, four times the limit.
    let (status, out, err) = run(
        &dev,
        &data,
        "echo allocating; big=$(head -c 268435456 /dev/zero | tr '\\0' x); echo \"held ${#big}\"",
    )
    .await;
    assert!(!status.success(), "{out}\n{err}");
    assert!(
        out.contains("allocating") && !out.contains("held"),
        "{out}\n{err}"
    );
    assert!(
        err.contains("failed (out_of_memory"),
        "the run did not end out_of_memory: {out}\n{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_is_held_to_its_disk_limit() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = dir.path().join("data");
    let dev = dev(&data, "4096", "32").await;

    let (status, out, err) = run(
        &dev,
        &data,
        "dd if=/dev/zero of=/workspace/fill bs=1M count=100 2>&1 | grep -v records; \
         echo \"kept $(du -m /workspace/fill | cut -f1) MiB\"",
    )
    .await;
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("No space left on device"), "{out}\n{err}");
    let kept: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("kept ")?.strip_suffix(" MiB")?.parse().ok())
        .unwrap_or_else(|| panic!("{out}\n{err}"));
    assert!(
        kept <= 32,
        "the workspace took {kept} MiB past its 32: {out}"
    );
    // The ended run's sandbox is destroyed: its workspace image unmounted, its cgroups
    // (v1's hierarchies or v2's one tree, whichever this host has) gone.
    let sandboxes = data.join("sandboxes");
    runplane_integration_tests::wait_for(
        "the sandbox's mount and cgroups to go",
        Duration::from_secs(30),
        async || {
            let mounted = std::fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .contains(&*sandboxes.to_string_lossy());
            let cgroups = std::fs::read_dir(&sandboxes).unwrap().flatten().any(|s| {
                ["memory", "pids", "cpu", ""].iter().any(|root| {
                    std::path::Path::new("/sys/fs/cgroup")
                        .join(root)
                        .join("runplane")
                        .join(s.file_name())
                        .exists()
                })
            });
            !mounted && !cgroups
        },
    )
    .await;
}

/// A profile sets limits of its own: its sandboxes get them, every other profile's the
/// deployment's. 128 MiB held fails on the 64 MiB profile and succeeds on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_own_limits_bound_its_sandboxes_and_no_others() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = dir.path().join("runplane.toml");
    let profile = runplane_integration_tests::profile_toml;
    std::fs::write(
        &config,
        profile("small", "limits = { memory_mib = 64 }") + &profile("roomy", ""),
    )
    .unwrap();
    let data = dir.path().join("data");
    let config_path = config.display().to_string();
    let dev = start_dev_with_env(&data, &[("RUNPLANE_CONFIG", config_path.as_str())]).await;
    let hold = "big=$(head -c 134217728 /dev/zero | tr '\\0' x); echo \"held ${#big}\"";
    let on = |profile: &'static str| {
        let data = data.clone();
        let endpoint = dev.endpoint();
        async move {
            Command::new(runplane_bin())
                .args([
                    "run",
                    "--endpoint",
                    &endpoint,
                    "--profile",
                    profile,
                    "--token-file",
                ])
                .arg(data.join("operator-token"))
                .args(["--", "sh", "-c", hold])
                .env_remove("RUNPLANE_CONFIG")
                .env_remove("RUNPLANE_TOKEN")
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output()
                .await
                .unwrap()
        }
    };
    let small = on("small").await;
    let roomy = on("roomy").await;
    let text = |o: &std::process::Output| {
        format!(
            "{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    assert!(
        text(&small).contains("failed (out_of_memory"),
        "the small profile's agent was not held to 64 MiB: {}",
        text(&small)
    );
    assert!(
        roomy.status.success() && text(&roomy).contains("held 134217728"),
        "the other profile's agent was held to the small one's limit: {}",
        text(&roomy)
    );
}

/// A profile that names an image, on a deployment that runs sandboxes as processes: its
/// agent is never started on the host instead; the reconciler logs why, and the run ends
/// once its sandbox's loss grace (3 s here) is out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_image_is_refused_by_the_process_driver() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(
        &config,
        runplane_integration_tests::profile_toml(
            "imaged",
            "image = \"docker.io/library/python:3.12\"",
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let config_path = config.display().to_string();
    let mut dev = start_dev_with_env(
        &data,
        &[
            ("RUNPLANE_CONFIG", config_path.as_str()),
            ("RUNPLANE_SANDBOX_RECONCILER__LOSS_GRACE_SECONDS", "3"),
        ],
    )
    .await;
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        runplane_integration_tests::run_script_command_with(
            &dev,
            &data,
            &["--profile", "imaged"],
            "echo ran on the host",
        )
        .output(),
    )
    .await
    .expect("the run ends")
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("ran on the host"), "{stdout}");
    assert_eq!(stderr.matches("runplane: failed (").count(), 1, "{stderr}");
    assert!(dev.terminate().await.success());
    let log = dev.stderr().await;
    assert!(log.contains("needs the container driver"), "{log}");
}

/// `runplane node` in a mount namespace with the host's cgroups unmounted (a host that
/// offers none): it refuses to start, naming the limits it cannot enforce; told it may go
/// without them (`unenforced_limits`), it starts and says they are not enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_cgroups_refuses_to_start_unless_told_and_then_says_so() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let endpoint = format!("http://{}", runplane_testkit::free_local_addr());
    let node = |config: &str, log: &str| {
        let config_path = dir.path().join(format!("{log}.toml"));
        std::fs::write(&config_path, config).unwrap();
        let log_path = dir.path().join(format!("{log}.log"));
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"umount -l /sys/fs/cgroup && exec "$0" node"#)
            .arg(runplane_bin())
            .env("RUNPLANE_CONFIG", &config_path)
            .env("RUNPLANE_NODE__ID", "bare")
            .env("RUNPLANE_NODE__ENDPOINT", &endpoint)
            .env("RUNPLANE_NODE__STATE_DIR", dir.path().join(log))
            .env("RUNPLANE_SANDBOX_RECONCILER__ENDPOINT", &endpoint)
            .env("RUNPLANE_STREAM_RECOVERY__ENDPOINT", &endpoint)
            .env(
                "RUNPLANE_NODE_TOKEN",
                "a-node-credential-that-is-never-used",
            )
            .env_remove("RUNPLANE_TOKEN")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("unshare (util-linux) runs runplane node");
        (child, log_path)
    };

    let (refused, log) = node("", "refused");
    let status = tokio::time::timeout(Duration::from_secs(60), refused.wait_with_output())
        .await
        .expect("the node refuses within 60 s")
        .unwrap()
        .status;
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{said}");
    assert!(
        said.contains("cannot enforce")
            && ["cpu", "memory", "pids"].iter().all(|l| said.contains(l))
            && said.contains("unenforced_limits"),
        "{said}"
    );

    let (_started, log) = node(
        "[sandbox_reconciler]\nunenforced_limits = [\"cpu\", \"memory\", \"pids\"]\n",
        "told",
    );
    runplane_integration_tests::wait_for(
        "the node to say what it does not enforce",
        Duration::from_secs(60),
        async || {
            std::fs::read_to_string(&log)
                .is_ok_and(|l| l.contains("sandboxes of this node") && l.contains("NOT enforced"))
        },
    )
    .await;
}
