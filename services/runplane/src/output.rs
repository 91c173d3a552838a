//! How the operator commands show things: aligned tables, state and verdict names as the
//! CLI spells them, timestamps.

use std::io::Write;

use runplane_proto::runstore::v1 as runstore_pb;

/// Rows as columns padded to their widest cell, two spaces apart; the first row is the
/// header.
pub fn table(out: &mut impl Write, rows: &[Vec<String>]) -> std::io::Result<()> {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        writeln!(out, "{}", line.join("  ").trim_end())?;
    }
    Ok(())
}

/// `running`, `backend_error`: the name `--state` accepts.
pub fn state_name(state: runstore_pb::RunState) -> String {
    state
        .as_str_name()
        .trim_start_matches("RUN_STATE_")
        .to_lowercase()
}

/// The run's state, and its sub-states: paused (`runplane pause`), its agent waiting for
/// input: `running (paused)`, `running (waiting_for_input)`, `running (paused,
/// waiting_for_input)`.
pub fn state_of(run: &runstore_pb::Run) -> String {
    let state = state_name(run.state());
    let sub: Vec<&str> = [
        run.paused_since.is_some().then_some("paused"),
        run.waiting_for_input_since
            .is_some()
            .then_some("waiting_for_input"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if sub.is_empty() {
        state
    } else {
        format!("{state} ({})", sub.join(", "))
    }
}

/// `succeeded (exit_zero, exit code 0)`, `cancelled (cancelled: no longer needed)`.
pub fn verdict(verdict: &runstore_pb::Verdict) -> String {
    let outcome = verdict
        .outcome()
        .as_str_name()
        .trim_start_matches("VERDICT_OUTCOME_")
        .to_lowercase();
    let mut detail = verdict.reason.clone();
    if let Some(code) = verdict.exit_code {
        detail += &format!(", exit code {code}");
    }
    if let Some(signal) = verdict.signal {
        detail += &format!(", signal {signal}");
    }
    if !verdict.message.is_empty() {
        detail += &format!(": {}", verdict.message);
    }
    format!("{outcome} ({detail})")
}

/// How a run ended, as `runplane run` and `runplane logs` close: `succeeded (exit_zero,
/// exit code 0)`, `failed (deadline_exceeded): the run outlived its 2 s deadline`. The
/// verdict's message is its first line, at most [`MESSAGE_SHOWN`] characters, and left
/// out when it only restates the exit status.
pub fn ending(run: &runstore_pb::Run) -> String {
    let verdict = run.verdict.clone().unwrap_or_default();
    let exit = verdict
        .exit_code
        .map(|c| format!(", exit code {c}"))
        .unwrap_or_default();
    let message = verdict.message.lines().next().unwrap_or_default().trim();
    // A message that only restates the exit status shown already says nothing more.
    let restated = verdict
        .exit_code
        .is_some_and(|c| message == format!("exited with status {c}"))
        || verdict
            .signal
            .is_some_and(|s| message == format!("killed by signal {s}"));
    let message = if restated { "" } else { message };
    let message = match message.char_indices().nth(MESSAGE_SHOWN) {
        Some((cut, _)) => format!(": {}…", &message[..cut]),
        None if message.is_empty() => String::new(),
        None => format!(": {message}"),
    };
    format!(
        "{} ({}{exit}){message}",
        state_name(run.state()),
        verdict.reason
    )
}

/// Most characters of a verdict's message [`ending`] shows.
const MESSAGE_SHOWN: usize = 200;

/// Why a run that did not succeed ended (the roster's reason), else the verdict's reason.
/// Why a run ended, or why a queued run still waits.
pub fn reason(run: &runstore_pb::Run) -> &str {
    if !run.failure_reason.is_empty() {
        &run.failure_reason
    } else if !run.waiting_reason.is_empty() {
        &run.waiting_reason
    } else {
        run.verdict.as_ref().map_or("", |v| v.reason.as_str())
    }
}

pub fn time(t: &prost_types::Timestamp) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp(t.seconds, t.nanos.clamp(0, 999_999_999) as u32)
}

/// `2026-12-01T10:00:00Z`.
pub fn rfc3339(t: &prost_types::Timestamp) -> String {
    time(t).map_or_else(
        || "-".into(),
        |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
    )
}

/// `-` for an empty cell.
pub fn or_dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.into() }
}

/// A command line as a shell would take it back: words with anything unusual in single
/// quotes.
pub fn command_line(command: &str, args: &[String]) -> String {
    std::iter::once(command)
        .chain(args.iter().map(String::as_str))
        .map(|word| {
            let plain = !word.is_empty()
                && word
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
            if plain {
                word.to_owned()
            } else {
                format!("'{}'", word.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_read_as_one_line() {
        let v = runstore_pb::Verdict {
            outcome: runstore_pb::VerdictOutcome::Cancelled as i32,
            reason: "cancelled".into(),
            message: "no longer needed".into(),
            ..Default::default()
        };
        assert_eq!(verdict(&v), "cancelled (cancelled: no longer needed)");
        let v = runstore_pb::Verdict {
            outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
            reason: "exit_zero".into(),
            exit_code: Some(0),
            ..Default::default()
        };
        assert_eq!(verdict(&v), "succeeded (exit_zero, exit code 0)");
    }

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        assert_eq!(
            command_line("sh", &["-c".into(), "read l; echo got $l".into()]),
            "sh -c 'read l; echo got $l'"
        );
        assert_eq!(command_line("echo", &["it's".into()]), r"echo 'it'\''s'");
    }
}

#[cfg(test)]
mod ending_tests {
    use super::*;

    fn run(reason: &str, exit_code: Option<i32>, message: &str) -> runstore_pb::Run {
        runstore_pb::Run {
            state: runstore_pb::RunState::Failed as i32,
            verdict: Some(runstore_pb::Verdict {
                outcome: runstore_pb::VerdictOutcome::Failed as i32,
                reason: reason.into(),
                exit_code,
                message: message.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_message_follows_the_reason_unless_it_restates_the_exit_status() {
        assert_eq!(
            ending(&run(
                "deadline_exceeded",
                None,
                "the run outlived its 2 s deadline\nmore"
            )),
            "failed (deadline_exceeded): the run outlived its 2 s deadline"
        );
        assert_eq!(
            ending(&run("exit_nonzero", Some(7), "exited with status 7")),
            "failed (exit_nonzero, exit code 7)"
        );
        assert_eq!(ending(&run("x", None, "")), "failed (x)");
        let long = "m".repeat(300);
        assert_eq!(
            ending(&run("x", None, &long)),
            format!("failed (x): {}…", "m".repeat(200))
        );
    }
}
