//! The runner<->sandbox contract, written once: the environment a driver hands the
//! runner, the files they share in the sandbox's directory, and the park mark the agent
//! may leave. The drivers write and read one side of each item here, the runner the
//! other; neither spells a name or a format of its own.

use std::path::{Path, PathBuf};

/// The run store the runner reports to.
pub const ENV_ENDPOINT: &str = "RUNPLANE_ENDPOINT";
/// Where the stream recovery coordinator is; the run store's endpoint when unset.
pub const ENV_RECOVERY_ENDPOINT: &str = "RUNPLANE_RECOVERY_ENDPOINT";
/// The run the runner runs.
pub const ENV_RUN_ID: &str = "RUNPLANE_RUN_ID";
/// The run key, for a runner started by hand. A driver never puts it there: it sets
/// [`ENV_RUN_KEY_ON_STDIN`] and writes the key down the runner's stdin, a pipe read once
/// and closed, so it is in no environment, argv, file or log.
pub const ENV_RUN_KEY: &str = "RUNPLANE_RUN_KEY";
/// `1`: the run key is the runner's stdin, to its end (at most [`MAX_RUN_KEY_BYTES`]).
pub const ENV_RUN_KEY_ON_STDIN: &str = "RUNPLANE_RUN_KEY_ON_STDIN";
/// The most of its stdin a runner reads for its key.
pub const MAX_RUN_KEY_BYTES: u64 = 4096;
/// The arguments the driver's containment puts before the agent's command, one a line
/// (bubblewrap; see [`crate::process::Containment::wrapper`]). Unset or empty: the agent
/// runs as is.
pub const ENV_AGENT_WRAPPER: &str = "RUNPLANE_AGENT_WRAPPER";
/// The sandbox's directory under the process driver, where the runner keeps its
/// [`STEERING_MARK`] and the shell writes [`EXIT_FILE`]; unset elsewhere.
pub const ENV_SANDBOX_DIR: &str = "RUNPLANE_SANDBOX_DIR";
/// The `runplane` binary the sandbox's shell starts the runner from.
pub const ENV_BIN: &str = "RUNPLANE_BIN";
/// The W3C traceparent the runner continues (OpenTelemetry's convention for handing a
/// trace to a child process); empty when untraced.
pub const ENV_TRACEPARENT: &str = "TRACEPARENT";
/// The file the runner reads, once its agent was killed, to tell whether the kernel
/// killed it at the sandbox's memory limit: the memory cgroup's events (`oom_kill N`).
/// Unset or empty: no memory limit is enforced.
pub const ENV_MEMORY_EVENTS: &str = "RUNPLANE_MEMORY_EVENTS";
/// The file in a sandbox's directory where its containment says why the agent ended when
/// the agent's status cannot: [`ENDING_IMAGE_UNAVAILABLE`] or [`ENDING_CONTAINER_LOST`].
/// The runner reads it once its agent is gone; nothing the agent writes reaches it.
pub const ENDING_FILE: &str = "ending";
/// The container's image could not be had (not on the engine, or its pull failed).
pub const ENDING_IMAGE_UNAVAILABLE: &str = "image_unavailable";
/// The container was removed from outside while its agent ran.
pub const ENDING_CONTAINER_LOST: &str = "container_lost";
/// Where a contained agent may leave its [`PARK_MARK`], as the agent sees it.
pub const ENV_PARK: &str = "RUNPLANE_PARK";

/// The file in a sandbox's directory the sandbox's shell writes the runner's exit status
/// to, by which a driver knows the runner exited (and how) rather than vanished.
pub const EXIT_FILE: &str = "exit";

/// The directory under a sandbox's directory that is its agent's workspace.
pub const WORKSPACE_DIR: &str = "workspace";

/// Where a contained agent's workspace appears, and its home.
pub const WORKSPACE: &str = "/workspace";

/// The park mark: a file an agent creates in its workspace (`$RUNPLANE_PARK`,
/// `/workspace/.runplane-park`) to say it is waiting for input however it waits (an
/// event loop polling its stdin, say, which the syscall rule counts as working), and
/// removes when it resumes work. The runner removes it before it writes a steer, so input
/// always ends a park. Only the agent can hurt itself by it: a false park freezes its own
/// sandbox until something is sent to it or a session attaches.
pub const PARK_MARK: &str = ".runplane-park";

/// The park mark of the sandbox whose directory is `sandbox_dir`, as the host sees it.
pub fn park_mark(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(WORKSPACE_DIR).join(PARK_MARK)
}

/// The file in a sandbox's directory its runner keeps its steering polls in, as
/// [`RunnerPolls`] (outside the agent's reach).
pub const STEERING_MARK: &str = "steering";

/// A runner's steering polls, as its [`STEERING_MARK`] says: `<answered> <pending>`.
/// A node suspends an agent waiting for input only when nothing is pending, and a
/// restored one only after one more answer (it had its chance to hear what was sent
/// while it was frozen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerPolls {
    /// PollSteering answers it has had.
    pub answered: u64,
    /// Messages it was served and has not applied yet (a steer still to be written).
    pub pending: u64,
}

impl RunnerPolls {
    /// The mark's text, read whole or not at all.
    pub fn parse(mark: &str) -> Option<Self> {
        let mut fields = mark.split_whitespace().map(str::parse::<u64>);
        Some(Self {
            answered: fields.next()?.ok()?,
            pending: fields.next()?.ok()?,
        })
    }

    /// The mark's text for these polls.
    pub fn render(&self) -> String {
        format!("{} {}\n", self.answered, self.pending)
    }

    /// Replaces the mark at `path` whole (written aside, then renamed), so a reader never
    /// sees half of it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let aside = path.with_extension("new");
        std::fs::write(&aside, self.render()).and_then(|()| std::fs::rename(&aside, path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runners_steering_mark_is_read_whole_or_not_at_all() {
        assert_eq!(
            RunnerPolls::parse("3 1\n"),
            Some(RunnerPolls {
                answered: 3,
                pending: 1
            })
        );
        assert_eq!(RunnerPolls::parse("3"), None);
        assert_eq!(RunnerPolls::parse(""), None);
        assert_eq!(RunnerPolls::parse("x 0"), None);
    }

    #[test]
    fn the_mark_written_reads_back_as_written() {
        let dir = std::env::temp_dir().join(format!("runplane-mark-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(STEERING_MARK);
        let polls = RunnerPolls {
            answered: 7,
            pending: 2,
        };
        polls.write(&path).unwrap();
        let read = RunnerPolls::parse(&std::fs::read_to_string(&path).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read, Some(polls));
    }
}
