//! The container engine of the container driver's tests: Podman's Docker-compatible API
//! on the socket `scripts/podman` starts (`RUNPLANE_TEST_ENGINE`), with its test image
//! (`RUNPLANE_TEST_IMAGE`), reached with curl as an operator would.

use std::path::Path;
use std::time::Duration;

/// The engine and image `scripts/podman` set up; never skipped: without them the test
/// says how to get them.
pub fn engine_and_image() -> (String, String) {
    let get = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set: run `eval \"$(scripts/podman)\"` (or scripts/test, which \
                 does) to start Podman's API socket and build the test image"
            )
        })
    };
    (get("RUNPLANE_TEST_ENGINE"), get("RUNPLANE_TEST_IMAGE"))
}

/// How a sandbox gets its container: made for it (no warm pool), or taken from the
/// driver's warm pool of [`WARM`], which a test waits to be full. A warm container's
/// holder is `runplane-holder` (`RUNPLANE_TEST_HOLDER`, from `scripts/holder`), which
/// starts the agent itself, or catatonit, in which the agent starts by the engine's exec
/// (`WarmExec`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Start {
    Cold,
    Warm,
    WarmExec,
}

/// The warm pool's size in the tests that start warm.
pub const WARM: usize = 2;

/// The static `runplane-holder` `scripts/holder` built; never skipped.
pub fn holder() -> String {
    std::env::var("RUNPLANE_TEST_HOLDER").unwrap_or_else(|_| {
        panic!(
            "RUNPLANE_TEST_HOLDER is not set: run `eval \"$(scripts/holder)\"` (or \
             scripts/test, which does) to build runplane-holder for musl"
        )
    })
}

impl Start {
    pub fn is_warm(self) -> bool {
        self != Start::Cold
    }

    /// The driver's environment for this start: its warm pool's size and holder.
    pub fn env(self) -> [(&'static str, String); 2] {
        let (warm, holder) = match self {
            Start::Cold => ("0", String::new()),
            Start::Warm => ("2", holder()),
            Start::WarmExec => ("2", "/usr/bin/catatonit".to_owned()),
        };
        [
            (
                "RUNPLANE_SANDBOX_RECONCILER__CONTAINER__WARM",
                warm.to_owned(),
            ),
            ("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__HOLDER", holder),
        ]
    }

    /// How the container whose engine inspect data is `inspected` started.
    pub fn of(inspected: &str) -> Start {
        match (
            inspected.contains("dev.runplane.warm"),
            inspected.contains("launch.sock"),
        ) {
            (false, _) => Start::Cold,
            (true, true) => Start::Warm,
            (true, false) => Start::WarmExec,
        }
    }
}

/// The environment of a `runplane dev` (or node) whose sandboxes are containers of the
/// test image on the test engine, started as `start` says.
pub fn container_env(start: Start) -> Vec<(&'static str, String)> {
    let (engine, image) = engine_and_image();
    let mut env = vec![
        (
            "RUNPLANE_SANDBOX_RECONCILER__DRIVER",
            "container".to_owned(),
        ),
        ("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__ENGINE", engine),
        ("RUNPLANE_SANDBOX_RECONCILER__CONTAINER__IMAGE", image),
    ];
    env.extend(start.env());
    env
}

/// `env` as the harness takes it.
pub fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Runs test `$name(start)` once per [`Start`], as `$name::cold`, `$name::warm` and
/// `$name::warm_exec`.
#[macro_export]
macro_rules! on_both_starts {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cold() {
                super::$name($crate::engine::Start::Cold).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn warm() {
                super::$name($crate::engine::Start::Warm).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn warm_exec() {
                super::$name($crate::engine::Start::WarmExec).await
            }
        }
    )*};
}

fn curl(engine: &str) -> std::process::Command {
    let socket = engine.strip_prefix("unix://").unwrap_or(engine);
    let mut command = std::process::Command::new("curl");
    command.args(["-sf", "--unix-socket", socket]);
    command
}

/// The engine's answer to `GET path`; empty when it answered an error (404: no such
/// container).
pub fn get(engine: &str, path: &str) -> String {
    let out = curl(engine)
        .arg(format!("http://d{path}"))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `METHOD path` on the engine's API; whether it answered 2xx.
pub fn call(engine: &str, method: &str, path: &str) -> bool {
    curl(engine)
        .args(["-X", method])
        .arg(format!("http://d{path}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `POST path` with the JSON `body`; whether it answered 2xx.
pub fn post_json(engine: &str, path: &str, body: &str) -> bool {
    curl(engine)
        .args([
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ])
        .arg(format!("http://d{path}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The ids of the containers, running or not (or running only, `running`), of the driver
/// whose state directory is `owner` (its owner label), whose name holds `name` when
/// given.
pub fn containers(engine: &str, owner: &Path, name: Option<&str>, running: bool) -> Vec<String> {
    let mut filter = format!("{{\"label\":[\"dev.runplane.owner={}\"]", owner.display());
    if let Some(name) = name {
        filter.push_str(&format!(",\"name\":[\"{name}\"]"));
    }
    filter.push('}');
    get(
        engine,
        &format!(
            "/containers/json?all={}&filters={}",
            !running,
            urlencode(&filter)
        ),
    )
    .split("\"Id\":\"")
    .skip(1)
    .filter_map(|rest| rest.split('"').next().map(str::to_owned))
    .collect()
}

/// The warm containers waiting for sandboxes of the driver whose state is `owner`.
pub fn warm_waiting(engine: &str, owner: &Path) -> Vec<String> {
    containers(engine, owner, Some("runplane-warm-"), true)
}

/// Removes every container of the driver whose state is `owner` (its warm pool above
/// all, which outlives its control plane by design). Again until none is left, for at
/// most 10 s: a paused container whose agent ends as the engine removes it may outlive
/// that removal, exited.
pub fn remove_containers_of(engine: &str, owner: &Path) {
    for _ in 0..100 {
        let left = containers(engine, owner, None, false);
        if left.is_empty() {
            return;
        }
        for id in left {
            call(engine, "DELETE", &format!("/containers/{id}?force=true"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
