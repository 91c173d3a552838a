//! The container driver against a real engine (Podman's Docker-compatible socket, from
//! `scripts/podman`, which the test command runs): `runplane dev --driver container
//! --image IMAGE` runs an agent in a container of a busybox-only image (no libc, no shell
//! of ours). A hostile agent is held to its pids and memory limits (`out_of_memory`),
//! reaches neither the host nor the control plane, and finds no run key, in the
//! container or in what the engine says of it; cancel leaves no container behind.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::engine::{self, Start, WARM, engine_and_image};
use runplane_integration_tests::sandboxes::run_key_in_memory;
use runplane_integration_tests::{Process, runplane_bin, start_dev_with_env};
use tokio::process::Command;

struct Dev {
    dev: Process,
    data: PathBuf,
    engine: String,
    start: Start,
    _dir: tempfile::TempDir,
}

runplane_integration_tests::on_both_starts!(
    a_container_run_prints_live_ends_with_its_status_and_leaves_no_container,
    a_container_agent_past_its_memory_limit_ends_out_of_memory,
    a_container_fork_bomb_is_held_to_the_pids_limit,
    a_container_agent_reaches_neither_the_host_nor_the_control_plane,
    no_run_key_reaches_the_container_or_the_engines_view_of_it,
    a_cancelled_container_run_leaves_no_container,
    a_container_removed_from_outside_ends_its_attempt_once_as_lost,
    a_container_run_survives_a_restart_of_dev,
);

/// Waits, for a warm start, until the pool of the dev whose data is `data` is full.
async fn pool_ready(start: Start, engine: &str, data: &Path) {
    if start.is_warm() {
        let state = data.join("sandboxes");
        runplane_integration_tests::wait_for(
            "the warm pool to fill",
            Duration::from_secs(60),
            async || engine::warm_waiting(engine, &state).len() == WARM,
        )
        .await;
    }
}

/// The data directory of a test's `runplane dev`, as deep as an operator's may be: its
/// sandboxes' sockets have paths longer than a socket's address holds (107 bytes).
fn deep_data_dir(dir: &tempfile::TempDir) -> PathBuf {
    let data = dir
        .path()
        .join("a-data-directory-as-deep-as-an-operators-own-may-be")
        .join("data");
    let socket = data
        .join("sandboxes")
        .join("00000000-0000-0000-0000-000000000000")
        .join("launch/launch.sock");
    assert!(socket.as_os_str().len() > 107, "{}", socket.display());
    data
}

/// How sandbox `id`'s container started: a warm one carries its warm label.
fn started_as(dev: &Dev, id: &str) -> Start {
    let inspected = engine::get(&dev.engine, &format!("/containers/runplane-{id}/json"));
    assert!(!inspected.is_empty(), "no container runplane-{id}");
    Start::of(&inspected)
}

async fn dev(start: Start, env: &[(&str, &str)]) -> Dev {
    let (engine, _) = engine_and_image();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = deep_data_dir(&dir);
    let owned = engine::container_env(start);
    let mut all = engine::borrowed(&owned);
    all.push(("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__PULL", "never"));
    // The image of the test's own, when it says.
    all.retain(|(k, _)| !env.iter().any(|(e, _)| e == k));
    all.extend_from_slice(env);
    let dev = start_dev_with_env(&data, &all).await;
    pool_ready(start, &engine, &data).await;
    let banner = dev.stdout_lines.join("\n");
    assert!(
        banner.contains("isolation:      container: image ") && !banner.contains("NOT"),
        "{banner}"
    );
    Dev {
        dev,
        data,
        engine: engine.clone(),
        start,
        _dir: dir,
    }
}

fn run_command(dev: &Dev, script: &str) -> Command {
    runplane_integration_tests::run_script_command(
        &dev.dev,
        &dev.data,
        &format!("{SAY_START}{script}"),
    )
}

/// What every agent of these tests says first: whether its container is a warm one (its
/// pid 1 the holder) or made for it.
const SAY_START: &str = "case $(tr -d '\\0' < /proc/1/cmdline) in /.runplane-holder-P*) echo 'start: WarmExec';; /.runplane-holder*) echo 'start: Warm';; *) echo 'start: Cold';; esac; ";

