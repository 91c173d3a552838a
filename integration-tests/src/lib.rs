//! Helpers for black-box tests: start the real `runplane` binary and talk to it over
//! real sockets.
//!
//! The binary is the one cargo built next to the test executables
//! (`target/<profile>/runplane`; `cargo test --workspace` and `cargo nextest run
//! --workspace` build it because the `runplane` package has integration tests), or the
//! one `RUNPLANE_BIN` names.

pub mod engine;
pub mod otlp;
pub mod outside;
pub mod sandboxes;
pub mod split;
pub mod webhook_receiver;
pub mod wedge;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

/// Path of the `runplane` binary under test.
pub fn runplane_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("RUNPLANE_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/runplane
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("runplane"))
        .expect("target directory");
    assert!(
        bin.exists(),
        "{} does not exist: build it with `cargo build -p runplane` or set RUNPLANE_BIN",
        bin.display()
    );
    bin
}

/// A `runplane` process, killed on drop unless it already exited.
pub struct Process {
    pub child: Child,
    pub address: String,
    pub stdout_lines: Vec<String>,
    stderr: Option<tokio::task::JoinHandle<String>>,
    /// The data directory of a `runplane dev`, whose sandboxes' host resources (workspace
    /// mounts, cgroups) go when the test does.
    data_dir: Option<std::path::PathBuf>,
}

/// Reads the process's stderr as it comes, so a chatty log level never fills the pipe
/// and stalls the process.
fn collect(
    stderr: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    mut seen: String,
) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push_str(&line);
            seen.push('\n');
        }
        seen
    })
}

impl Process {
    /// `http://ADDR`, for tonic clients.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// `https://ADDR`, for clients of a process serving `[tls]`; its certificate needs
    /// an IP SAN for the address (`runplane_testkit::pki` makes such certificates).
    pub fn https_endpoint(&self) -> String {
        format!("https://{}", self.address)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("process still running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid} failed");
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("runplane exits within 30 s of SIGTERM")
            .expect("wait for runplane")
    }

