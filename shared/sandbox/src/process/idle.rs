//! Whether an agent waits for input, read from `/proc`: the syscall each of its threads
//! is blocked in.

use std::path::PathBuf;

use super::procfs::session_members;

/// Whether the agent of the sandbox whose session `leader` leads is waiting for input:
/// every thread of every process of its tree is blocked either reading its stdin (the
/// pipe its runner writes steering to) or waiting for a child, and at least one reads.
///
/// Why the syscall each thread is blocked in (`/proc/<pid>/task/<tid>/syscall`) rather
/// than silence or `wchan`: an agent that thinks, waits on a model call (a socket read,
/// `poll`, `epoll_wait`) or sleeps is working, and only the syscall and its fd tell a read
/// of stdin from those; `wchan` says "a pipe read" without saying which pipe. Anything
/// unreadable or unknown counts as working, so the rule errs towards never freezing an
/// agent mid-work: an agent that waits for input some other way (an event loop polling
/// its stdin) is suspended only when it says so with its [`crate::contract::PARK_MARK`]. The agent runs in bubblewrap's pid
/// namespace, but its processes stay in the sandbox's session, so they are found from the host by
/// session, with host pids: the agent's tree is every process of the session outside the
/// leader's process group (the sandbox's shell and its runner), less bubblewrap's own
/// monitor and pid 1, which only wait.
pub fn agent_waits_for_input(leader: i32) -> bool {
    waits_for_input(
        session_members(leader)
            .into_iter()
            .filter(|(pgrp, _)| *pgrp != leader)
            .collect(),
    )
}

/// [`agent_waits_for_input`] for an agent that `runplane-holder` started in a warm
/// container: its tree is every process of the holder's session (the container's) but
/// the holder, and it holds the runner's pipe as its stdin, as a process sandbox's does.
pub fn launched_agent_waits_for_input(holder: i32) -> bool {
    waits_for_input(
        session_members(holder)
            .into_iter()
            .filter(|(_, pid)| *pid != holder)
            .collect(),
    )
}

/// Whether the agent whose processes are `agent` (`(process group, pid)`) waits for
/// input: see [`agent_waits_for_input`].
fn waits_for_input(agent: Vec<(i32, i32)>) -> bool {
    // The agent's group leader (bwrap, or the agent itself) holds the runner's pipe as
    // its stdin.
    let Some(stdin) = agent
        .iter()
        .find(|(pgrp, pid)| pgrp == pid)
        .and_then(|(_, pid)| stdin_of(*pid))
    else {
        return false;
    };
    let mut reading = false;
    for (_, pid) in agent {
        if is_bwrap(pid) {
            continue;
        }
        let Some(threads) = threads_of(pid) else {
            return false;
        };
        for tid in threads {
            match blocked_in(pid, tid) {
                Some(Blocked::ReadingStdin) if stdin_of(pid).as_ref() == Some(&stdin) => {
                    reading = true
                }
                Some(Blocked::WaitingForChild) => {}
                _ => return false,
            }
        }
    }
    reading
}

/// What a blocked thread waits for, of what [`agent_waits_for_input`] tells apart.
#[derive(Debug, PartialEq, Eq)]
enum Blocked {
    ReadingStdin,
    WaitingForChild,
    Other,
}

/// The syscall numbers of `read`, `wait4` and `waitid` on this architecture.
#[cfg(target_arch = "x86_64")]
const SYSCALLS: (u64, u64, u64) = (0, 61, 247);
#[cfg(target_arch = "aarch64")]
const SYSCALLS: (u64, u64, u64) = (63, 260, 95);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SYSCALLS: (u64, u64, u64) = (u64::MAX, u64::MAX, u64::MAX);

/// The syscall thread `tid` of `pid` is blocked in; None when it runs or is unreadable.
fn blocked_in(pid: i32, tid: i32) -> Option<Blocked> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    let mut fields = line.split_whitespace();
    // "running", or "-1 <sp> <pc>" for a thread blocked outside any syscall.
    let number: u64 = fields.next()?.parse().ok()?;
    let first_arg = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    let (read, wait4, waitid) = SYSCALLS;
    Some(match number {
        n if n == read && first_arg == 0 => Blocked::ReadingStdin,
        n if n == wait4 || n == waitid => Blocked::WaitingForChild,
        _ => Blocked::Other,
    })
}

fn threads_of(pid: i32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        tasks
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
    )
}

/// What fd 0 of `pid` is (`pipe:[inode]` for a pipe).
fn stdin_of(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/fd/0")).ok()
}

fn is_bwrap(pid: i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .is_ok_and(|exe| exe.file_name().is_some_and(|name| name == "bwrap"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt as _;
    use std::process::{Command, Stdio};

    use nix::sys::signal::{Signal, killpg};
    use nix::unistd::Pid;

    use super::*;

    /// Whether `pid`'s main thread comes to be blocked in `expected` within 2 s (a process
    /// passes through other syscalls on its way to its first blocking one).
    fn settles_in(pid: i32, expected: Blocked) -> bool {
        (0..100).any(|_| {
            let blocked = blocked_in(pid, pid);
            std::thread::sleep(std::time::Duration::from_millis(20));
            blocked.as_ref() == Some(&expected)
        })
    }

    #[test]
    fn a_read_of_stdin_a_wait_for_a_child_and_a_sleep_are_told_apart() {
        let mut reading = Command::new("sh")
            .args(["-c", "read line"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let mut waiting = Command::new("sh")
            .args(["-c", "sleep 30; true"])
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let mut sleeping = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = |c: &std::process::Child| c.id() as i32;
        let blocked = [
            settles_in(pid(&reading), Blocked::ReadingStdin),
            settles_in(pid(&waiting), Blocked::WaitingForChild),
            // Settled in its sleep, it is never taken for either.
            settles_in(pid(&sleeping), Blocked::Other)
                && (0..5).all(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    blocked_in(pid(&sleeping), pid(&sleeping)) == Some(Blocked::Other)
                }),
        ];
        // The waiting shell's sleep too.
        let _ = killpg(Pid::from_raw(waiting.id() as i32), Signal::SIGKILL);
        for child in [&mut reading, &mut waiting, &mut sleeping] {
            let _ = child.kill();
            let _ = child.wait();
        }
        assert_eq!(blocked, [true; 3], "reading, waiting, sleeping");
    }
}