/// Runs `script` as an agent to its end.
async fn run_to_end(dev: &Dev, script: &str) -> (std::process::ExitStatus, String, String) {
    runplane_integration_tests::run_to_end(run_command(dev, script)).await
}

/// Runs `script` as an agent to its end, and checks it started as the dev's sandboxes do.
async fn run(dev: &Dev, script: &str) -> (std::process::ExitStatus, String, String) {
    let (status, stdout, stderr) = run_to_end(dev, script).await;
    assert!(
        stdout.contains(&format!("start: {:?}", dev.start)),
        "not a {:?} start:\n{stdout}\n{stderr}",
        dev.start
    );
    (status, stdout, stderr)
}

/// The containers of this dev's sandboxes, by their label.
fn containers_of(dev: &Dev) -> Vec<String> {
    let sandboxes: Vec<String> = std::fs::read_dir(dev.data.join("sandboxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let listed = engine::get(&dev.engine, "/containers/json?all=true");
    sandboxes
        .into_iter()
        .filter(|id| listed.contains(&format!("runplane-{id}")))
        .collect()
}

async fn a_container_run_prints_live_ends_with_its_status_and_leaves_no_container(start: Start) {
    let dev = dev(start, &[]).await;
    let (status, out, err) = run(
        &dev,
        "echo from the image; test -e /lib/libc.so.6 || echo no libc; cd /workspace && echo kept > file && cat file; exit 7",
    )
    .await;
    assert_eq!(status.code(), Some(7), "{out}\n{err}");
    assert!(
        out.contains("from the image") && out.contains("no libc") && out.contains("kept"),
        "{out}\n{err}"
    );
    assert!(err.contains("failed (exit_nonzero, exit code 7)"), "{err}");
    runplane_integration_tests::wait_for(
        "its container to go",
        Duration::from_secs(30),
        async || containers_of(&dev).is_empty(),
    )
    .await;
}

async fn a_container_agent_past_its_memory_limit_ends_out_of_memory(start: Start) {
    let dev = dev(
        start,
        &[("RUNPLANE_SANDBOX_RECONCILER__LIMITS__MEMORY_MIB", "64")],
    )
    .await;
    let (status, out, err) = run(
        &dev,
        "echo allocating; big=$(head -c 268435456 /dev/zero | tr '\\0' x); echo \"held ${#big}\"",
    )
    .await;
    assert!(!status.success(), "{out}\n{err}");
    assert!(!out.contains("held"), "{out}");
    assert!(err.contains("failed (out_of_memory"), "{out}\n{err}");
}

async fn a_container_fork_bomb_is_held_to_the_pids_limit(start: Start) {
    let dev = dev(
        start,
        &[("RUNPLANE_SANDBOX_RECONCILER__LIMITS__PIDS", "64")],
    )
    .await;
    let (_, out, err) = run(
        &dev,
        "n=0; while [ $n -lt 1000 ]; do sleep 300 & n=$((n+1)); [ $((n % 50)) -eq 0 ] && echo started $n; done; echo all 1000 started",
    )
    .await;
    assert!(
        !out.contains("all 1000 started") && !out.contains("started 100"),
        "the agent started more processes than its 64: {out}\n{err}"
    );
    // And the next run is unaffected.
    let (status, out, err) = run(&dev, "echo after").await;
    assert!(status.success() && out.contains("after"), "{out}\n{err}");
}

async fn a_container_agent_reaches_neither_the_host_nor_the_control_plane(start: Start) {
    use runplane_integration_tests::outside::{OUTSIDE_PORT, OutsideHost};
    let outside = OutsideHost::start();
    let dev = dev(start, &[]).await;
    let port = dev.dev.address.rsplit(':').next().unwrap().to_owned();
    let everywhere = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let host_port = everywhere.local_addr().unwrap().port();
    let host = runplane_integration_tests::host_address();
    let targets = [
        format!("127.0.0.1 {port}"),
        "127.0.0.1 5432".to_owned(),
        "127.0.0.1 6379".to_owned(),
        format!("{host} {host_port}"),
        format!("{host} {port}"),
        format!("10.0.2.2 {port}"),
    ];
    outside.serving().await;
    let outside_target = format!("{} {OUTSIDE_PORT}", outside.address);
    // busybox's nc: -w 3 gives up after 3 s; the outside host answers `outside`.
    let script = targets
        .iter()
        .chain([&outside_target])
        .map(|t| format!("if answer=$(echo | nc -w 3 {t} 2>/dev/null); then echo \"reached {t} $answer\"; else echo \"refused {t}\"; fi"))
        .collect::<Vec<_>>()
        .join("\n");
    let (status, out, err) = run(&dev, &script).await;
    assert!(status.success(), "{out}\n{err}");
    for t in &targets {
        assert!(
            out.contains(&format!("refused {t}")),
            "the agent reached {t}:\n{out}"
        );
    }
    assert!(
        out.contains(&format!("reached {outside_target} outside")),
        "the agent could not reach a host outside this one:\n{out}\n{err}"
    );
    drop(everywhere);
}

/// The run key is nowhere the agent or the engine can show: the agent searches its
/// container's /proc and files, and the engine's inspect data of the running container
/// is searched for the key read from the runner's memory on the host.
async fn no_run_key_reaches_the_container_or_the_engines_view_of_it(start: Start) {
    let dev = dev(start, &[]).await;
    let script = "read go; \
        for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f 2>/dev/null; done | grep -c 'RUNPLANE_RUN_[K]EY='; \
        grep -rl 'rk_' / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -3; \
        echo searched";
    let cli = run_command(&dev, script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The runner of this run, on the host, and its key.
    let sandbox: PathBuf = runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(60),
        "the sandbox",
        || async {
            std::fs::read_dir(dev.data.join("sandboxes"))
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.join("pid").exists())
        },
    )
    .await;
    let id = sandbox.file_name().unwrap().to_string_lossy().into_owned();
    let key = runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(60),
        "the runner's key",
        || async {
            let sid: u32 = std::fs::read_to_string(sandbox.join("pid"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            runplane_integration_tests::sandboxes::session_members(sid)
                .into_iter()
                .find_map(run_key_in_memory)
        },
    )
    .await;
    let inspected = runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(60),
        "the running container",
        || async {
            let json = engine::get(&dev.engine, &format!("/containers/runplane-{id}/json"));
            json.contains("\"Running\":true").then_some(json)
        },
    )
    .await;
    assert_eq!(started_as(&dev, &id), start);
    if start == Start::Cold {
        assert!(
            inspected.contains(&format!("dev.runplane.sandbox-id\":\"{id}")),
            "{inspected}"
        );
    }
    assert!(
        !inspected.contains(&key),
        "the engine's inspect data holds the run key"
    );
    assert!(!inspected.contains("RUNPLANE_RUN_KEY"), "{inspected}");

    let runs_token = std::fs::read_to_string(dev.data.join("operator-token")).unwrap();
    let steer = Command::new(runplane_bin())
        .args(["steer", "--endpoint", &dev.dev.endpoint()])
        .arg(run_id_of(&sandbox).await)
        .arg("go")
        .env("RUNPLANE_TOKEN", runs_token.trim())
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(
        steer.status.success(),
        "{}",
        String::from_utf8_lossy(&steer.stderr)
    );
    let out = tokio::time::timeout(Duration::from_secs(120), cli.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("searched"), "{stdout}");
    assert!(
        !stdout.contains(&key),
        "the agent found the run key:\n{stdout}"
    );
    assert_eq!(
        stdout.lines().nth(1),
        Some("0"),
        "a RUN_KEY variable in the container:\n{stdout}"
    );
}

/// The run a sandbox directory's runner runs, from its log once the runner wrote it
/// there (its first lines come before it knows its run).
async fn run_id_of(sandbox: &Path) -> String {
    runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(30),
        "the runner to log its run id",
        || async {
            let log = std::fs::read_to_string(sandbox.join("runner.log")).unwrap_or_default();
            log.split("run_id=")
                .nth(1)
                .and_then(|rest| {
                    rest.split(|c: char| !(c.is_ascii_hexdigit() || c == '-'))
                        .next()
                })
                .filter(|id| id.len() == 36)
                .map(str::to_owned)
        },
    )
    .await
}

