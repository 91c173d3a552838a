//! The agent command as a child process in its own process group.

use std::collections::VecDeque;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use runplane_proto::runstore::v1 as runstore_pb;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use runplane_sandbox::contract::{ENV_AGENT_WRAPPER, ENV_RUN_KEY};

/// Longest line kept as one event; the rest of a longer line is cut off.
pub const MAX_LINE_BYTES: usize = 16 << 10;
/// Output kept for the failure tail.
const TAIL_BYTES: usize = 64 << 10;

/// A running agent.
pub struct Agent {
    child: Child,
    /// Started under the sandbox's wrapper, which reports a signal death as 128 + N.
    wrapped: bool,
    control: Control,
    readers: Vec<JoinHandle<()>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// What steering may do to the agent.
#[derive(Clone, Debug)]
pub struct Control {
    pgid: Option<Pid>,
    stdin: Arc<tokio::sync::Mutex<Option<ChildStdin>>>,
    /// The reason of the operator's interrupt, once one was applied ("" when it gave none).
    interrupted: Arc<Mutex<Option<String>>>,
    exited: Arc<AtomicBool>,
}

impl Agent {
    /// Starts `command args…` with piped stdio, in a new process group, without the run
    /// key in its environment. Its output lines go to `events`, which the drain empties
    /// without waiting on the run store (see [`crate::events`]), so the pipes keep being
    /// read through an outage.
    pub fn spawn(
        command: &str,
        args: &[String],
        environment: &[(&str, String)],
        events: mpsc::Sender<runstore_pb::EventInput>,
        frames: Option<crate::frames::Frames>,
        clock: runplane_clock::SharedClock,
    ) -> std::io::Result<Self> {
        // Under the sandbox driver's wrapper (bubblewrap) when it gave one: the agent, and
        // only the agent, is contained; this runner stays outside with the run key.
        let wrapper = agent_wrapper();
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(command);
                c
            }
            None => Command::new(command),
        };
        // The agent is not the runner: it gets neither the run key nor the paths of the
        // TLS certificate and key the runner authenticates with.
        for (name, _) in std::env::vars_os() {
            let secret = name.to_str().is_some_and(|n| {
                n == ENV_RUN_KEY
                    || n == ENV_AGENT_WRAPPER
                    || n.starts_with("RUNPLANE_TLS__")
                    || n.starts_with("RUNPLANE_AUTH__")
            });
            if secret {
                command.env_remove(name);
            }
        }
        let mut child = command
            .args(args)
            .envs(environment.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let pgid = child.id().map(|id| Pid::from_raw(id as i32));
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(tokio::spawn(read_lines(
                out,
                runstore_pb::EventKind::Stdout,
                events.clone(),
                tail.clone(),
                frames.clone(),
                clock.clone(),
            )));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(tokio::spawn(read_lines(
                err,
                runstore_pb::EventKind::Stderr,
                events.clone(),
                tail.clone(),
                frames.clone(),
                clock.clone(),
            )));
        }
        tracing::info!(pid = pgid.map(|p| p.as_raw()), "agent started");
        Ok(Self {
            wrapped: !wrapper.is_empty(),
            control: Control {
                pgid,
                stdin: Arc::new(tokio::sync::Mutex::new(child.stdin.take())),
                interrupted: Arc::default(),
                exited: Arc::default(),
            },
            child,
            readers,
            tail,
        })
    }

    pub fn control(&self) -> Control {
        self.control.clone()
    }

    /// Waits for the agent to exit.
    pub async fn wait(&mut self) -> ExitStatus {
        let status = match self.child.wait().await {
            Ok(status) => status,
            Err(e) => {
                tracing::error!(error = %e, "waiting for the agent failed");
                std::os::unix::process::ExitStatusExt::from_raw(1 << 8)
            }
        };
        self.control.exited.store(true, Ordering::SeqCst);
        match status.code() {
            // bwrap exits 128 + N for an agent killed by signal N, as a shell does.
            Some(code @ 129..=192) if self.wrapped => {
                std::os::unix::process::ExitStatusExt::from_raw(code - 128)
            }
            _ => status,
        }
    }

    /// Waits until both output pipes were read to their end.
    pub async fn finish_output(&mut self) {
        for reader in self.readers.drain(..) {
            let _ = reader.await;
        }
    }

    /// The last `max` bytes of output, oldest line first.
    pub fn tail(&self, max: usize) -> String {
        let tail = self.tail.lock().expect("tail poisoned");
        let mut out = Vec::new();
        let mut size = 0;
        for line in tail.iter().rev() {
            if size + line.len() + 1 > max {
                break;
            }
            size += line.len() + 1;
            out.push(line.as_str());
        }
        out.reverse();
        out.join("\n")
    }
}

