//! What an exit status means, for `--help`: a leaf, so that `cli` and the commands that
//! declare their own subcommands (`node token …`) share it without importing each other.

/// The operator commands' rule; [`ALL_EXIT_STATUS`] adds how `runplane run` differs.
macro_rules! exit_status {
    () => {
        "Exit status:\n  \
        0  success\n  \
        1  an error from the server (printed as `error: CODE: message (REASON)`) or from I/O\n  \
        2  a usage error (an unknown command, flag or value)"
    };
}
pub const EXIT_STATUS: &str = exit_status!();
pub const ALL_EXIT_STATUS: &str = concat!(
    exit_status!(),
    "\n`runplane run` exits with the run's status instead: 0 when it succeeded, the \
    agent's exit code when it failed (1 when it has none), 130 when it was cancelled."
);
pub const RUN_EXIT_STATUS: &str = "Exit status: the run's.\n  \
    0    it succeeded\n  \
    N    it failed: the agent's exit code, 1 when it has none (a deadline, a lost sandbox)\n  \
    130  it was cancelled or interrupted\n  \
    1    also: an error from the server or from I/O before the run ended\n  \
    2    a usage error";