async fn a_cancelled_container_run_leaves_no_container(start: Start) {
    let dev = dev(start, &[]).await;
    let mut cli = run_command(&dev, "echo started; sleep 600")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sandbox: PathBuf = runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(60),
        "the container",
        || async {
            let sandbox = std::fs::read_dir(dev.data.join("sandboxes"))
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.join("pid").exists())?;
            (!containers_of(&dev).is_empty()).then_some(sandbox)
        },
    )
    .await;
    let id = sandbox.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(started_as(&dev, &id), start);
    let token = std::fs::read_to_string(dev.data.join("operator-token")).unwrap();
    let cancel = Command::new(runplane_bin())
        .args(["cancel", "--endpoint", &dev.dev.endpoint()])
        .arg(run_id_of(&sandbox).await)
        .env("RUNPLANE_TOKEN", token.trim())
        .env_remove("RUNPLANE_CONFIG")
        .output()
        .await
        .unwrap();
    assert!(
        cancel.status.success(),
        "{}",
        String::from_utf8_lossy(&cancel.stderr)
    );
    let _ = tokio::time::timeout(Duration::from_secs(60), cli.wait()).await;
    runplane_integration_tests::wait_for(
        "the cancelled run's container to go",
        Duration::from_secs(60),
        async || containers_of(&dev).is_empty(),
    )
    .await;
}