impl Control {
    /// Writes one line to the agent's stdin.
    pub async fn write_line(&self, line: &str) -> std::io::Result<()> {
        let mut stdin = self.stdin.lock().await;
        let pipe = stdin.as_mut().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stdin is closed")
        })?;
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\n');
        let written = async {
            pipe.write_all(&bytes).await?;
            pipe.flush().await
        }
        .await;
        if written.is_err() {
            *stdin = None;
        }
        written
    }

    fn signal(&self, signal: Signal) -> bool {
        match self.pgid {
            Some(pgid) if !self.exited() => killpg(pgid, signal).is_ok(),
            _ => false,
        }
    }

    /// SIGINT now, then SIGTERM and SIGKILL each after `grace` while the agent lives.
    /// Returns once SIGINT was sent (or the agent was already gone).
    pub fn interrupt(&self, grace: Duration, reason: &str) {
        self.interrupted
            .lock()
            .expect("interrupt reason poisoned")
            .get_or_insert_with(|| reason.to_owned());
        self.escalate(Signal::SIGINT, grace);
    }

    /// SIGTERM now, SIGKILL after `grace`.
    pub fn abort(&self, grace: Duration) {
        self.escalate(Signal::SIGTERM, grace);
    }

    fn escalate(&self, first: Signal, grace: Duration) {
        self.signal(first);
        let this = self.clone();
        tokio::spawn(async move {
            let rest: &[Signal] = match first {
                Signal::SIGINT => &[Signal::SIGTERM, Signal::SIGKILL],
                _ => &[Signal::SIGKILL],
            };
            for next in rest {
                tokio::time::sleep(grace).await;
                if this.exited() {
                    return;
                }
                tracing::info!(signal = %next, "agent still running after the grace; escalating");
                this.signal(*next);
            }
        });
    }

    /// The reason of the interrupt applied, if one was.
    pub fn interrupted(&self) -> Option<String> {
        self.interrupted
            .lock()
            .expect("interrupt reason poisoned")
            .clone()
    }

    pub fn exited(&self) -> bool {
        self.exited.load(Ordering::SeqCst)
    }
}

