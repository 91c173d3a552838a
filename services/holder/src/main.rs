//! `runplane-holder <socket>`: pid 1 of a warm container (see the crate's docs). Built
//! static (`--target x86_64-unknown-linux-musl`) so it runs in any image.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use runplane_holder::{Answer, MAX_REQUEST_BYTES, Request};

/// The agent's pid while it runs; 0 before and after.
static AGENT: AtomicI32 = AtomicI32::new(0);
/// The engine asked the container to stop.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// `runplane-holder --exec COMMAND…`: the agent, about to start.
const EXEC: &str = "--exec";

fn main() -> ExitCode {
    let Some(socket) = std::env::args().nth(1) else {
        eprintln!("usage: runplane-holder <socket>");
        return ExitCode::from(2);
    };
    if socket == EXEC {
        return exec_agent(std::env::args().skip(2).collect());
    }
    take_stop_signals();
    let _ = std::fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("runplane-holder: binding {socket}: {e}");
            return ExitCode::from(1);
        }
    };
    // One launch: a warm container serves one sandbox.
    let launched = match listener.accept() {
        Ok((conn, _)) => launch(conn),
        Err(e) => Err(format!("accepting: {e}")),
    };
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    let (agent, conn) = match launched {
        Ok(launched) => {
            AGENT.store(launched.0.as_raw(), Ordering::SeqCst);
            launched
        }
        Err(e) => {
            eprintln!("runplane-holder: {e}");
            reap_for_ever(None)
        }
    };
    // The wrapper's signals, for the agent.
    if let Ok(mut signals) = conn.try_clone() {
        std::thread::spawn(move || {
            let mut byte = [0u8; 1];
            while let Ok(1) = signals.read(&mut byte) {
                if let Ok(signal) = Signal::try_from(i32::from(byte[0])) {
                    let _ = kill(agent, signal);
                }
            }
        });
    }
    reap_for_ever(Some((agent, conn)))
}

/// The engine's stop signals the container's pid 1 only, and pid 1 has no default
/// action: the holder takes SIGTERM, SIGINT, SIGHUP and SIGQUIT on a thread of its own
/// (blocked everywhere else; the agent starts with an empty mask, as std gives every
/// child) and passes them to the agent, so a stop gives it its grace. With no agent to
/// pass them to, the holder ends, and the container with it.
fn take_stop_signals() {
    use nix::sys::signal::SigSet;
    let mut stops = SigSet::empty();
    for signal in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        stops.add(signal);
    }
    if stops.thread_block().is_err() {
        return;
    }
    std::thread::spawn(move || {
        while let Ok(signal) = stops.wait() {
            STOPPING.store(true, Ordering::SeqCst);
            match AGENT.load(Ordering::SeqCst) {
                0 => std::process::exit(128 + signal as i32),
                agent => {
                    let _ = kill(Pid::from_raw(agent), signal);
                }
            }
        }
    });
}

/// Becomes the agent `argv` with every signal unblocked; returns only when it cannot.
fn exec_agent(argv: Vec<String>) -> ExitCode {
    if nix::sys::signal::SigSet::all().thread_unblock().is_err() {
        eprintln!("runplane-holder: unblocking the agent's signals");
        return ExitCode::from(126);
    }
    let Some((program, args)) = argv.split_first() else {
        return ExitCode::from(2);
    };
    let e = Command::new(program).args(args).exec();
    eprintln!("runplane-holder: starting {program}: {e}");
    // As a shell answers a command it cannot start.
    ExitCode::from(127)
}

