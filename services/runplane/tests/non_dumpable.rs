//! A runner (like every long-lived runplane process) marks itself non-dumpable at start:
//! another process of its own uid cannot read its environment or memory through /proc.
//! The runner here runs as an unprivileged uid and waits for its run key on stdin; a
//! second process of that uid tries to read it.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An unprivileged uid both processes run as (`nobody`).
const UID: &str = "65534";

fn as_nobody(program: &str) -> Command {
    let mut command = Command::new("setpriv");
    command.args([
        &format!("--reuid={UID}"),
        &format!("--regid={UID}"),
        "--clear-groups",
        "--",
        program,
    ]);
    command
}

#[test]
fn a_runner_cannot_be_read_by_another_process_of_its_uid() {
    assert!(
        nix_is_root(),
        "this test runs the runner as another uid, which needs root"
    );
    let mut runner = as_nobody(env!("CARGO_BIN_EXE_runplane"))
        .arg("runner")
        .env_clear()
        .env("RUNPLANE_ENDPOINT", "http://127.0.0.1:9")
        .env("RUNPLANE_RUN_ID", "01a23635-9f69-7380-b76a-5a167cb5712a")
        .env("RUNPLANE_RUN_KEY_ON_STDIN", "1")
        .env("RUNPLANE_CANARY", "canary-4b1d")
        // Held open: the runner waits on it for its key.
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the runner under setpriv");
    let pid = runner.id();
    // Once setpriv has become the runner, the runner has marked itself and waits.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        let waiting = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
        if exe.ends_with("runplane") && !waiting.is_empty() && waiting != "0" {
            break;
        }
        assert!(Instant::now() < deadline, "the runner did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));

    let read = |what: &str| {
        as_nobody("cat")
            .arg(format!("/proc/{pid}/{what}"))
            .stdin(Stdio::null())
            .output()
            .expect("run cat as the runner's uid")
    };
    let environ = read("environ");
    let mem = read("mem");
    // The runner gets its key and, with nothing to reach at its endpoint, ends.
    let _ = runner
        .stdin
        .take()
        .unwrap()
        .write_all(b"rk_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
    let _ = runner.kill();
    let _ = runner.wait();

    assert!(
        !environ.status.success() && !String::from_utf8_lossy(&environ.stdout).contains("canary"),
        "a process of the runner's uid read its environment: {}",
        String::from_utf8_lossy(&environ.stdout)
    );
    assert!(
        String::from_utf8_lossy(&environ.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&environ.stderr)
    );
    assert!(
        !mem.status.success(),
        "a process of the runner's uid read its memory"
    );
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|ids| ids.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
