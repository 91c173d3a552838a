//! The launch path of a warm container whose holder is `runplane-holder`: the wrapper
//! hands the holder its stdio (the runner's pipes) and the agent's command over a socket
//! in the sandbox's directory, and the holder starts the agent inside the container. No
//! engine call is on that path; the engine is asked only to tell a container that went
//! away (lost) from a holder that failed.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use runplane_holder::{Answer, Request};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::{AgentContainer, Failure, connect, container_name, engine_failure, lost, note_oom};

/// Runs `spec`'s agent through the holder listening on `socket`, whose pid on this host is
/// `holder_pid`; the exit status to end with.
pub(super) async fn run_launched(
    spec: &AgentContainer,
    socket: &Path,
    holder_pid: u32,
) -> Result<i32, Failure> {
    let name = container_name(&spec.sandbox_id);
    let request = Request {
        cwd: crate::contract::WORKSPACE.to_owned(),
        argv: spec.argv.clone(),
        env: spec.env(),
    }
    .encode();
    let stream = match hand_over(socket, &request) {
        Ok(stream) => stream,
        Err(e) => return Err(gone_or(spec, &name, "before its agent began", e).await),
    };
    let stream = tokio::net::UnixStream::from_std(stream)
        .map_err(|e| engine_failure(format!("the holder of {name}: {e}")))?;
    let (read, mut write) = stream.into_split();
    let mut answers = BufReader::new(read).lines();
    match answers
        .next_line()
        .await
        .ok()
        .flatten()
        .as_deref()
        .and_then(Answer::parse)
    {
        Some(Answer::Pid(_)) => {}
        Some(Answer::Error(why)) => {
            // As a shell answers a command it cannot start.
            eprintln!("runplane: {why}");
            return Ok(127);
        }
        _ => {
            let why = "the holder did not start the agent".to_owned();
            return Err(gone_or(spec, &name, "before its agent began", why).await);
        }
    }
    // The runner's signals, for the agent: one byte each.
    let signals = tokio::spawn(async move {
        let mut signals = super::RunnerSignals::new();
        while let Some(sig) = signals.next().await {
            if write.write_all(&[sig as i32 as u8]).await.is_err() {
                return;
            }
        }
    });
    let ended = answers.next_line().await.ok().flatten();
    signals.abort();
    let Some(Answer::Exit(status)) = ended.as_deref().and_then(Answer::parse) else {
        let why = "the holder closed before the agent ended".to_owned();
        return Err(gone_or(spec, &name, "while its agent ran", why).await);
    };
    // Read once the agent ended, off its start: the container's memory cgroup lives as
    // long as its holder, which outlives the agent.
    if crate::process::limits::memory_events_of(holder_pid)
        .as_deref()
        .is_some_and(crate::process::limits::oom_killed)
    {
        note_oom(spec);
    } else if status == 128 + 9 && !container_runs(spec, &name).await {
        // Killed with its container, which was stopped or removed from outside: an
        // agent that kills itself leaves its container running.
        return Err(lost(&name, "while its agent ran"));
    }
    Ok(status)
}

/// Connects to the holder and hands it this process's stdio and the request.
fn hand_over(socket: &Path, request: &[u8]) -> Result<std::os::unix::net::UnixStream, String> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let mut stream =
        connect_socket(socket).map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
    let length = (request.len() as u32).to_le_bytes();
    let fds = [
        std::io::stdin().as_raw_fd(),
        std::io::stdout().as_raw_fd(),
        std::io::stderr().as_raw_fd(),
    ];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[std::io::IoSlice::new(&length)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .map_err(|e| format!("handing the agent's stdio over: {e}"))?;
    stream
        .write_all(request)
        .map_err(|e| format!("sending the agent's command: {e}"))?;
    stream
        .set_nonblocking(true)
        .map_err(|e| format!("the holder's socket: {e}"))?;
    Ok(stream)
}

/// Connects to the socket at `path` however long the path is. A socket's address holds at
/// most 107 bytes and a state directory may be deep, so the connect goes through the
/// socket's directory held open: `/proc/self/fd/<dir>/<name>` is short whatever `path` is.
fn connect_socket(path: &Path) -> std::io::Result<std::os::unix::net::UnixStream> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::other("not a socket's path"));
    };
    let dir = std::fs::File::open(dir)?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    std::os::unix::net::UnixStream::connect(short)
}

/// The holder failed `when`: lost when its container no longer runs (stopped or
/// removed from outside; the driver started it), else the holder's failure.
async fn gone_or(spec: &AgentContainer, name: &str, when: &str, why: String) -> Failure {
    match container_runs(spec, name).await {
        false => lost(name, when),
        true => engine_failure(format!("container {name}: {why}")),
    }
}

/// Whether the engine says container `name` runs; true when it cannot say (the engine
/// unreachable is no proof the container went).
async fn container_runs(spec: &AgentContainer, name: &str) -> bool {
    match connect(&spec.engine).await {
        Ok(docker) => super::running(&docker, name).await,
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_deeper_than_an_address_holds_is_reached() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let socket = deep.join("launch.sock");
        assert!(socket.as_os_str().len() > 108, "{}", socket.display());
        // Bound the same way: a process with the directory open (the holder binds it
        // in the container, where the path is short).
        let dir = std::fs::File::open(&deep).unwrap();
        let bound = Path::new("/proc/self/fd")
            .join(dir.as_raw_fd().to_string())
            .join("launch.sock");
        let listener = std::os::unix::net::UnixListener::bind(bound).unwrap();
        let mut stream = connect_socket(&socket).unwrap();
        stream.write_all(b"x").unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        let mut byte = [0u8; 1];
        std::io::Read::read_exact(&mut accepted, &mut byte).unwrap();
        assert_eq!(&byte, b"x");
    }
}
