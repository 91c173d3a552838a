//! A sandbox's processes, found from the host by session.

use std::path::Path;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::contract::ENV_SANDBOX_DIR;
use crate::driver::DriverError;

/// How long a destroyed sandbox gets between SIGTERM and SIGKILL.
pub const DESTROY_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether `pid` names a process that has not exited (a zombie has, in all but name).
pub(super) fn alive(pid: i32) -> bool {
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

/// `(process group, pid)` of every live process in the session `sid` (a session's id is
/// its leader's pid).
pub(super) fn session_members(sid: i32) -> Vec<(i32, i32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // After the parenthesised command name: state, ppid, pgrp, session, …
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
            let state = fields.next()?;
            let pgrp: i32 = fields.nth(1)?.parse().ok()?;
            let session: i32 = fields.next()?.parse().ok()?;
            (session == sid && state != "Z" && state != "X").then_some((pgrp, pid))
        })
        .collect()
}

/// Live processes of the session `sid` that belong to the sandbox in `dir`: they carry
/// its directory in their environment (`RUNPLANE_SANDBOX_DIR`, which the agent inherits
/// from its runner), so a session id reused by something else is never hit.
fn orphans(sid: i32, dir: &Path) -> Vec<i32> {
    let mut marker = format!("{ENV_SANDBOX_DIR}={}", dir.display()).into_bytes();
    marker.push(0);
    session_members(sid)
        .into_iter()
        .map(|(_, pid)| pid)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.windows(marker.len()).any(|w| w == marker.as_slice()))
        })
        .collect()
}

/// Stops what is left of a sandbox whose session leader died: SIGTERM (and SIGCONT, should
/// it be frozen), the grace, then SIGKILL.
pub(super) async fn stop_orphans(sid: i32, dir: &Path) -> Result<(), DriverError> {
    let signal_all = |signal: Signal| {
        for pid in orphans(sid, dir) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
        }
    };
    if orphans(sid, dir).is_empty() {
        return Ok(());
    }
    tracing::info!(sid, "stopping the processes its dead sandbox left behind");
    signal_all(Signal::SIGTERM);
    signal_all(Signal::SIGCONT);
    let deadline = tokio::time::Instant::now() + DESTROY_GRACE;
    while tokio::time::Instant::now() < deadline {
        if orphans(sid, dir).is_empty() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    signal_all(Signal::SIGKILL);
    for _ in 0..20 {
        if orphans(sid, dir).is_empty() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Err(DriverError::Signal(format!(
        "processes of dead sandbox session {sid} still run after SIGKILL"
    )))
}