    /// Sends `signal` (`-STOP`, `-CONT`, …) with kill(1), as an operator would.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the process is running");
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    /// SIGKILL: no shutdown, no draining, as a crashed or evicted process.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Everything the process wrote to stderr (its logs); call after it exited.
    pub async fn stderr(&mut self) -> String {
        match self.stderr.take() {
            Some(reader) => reader.await.unwrap_or_default(),
            None => String::new(),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if let Some(dir) = &self.data_dir {
            release_sandboxes(dir);
        }
    }
}

/// Stops every sandbox network under `dir` (slirp4netns, the namespace), unmounts every
/// sandbox workspace and removes the sandboxes' emptied cgroups: what a test leaves of
/// sandboxes its control plane had no time to destroy (their processes end with their
/// runs; the rest would stay for ever).
pub fn release_sandboxes(dir: &Path) {
    // Each sandbox's own network: its slirp4netns and its namespace. A sandbox's
    // directory is named by its id, wherever under `dir` its driver keeps it (`dev`'s
    // `sandboxes/`, a reconciler's or a node's own state directory).
    for sandbox in sandbox_dirs(dir, 3) {
        let Some(id) = sandbox
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
        else {
            continue;
        };
        let netns = format!("runplane-{id}");
        if let Some(pid) = std::fs::read_to_string(sandbox.join("slirp.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&netns))
        {
            let _ = std::process::Command::new("kill")
                .arg(pid.to_string())
                .status();
        }
        if Path::new("/run/netns").join(&netns).exists() {
            let _ = std::process::Command::new("ip")
                .args(["netns", "delete", &netns])
                .status();
        }
    }
    remove_containers_of(&dir.join("sandboxes"));
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let prefix = dir.to_string_lossy().into_owned();
    for mount_point in mountinfo.lines().filter_map(|l| l.split(' ').nth(4)) {
        if !mount_point.starts_with(&prefix) {
            continue;
        }
        let _ = std::process::Command::new("umount")
            .args(["-l", mount_point])
            .status();
        let sandbox = Path::new(mount_point).parent().and_then(|p| p.file_name());
        for root in ["memory", "pids", "cpu", ""] {
            if let Some(id) = sandbox {
                let _ = std::fs::remove_dir(
                    Path::new("/sys/fs/cgroup")
                        .join(root)
                        .join("runplane")
                        .join(id),
                );
            }
        }
    }
}

/// The directories under `dir`, at most `depth` levels down, named as a sandbox is (its
/// id, a UUID).
fn sandbox_dirs(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if uuid::Uuid::parse_str(&entry.file_name().to_string_lossy()).is_ok() {
            found.push(path);
        } else if depth > 1 {
            found.extend(sandbox_dirs(&path, depth - 1));
        }
    }
    found
}

/// Removes, from the test engine (`RUNPLANE_TEST_ENGINE`, when set), every container
/// the driver whose state is `state_dir` made.
fn remove_containers_of(state_dir: &Path) {
    if let Ok(engine) = std::env::var("RUNPLANE_TEST_ENGINE") {
        engine::remove_containers_of(&engine, state_dir);
    }
}

/// A `[[credential_health.profiles]]` entry named `name` on `runplane dev`'s credential
/// `local`, with `extra` (TOML lines of its own: limits, an image) at its end.
pub fn profile_toml(name: &str, extra: &str) -> String {
    format!(
        "[[credential_health.profiles]]\nname = \"{name}\"\ncredential_id = \"local\"\ncapacity = 2\nerror_pattern = \"API Error:\"\nexhausted_pattern = \"quota exceeded\"\n{extra}\n"
    )
}

/// `runplane run -- sh -c <script>` against `dev`, whose data (and operator token) is in
/// `data`, ready to spawn: no config file or token of the caller's, stdin closed.
pub fn run_script_command(dev: &Process, data: &Path, script: &str) -> Command {
    run_script_command_with(dev, data, &[], script)
}

/// [`run_script_command`] with more of `runplane run`'s flags (`--profile P`, say).
pub fn run_script_command_with(
    dev: &Process,
    data: &Path,
    flags: &[&str],
    script: &str,
) -> Command {
    let mut command = Command::new(runplane_bin());
    command
        .args(["run", "--endpoint", &dev.endpoint(), "--token-file"])
        .arg(data.join("operator-token"))
        .args(flags)
        .args(["--", "sh", "-c", script])
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// [`run_script_command`] to its end (within 120 s): its exit status, stdout and stderr.
pub async fn run_script(
    dev: &Process,
    data: &Path,
    script: &str,
) -> (std::process::ExitStatus, String, String) {
    run_to_end(run_script_command(dev, data, script)).await
}

/// `command` (a `runplane run`) to its end, within 120 s: its exit status, stdout and
/// stderr.
pub async fn run_to_end(mut command: Command) -> (std::process::ExitStatus, String, String) {
    let out = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the run ends within 120 s")
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// This host's first global IPv4 address (its `eth0`, say), not a test's veth.
pub fn host_address() -> String {
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show", "scope", "global"])
        .output()
        .expect("run ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains(" rpo"))
        .find_map(|l| {
            l.split_whitespace()
                .nth(3)?
                .split('/')
                .next()
                .map(str::to_owned)
        })
        .expect("a global IPv4 address")
}

/// Starts `runplane dev` on a free port with its data in `data_dir` and waits for its
/// banner.
pub async fn start_dev(data_dir: &Path) -> Process {
    start_dev_with_env(data_dir, &[]).await
}

/// [`start_dev`] with extra environment variables.
pub async fn start_dev_with_env(data_dir: &Path, env: &[(&str, &str)]) -> Process {
    start_dev_on(data_dir, "127.0.0.1:0", env).await
}

/// `runplane dev` on `listen` (a fixed address lets a restart keep its clients).
pub async fn start_dev_on(data_dir: &Path, listen: &str, env: &[(&str, &str)]) -> Process {
    let mut command = Command::new(runplane_bin());
    command
        .args(["dev", "--listen", listen, "--data-dir"])
        .arg(data_dir)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("RUNPLANE_CONFIG");
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn runplane dev");
    let stdout = child.stdout.take().expect("stdout piped");
    let stderr = child
        .stderr
        .take()
        .map(|stderr| collect(stderr, String::new()));
    let (address, stdout_lines) = read_banner(stdout).await;
    Process {
        child,
        address,
        stdout_lines,
        stderr,
        data_dir: Some(data_dir.to_path_buf()),
    }
}

/// Reads the dev banner up to and including the grpcurl lines.
async fn read_banner(stdout: ChildStdout) -> (String, Vec<String>) {
    let mut lines = BufReader::new(stdout).lines();
    let mut seen = Vec::new();
    let mut address = None;
    let read = async {
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            if let Some(rest) = line.strip_prefix("runplane dev: serving on ") {
                address = Some(rest.trim().to_owned());
            }
            let done = line.contains("grpc.health.v1.Health/Check");
            seen.push(line);
            if done {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("runplane dev printed its banner within 60 s");
    let address = address.unwrap_or_else(|| panic!("no address in banner: {seen:?}"));
    (address, seen)
}

/// The service token [`start_serve`] gives every service it starts.
pub const SERVICE_TOKEN: &str = "integration-service-token-0123456789abcdef01";

/// Starts `runplane serve <services>` with `env` and waits for its `serving` log line.
pub async fn start_serve(services: &[&str], env: &[(&str, &str)]) -> Process {
    let mut command = Command::new(runplane_bin());
    command
        .arg("serve")
        .args(services)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("RUNPLANE_CONFIG")
        // What every deployment gives its services; `env` may name another.
        .env("RUNPLANE_AUTH__SERVICE_TOKEN", SERVICE_TOKEN)
        // Tests run local sandboxes in the serving process, one trusted tenant: the
        // risk is named, as a deployment doing so must (`env` may turn it off).
        .env(
            "RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES_BESIDE_SECRETS",
            "true",
        )
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("spawn runplane serve");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    let address = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.expect("read stderr") {
            seen.push_str(&line);
            seen.push('\n');
            if let Some((_, rest)) = line.split_once(" serving address=") {
                return rest.split_whitespace().next().map(str::to_owned);
            }
        }
        None
    })
    .await
    .expect("runplane serve logged `serving` within 60 s")
    .unwrap_or_else(|| panic!("runplane serve exited before serving:\n{seen}"));
    Process {
        child,
        address,
        stdout_lines: Vec::new(),
        stderr: Some(collect(lines.into_inner().into_inner(), seen)),
        data_dir: None,
    }
}

/// A plain tonic channel to `endpoint`, as any gRPC client would open.
pub async fn channel(endpoint: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint uri")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect to {endpoint}: {e}"))
}

/// A channel to `endpoint` that connects on first use (and again after a failure).
pub fn lazy_channel(endpoint: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint uri")
        .connect_lazy()
}

/// Whether `pid` is a process that has not exited (a zombie has, in all but name).
pub fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// Polls `ready` every 100 ms until it holds; panics naming `what` after `within`.
pub async fn wait_for(what: &str, within: Duration, mut ready: impl AsyncFnMut() -> bool) {
    let started = tokio::time::Instant::now();
    while !ready().await {
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