/// An image that goes between the start and the run ends the run `image_unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_image_is_gone_ends_image_unavailable() {
    let (engine, image) = engine_and_image();
    let tag = format!("gone-{}", std::process::id());
    let (repo, _) = image.rsplit_once(':').unwrap();
    assert!(
        engine::call(
            &engine,
            "POST",
            &format!("/images/{image}/tag?repo={repo}&tag={tag}")
        ),
        "tagging {image}"
    );
    let gone = format!("{repo}:{tag}");
    let dev = dev(
        Start::Cold,
        &[(
            "RUNPLANE_SANDBOX_RECONCILER__CONTAINER__IMAGE",
            gone.as_str(),
        )],
    )
    .await;
    assert!(
        engine::call(&engine, "DELETE", &format!("/images/{gone}")),
        "untagging {gone}"
    );
    let (status, out, err) = run_to_end(&dev, "echo never").await;
    assert!(!status.success(), "{out}\n{err}");
    assert!(!out.contains("never"), "{out}");
    assert!(err.contains("failed (image_unavailable"), "{out}\n{err}");
}

/// A container removed from outside while its agent runs: its attempt ends once,
/// `sandbox_lost`, and the run's second attempt, in a new container that learns which
/// attempt it is and why the first ended, succeeds.
async fn a_container_removed_from_outside_ends_its_attempt_once_as_lost(start: Start) {
    let dev = dev(start, &[]).await;
    let mut cli = run_command(
        &dev,
        "echo \"attempt $RUNPLANE_ATTEMPT after ${RUNPLANE_PREVIOUS_ATTEMPT:-nothing}\"; \
         if [ \"$RUNPLANE_ATTEMPT\" = 1 ]; then sleep 600; fi",
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // The container is removed once attempt 1's agent has printed: its agent runs.
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(cli.stdout.take().unwrap()).lines();
    let mut printed = Vec::new();
    while let Some(line) = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("attempt 1 prints")
        .unwrap()
    {
        printed.push(line);
        if printed.last().is_some_and(|l| l.starts_with("attempt 1")) {
            break;
        }
    }
    let id = containers_of(&dev)
        .into_iter()
        .next()
        .expect("attempt 1's container");
    assert_eq!(started_as(&dev, &id), start);
    assert!(
        engine::call(
            &dev.engine,
            "DELETE",
            &format!("/containers/runplane-{id}?force=true")
        ),
        "removing the container"
    );
    let rest = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            printed.push(line);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), rest)
        .await
        .expect("the run ends");
    let out = tokio::time::timeout(Duration::from_secs(60), cli.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let (stdout, err) = (printed.join("\n"), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{err}");
    assert_eq!(
        err.matches("runplane: attempt 1 ended (sandbox_lost")
            .count(),
        1,
        "{err}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with("attempt "))
            .collect::<Vec<_>>(),
        ["attempt 1 after nothing", "attempt 2 after sandbox_lost"],
        "{stdout}\n{err}"
    );
}

/// `runplane dev` restarted under a running container run: the run's runner (on the
/// host, in a session of its own) and its container live on, and the run succeeds.
async fn a_container_run_survives_a_restart_of_dev(start: Start) {
    let (engine, _) = engine_and_image();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = deep_data_dir(&dir);
    let addr = runplane_testkit::free_local_addr().to_string();
    let owned = engine::container_env(start);
    let env = engine::borrowed(&owned);
    let mut first = runplane_integration_tests::start_dev_on(&data, &addr, &env).await;
    pool_ready(start, &engine, &data).await;
    let cli = Command::new(runplane_bin())
        .args([
            "run",
            "--endpoint",
            &format!("http://{addr}"),
            "--token-file",
        ])
        .arg(data.join("operator-token"))
        .args([
            "--",
            "sh",
            "-c",
            &format!("{SAY_START}for i in $(seq 1 30); do echo tick $i; sleep 0.2; done"),
        ])
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("RUNPLANE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(first.terminate().await.success());
    let _second = runplane_integration_tests::start_dev_on(&data, &addr, &env).await;
    let out = tokio::time::timeout(Duration::from_secs(90), cli.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("tick 30"), "{stdout}");
    assert!(stdout.contains(&format!("start: {start:?}")), "{stdout}");
}

/// A restarted `runplane dev` removes what its driver made and no longer owns: the warm
/// containers of its earlier life (and their directories), and a container of a sandbox
/// with no live runner. It fills its pool afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_driver_removes_the_containers_it_no_longer_owns() {
    let (engine, image) = engine_and_image();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = deep_data_dir(&dir);
    let state = data.join("sandboxes");
    let addr = runplane_testkit::free_local_addr().to_string();
    let owned = engine::container_env(Start::Warm);
    let env = engine::borrowed(&owned);
    let mut first = runplane_integration_tests::start_dev_on(&data, &addr, &env).await;
    pool_ready(Start::Warm, &engine, &data).await;
    let earlier = engine::containers(&engine, &state, Some("runplane-warm-"), false);
    assert!(first.terminate().await.success());
    assert_eq!(
        engine::containers(&engine, &state, Some("runplane-warm-"), false),
        earlier,
        "the pool outlives its dev"
    );

    // A container of this driver's whose sandbox has no runner.
    let orphan = format!("runplane-orphan-{}", std::process::id());
    let body = format!(
        r#"{{"Image":"{image}","Cmd":["sleep","600"],"Labels":{{"dev.runplane.owner":"{}"}},"HostConfig":{{"NetworkMode":"none"}}}}"#,
        state.display()
    );
    assert!(
        engine::post_json(&engine, &format!("/containers/create?name={orphan}"), &body),
        "creating {orphan}"
    );
    assert!(engine::call(
        &engine,
        "POST",
        &format!("/containers/{orphan}/start")
    ));

    let _second = runplane_integration_tests::start_dev_on(&data, &addr, &env).await;
    runplane_integration_tests::wait_for(
        "the orphan and the earlier warm containers to go, and a new pool",
        Duration::from_secs(60),
        async || {
            let now = engine::containers(&engine, &state, Some("runplane-warm-"), false);
            engine::get(&engine, &format!("/containers/{orphan}/json")).is_empty()
                && now.len() == WARM
                && now.iter().all(|id| !earlier.contains(id))
        },
    )
    .await;
    let warm_dirs = std::fs::read_dir(state.join(".warm")).unwrap().count();
    assert_eq!(warm_dirs, WARM, "the earlier pool's directories are gone");
}

/// An image of the test image's with `/marker` in it, committed through the engine; the
/// guard removes it.
struct MarkedImage {
    engine: String,
    name: String,
}

impl MarkedImage {
    fn make(engine: &str, base: &str) -> Self {
        let repo = format!("localhost/runplane-marked-{}", std::process::id());
        let name = format!("{repo}:test");
        let maker = format!("runplane-marking-{}", std::process::id());
        let body = format!(
            r#"{{"Image":"{base}","Cmd":["sh","-c","echo marked > /marker"],"HostConfig":{{"NetworkMode":"none"}}}}"#
        );
        assert!(
            engine::post_json(engine, &format!("/containers/create?name={maker}"), &body),
            "creating {maker}"
        );
        assert!(engine::call(
            engine,
            "POST",
            &format!("/containers/{maker}/start")
        ));
        assert!(engine::call(
            engine,
            "POST",
            &format!("/containers/{maker}/wait")
        ));
        assert!(
            engine::post_json(
                engine,
                &format!("/commit?container={maker}&repo={repo}&tag=test"),
                "{}"
            ),
            "committing {name}"
        );
        assert!(engine::call(
            engine,
            "DELETE",
            &format!("/containers/{maker}?force=true")
        ));
        Self {
            engine: engine.to_owned(),
            name,
        }
    }
}

impl Drop for MarkedImage {
    fn drop(&mut self) {
        engine::call(
            &self.engine,
            "DELETE",
            &format!("/images/{}?force=true", self.name),
        );
    }
}

/// A profile that names its own image runs its sandboxes in a container of it, made for
/// them (a warm container is of the deployment's image); a profile that names none runs
/// in the deployment's image, warm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_own_image_runs_its_sandboxes_and_no_others() {
    let (engine, image) = engine_and_image();
    let marked = MarkedImage::make(&engine, &image);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = dir.path().join("runplane.toml");
    let profile = runplane_integration_tests::profile_toml;
    std::fs::write(
        &config,
        profile("marked", &format!("image = \"{}\"", marked.name)) + &profile("plain", ""),
    )
    .unwrap();
    let config = config.display().to_string();
    let dev = dev(Start::Warm, &[("RUNPLANE_CONFIG", config.as_str())]).await;
    let on = async |profile: &str| {
        let out = runplane_integration_tests::run_script_command_with(
            &dev.dev,
            &dev.data,
            &["--profile", profile],
            &format!("{SAY_START}cat /marker 2>/dev/null || echo no marker"),
        )
        .output()
        .await
        .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, out) = on("marked").await;
    assert!(
        ok && out.contains("marked") && out.contains("start: Cold"),
        "{out}"
    );
    let (ok, out) = on("plain").await;
    assert!(
        ok && out.contains("no marker") && out.contains("start: Warm"),
        "{out}"
    );
}