/// The arguments `RUNPLANE_AGENT_WRAPPER` puts before the agent's command, one a line.
fn agent_wrapper() -> Vec<String> {
    std::env::var(ENV_AGENT_WRAPPER)
        .map(|w| w.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

async fn read_lines(
    pipe: impl AsyncRead + Unpin,
    kind: runstore_pb::EventKind,
    events: mpsc::Sender<runstore_pb::EventInput>,
    tail: Arc<Mutex<VecDeque<String>>>,
    frames: Option<crate::frames::Frames>,
    clock: runplane_clock::SharedClock,
) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        let Ok(Some(line_bytes)) = read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES).await
        else {
            return;
        };
        let mut text = String::from_utf8_lossy(&buf).into_owned();
        // No store keeps a NUL byte in text (the run store refuses one): written as
        // U+FFFD, like the bytes that are not UTF-8.
        if text.contains('\0') {
            text = text.replace('\0', "\u{FFFD}");
        }
        if text.len() > MAX_LINE_BYTES {
            // Invalid UTF-8 or NUL replaced grows the text: cut it back on a character boundary.
            let mut cut = MAX_LINE_BYTES;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        // A cut line says so in its data, which only the runner writes: the agent's text
        // could imitate a marker, not this.
        let data = (line_bytes > buf.len()).then(|| line_cut(line_bytes));
        {
            let mut tail = tail.lock().expect("tail poisoned");
            tail.push_back(text.clone());
            let mut size: usize = tail.iter().map(String::len).sum();
            while size > TAIL_BYTES {
                size -= tail.pop_front().map(|l| l.len()).unwrap_or(size);
            }
        }
        if let Some(frames) = &frames
            && !text.is_empty()
        {
            frames.push(text.clone().into_bytes());
        }
        let event = runstore_pb::EventInput {
            kind: kind as i32,
            text,
            data,
            observed_at: Some(crate::events::observed_at(clock.as_ref())),
            ..Default::default()
        };
        // The drain's pump takes every event at once into its bounded pending buffer,
        // so this waits only while the runner itself is starved of CPU. A closed queue
        // means the run is over; keep reading so the agent is never blocked on a full
        // pipe.
        let _ = events.send(event).await;
    }
}

/// Reads one line of `reader` into `buf` (without its line break), keeping at most `max`
/// bytes of it and reading past the rest, so one endless line costs `max` bytes of
/// memory, not its length. Returns the line's whole length, or `None` at the end.
pub async fn read_bounded_line(
    reader: &mut (impl AsyncBufRead + Unpin),
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<usize>> {
    buf.clear();
    let mut length = 0usize;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok((length > 0).then_some(length));
        }
        let (chunk, ended) = match available.iter().position(|&b| b == b'\n') {
            Some(at) => (&available[..at], Some(at + 1)),
            None => (available, None),
        };
        let room = max.saturating_sub(buf.len());
        buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
        length = length.saturating_add(chunk.len());
        match ended {
            Some(used) => {
                reader.consume(used);
                return Ok(Some(length));
            }
            None => {
                let used = chunk.len();
                reader.consume(used);
            }
        }
    }
}

/// The data of an event whose line was cut: how long the whole line was.
fn line_cut(line_bytes: usize) -> prost_types::Struct {
    use prost_types::value::Kind;
    let value = |kind| prost_types::Value { kind: Some(kind) };
    prost_types::Struct {
        fields: [
            ("line_cut".to_owned(), value(Kind::BoolValue(true))),
            (
                "line_bytes".to_owned(),
                value(Kind::NumberValue(line_bytes as f64)),
            ),
        ]
        .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// One endless line costs the reader its limit, not its length; the next line is whole.
    #[tokio::test]
    async fn an_endless_line_is_cut_not_buffered() {
        let long = 64usize << 20;
        let mut reader = BufReader::new(
            tokio::io::repeat(b'x')
                .take(long as u64)
                .chain(&b"\nnext\nlast"[..]),
        );
        let mut buf = Vec::new();
        let whole = read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES)
            .await
            .unwrap();
        assert_eq!(whole, Some(long));
        assert_eq!(buf.len(), MAX_LINE_BYTES);
        assert!(
            buf.capacity() <= 2 * MAX_LINE_BYTES,
            "the reader held {} bytes for a line cut at {MAX_LINE_BYTES}",
            buf.capacity()
        );
        let next = read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES).await;
        assert_eq!((next.unwrap(), &buf[..]), (Some(4), &b"next"[..]));
        let last = read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES).await;
        assert_eq!((last.unwrap(), &buf[..]), (Some(4), &b"last"[..]));
        let end = read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES).await;
        assert_eq!(end.unwrap(), None);
    }

    #[tokio::test]
    async fn an_empty_line_is_a_line() {
        let mut reader = BufReader::new(&b"\n\nx"[..]);
        let mut buf = Vec::new();
        for want in [Some(0), Some(0), Some(1), None] {
            assert_eq!(
                read_bounded_line(&mut reader, &mut buf, 8).await.unwrap(),
                want
            );
        }
    }
}