/// Reads one request from `conn` and starts its agent; its pid, answered too.
fn launch(mut conn: UnixStream) -> Result<(Pid, UnixStream), String> {
    let (length, fds) = receive_header(&conn)?;
    if length > MAX_REQUEST_BYTES {
        return Err(format!("a request of {length} bytes"));
    }
    let mut bytes = vec![0u8; length as usize];
    conn.read_exact(&mut bytes)
        .map_err(|e| format!("reading the request: {e}"))?;
    let request = Request::decode(&bytes).ok_or("a request that does not decode")?;
    // The descriptors, reopened through /proc (the runner's pipes): owned files, with
    // no unsafe conversion of a raw descriptor.
    let reopen = |fd: i32, write: bool| {
        std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .open(format!("/proc/self/fd/{fd}"))
            .map_err(|e| format!("reopening descriptor {fd}: {e}"))
    };
    let stdio = (
        reopen(fds[0], false),
        reopen(fds[1], true),
        reopen(fds[2], true),
    );
    for fd in fds {
        let _ = nix::unistd::close(fd);
    }
    let (stdin, stdout, stderr) = match stdio {
        (Ok(i), Ok(o), Ok(e)) => (i, o, e),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            let _ = conn.write_all(Answer::Error(e.clone()).line().as_bytes());
            return Err(e);
        }
    };
    // Through `runplane-holder --exec`, which gives the agent the signals the holder
    // keeps to itself (a child inherits its parent's mask) before it becomes the agent.
    let mut command = Command::new("/proc/self/exe");
    command
        .arg(EXEC)
        .args(&request.argv)
        .env_clear()
        .envs(request.env.iter().filter_map(|pair| pair.split_once('=')))
        .current_dir(&request.cwd)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        // A group of its own, as the process driver's agents have.
        .process_group(0);
    match command.spawn() {
        Ok(child) => {
            let pid = child.id();
            // Reaped below, with every other process of the container.
            drop(child);
            conn.write_all(Answer::Pid(pid).line().as_bytes())
                .map_err(|e| format!("answering the pid: {e}"))?;
            Ok((Pid::from_raw(pid as i32), conn))
        }
        Err(e) => {
            let why = format!("starting {}: {e}", request.argv[0]);
            let _ = conn.write_all(Answer::Error(why.clone()).line().as_bytes());
            Err(why)
        }
    }
}

/// The request's length and the three descriptors sent with it.
fn receive_header(conn: &UnixStream) -> Result<(u32, [i32; 3]), String> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut length = [0u8; 4];
    let mut space = nix::cmsg_space!([i32; 3]);
    let mut iov = [std::io::IoSliceMut::new(&mut length)];
    let message = recvmsg::<()>(
        conn.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(|e| format!("receiving the request: {e}"))?;
    if message.bytes != 4 {
        return Err(format!("a header of {} bytes", message.bytes));
    }
    let mut fds = Vec::new();
    for cmsg in message.cmsgs().map_err(|e| e.to_string())? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            fds.extend(received);
        }
    }
    let fds: [i32; 3] = fds
        .try_into()
        .map_err(|fds: Vec<i32>| format!("{} descriptors, not 3", fds.len()))?;
    Ok((u32::from_le_bytes(length), fds))
}

/// Reaps every process of the container for as long as it lives (pid 1's duty), and
/// when `agent` ends, kills every other process of the container and answers its status
/// on its connection.
fn reap_for_ever(mut agent: Option<(Pid, UnixStream)>) -> ! {
    loop {
        match waitpid(None::<Pid>, None) {
            Ok(status) => {
                let code = match status {
                    WaitStatus::Exited(_, code) => code,
                    WaitStatus::Signaled(_, signal, _) => 128 + signal as i32,
                    _ => continue,
                };
                if let Some((pid, conn)) = &mut agent
                    && status.pid() == Some(*pid)
                {
                    // The agent's end is its sandbox's, as when a pid namespace's init
                    // ends: what it left running (holding the runner's pipes) goes too.
                    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
                    let _ = conn.write_all(Answer::Exit(code).line().as_bytes());
                    let _ = conn.flush();
                    agent = None;
                    AGENT.store(0, Ordering::SeqCst);
                    // Stopped by the engine: the container ends with its agent.
                    if STOPPING.load(Ordering::SeqCst) {
                        std::process::exit(code);
                    }
                }
            }
            // Nothing to reap now: an orphan may come later.
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(500)),
        }
    }
}