/// The directory a warm container's holder listens in is bound writable from the host:
/// an agent filling it fills a small tmpfs, never the host's disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_containers_launch_directory_is_not_the_hosts_disk() {
    let dev = dev(Start::Warm, &[]).await;
    let (status, out, err) = run(
        &dev,
        "if dd if=/dev/zero of=/.runplane/fill bs=1024 count=4096 2>/dev/null; then echo filled; else echo refused; fi",
    )
    .await;
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("refused") && !out.contains("filled"), "{out}");
}

/// The engine's stop (an operator's `podman stop`, say) signals a container's pid 1 only:
/// a warm container's holder passes it to the agent, which gets its grace (its TERM trap
/// runs) and ends its run as it chooses; the container ends with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_stop_of_a_warm_container_reaches_its_agent() {
    let dev = dev(Start::Warm, &[]).await;
    let cli = run_command(
        &dev,
        "trap 'echo stopped gracefully; exit 0' TERM; echo ready; while true; do sleep 0.1; done",
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let id = runplane_integration_tests::sandboxes::eventually(
        Duration::from_secs(60),
        "the running container",
        || async { containers_of(&dev).into_iter().next() },
    )
    .await;
    assert_eq!(started_as(&dev, &id), Start::Warm);
    // The agent has started (its holder answered its pid) once its first line is out.
    runplane_integration_tests::wait_for(
        "the agent to start",
        Duration::from_secs(60),
        async || {
            std::fs::read_to_string(dev.data.join("sandboxes").join(&id).join("runner.log"))
                .is_ok_and(|log| log.contains("agent started"))
        },
    )
    .await;
    assert!(
        engine::call(
            &dev.engine,
            "POST",
            &format!("/containers/runplane-{id}/stop?t=30")
        ),
        "stopping the container"
    );
    let out = tokio::time::timeout(Duration::from_secs(60), cli.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.contains("stopped gracefully"), "{stdout}\n{stderr}");
    assert!(stderr.contains("runplane: succeeded"), "{stdout}\n{stderr}");
}
