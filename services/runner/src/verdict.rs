//! From the agent's exit to the verdict, and what to do when the run store refuses it.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;

use crate::redact::Redactor;

/// The stable prefix of the one line written when a different verdict was recorded.
pub const DISCARDED_PREFIX: &str = "result_discarded_run_terminal";

/// The verdict of an agent that exited with `status`; `interrupted` holds the reason of
/// the operator's interrupt when one was applied, which an interrupted run's verdict
/// message carries (the exit status when the operator gave none).
pub fn of(status: ExitStatus, interrupted: Option<&str>) -> runstore_pb::Verdict {
    let (outcome, reason) = match (status.code(), interrupted.is_some()) {
        (Some(0), _) => (runstore_pb::VerdictOutcome::Succeeded, "exit_zero"),
        (_, true) => (runstore_pb::VerdictOutcome::Cancelled, "interrupted"),
        (Some(_), false) => (runstore_pb::VerdictOutcome::Failed, "exit_nonzero"),
        (None, false) => (runstore_pb::VerdictOutcome::Failed, "killed_by_signal"),
    };
    let message = match interrupted {
        Some(why) if !why.is_empty() && outcome == runstore_pb::VerdictOutcome::Cancelled => {
            why.to_owned()
        }
        _ => describe(status),
    };
    runstore_pb::Verdict {
        outcome: outcome as i32,
        reason: reason.into(),
        exit_code: status.code(),
        signal: status.signal(),
        message,
    }
}

/// The verdict of a run whose agent could not be started at all (`error`, redacted):
/// failed, `agent_not_started`. Without it, a run Hello made RUNNING would wait out the
/// loss grace for a runner that is gone.
pub fn not_started(command: &str, error: &str) -> runstore_pb::Verdict {
    let mut message = format!("could not start `{command}`: {error}");
    let mut cut = message.len().min(MAX_MESSAGE_BYTES);
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    message.truncate(cut);
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: "agent_not_started".into(),
        exit_code: None,
        signal: None,
        message,
    }
}

/// The verdict of an agent the kernel killed at its sandbox's memory limit: failed,
/// `out_of_memory`, which an infrastructure failure or a plain crash is not.
pub fn out_of_memory(status: ExitStatus) -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: "out_of_memory".into(),
        exit_code: None,
        signal: status.signal(),
        message: "killed at the sandbox's memory limit".into(),
    }
}

/// The verdict of an agent whose containment ended it for a reason of its own: failed,
/// `image_unavailable` (its container's image could not be had) or `sandbox_lost` (its
/// container was removed from outside); anything else the containment wrote is taken
/// as lost too.
pub fn ended_by_containment(ending: &str) -> runstore_pb::Verdict {
    use runplane_sandbox::contract::ENDING_IMAGE_UNAVAILABLE;
    let (reason, message) = match ending {
        ENDING_IMAGE_UNAVAILABLE => (
            "image_unavailable",
            "the sandbox's image could not be had (not on the engine, or its pull failed)",
        ),
        _ => (
            "sandbox_lost",
            "the sandbox's container was removed while its agent ran",
        ),
    };
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: reason.into(),
        exit_code: None,
        signal: None,
        message: message.into(),
    }
}

/// The longest verdict message the run store takes.
const MAX_MESSAGE_BYTES: usize = 512;

/// The verdict of an agent stopped by a service's `abort`: failed, with the abort's reason.
pub fn aborted(status: ExitStatus, reason: &str) -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: reason.to_owned(),
        exit_code: None,
        signal: status.signal(),
        message: format!("aborted ({reason}); the agent {}", describe(status)),
    }
}

pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "ended".into(),
    }
}

/// Whether SubmitResult's answer means the run store holds `verdict` (`false`: it holds
/// another, see [`handle_refusal`]); an error, redacted, when it was not recorded.
pub fn recorded<T>(
    answer: Result<T, tonic::Status>,
    run_id: &str,
    verdict: &runstore_pb::Verdict,
    redactor: &Redactor,
) -> Result<bool, String> {
    match answer {
        Ok(_) => Ok(true),
        Err(status) => {
            handle_refusal(&status, run_id, verdict, redactor).map_err(|e| redactor.redact(&e))
        }
    }
}

/// Whether `status` says the run is over for this runner: the run is terminal, or this
/// runner's attempt ended and the run went on to another (`ATTEMPT_SUPERSEDED`). Either
/// way the agent stops and nothing more is sent.
pub fn is_run_terminal(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::FailedPrecondition
        && error_info(status).is_some_and(|i| {
            i.reason == ErrorReason::RunTerminal.as_str_name()
                || i.reason == ErrorReason::AttemptSuperseded.as_str_name()
        })
}

pub fn kind_name(kind: runstore_pb::SteeringKind) -> &'static str {
    match kind {
        runstore_pb::SteeringKind::Steer => "steer",
        runstore_pb::SteeringKind::Interrupt => "interrupt",
        runstore_pb::SteeringKind::ResumeStream => "resume_stream",
        runstore_pb::SteeringKind::Abort => "abort",
        runstore_pb::SteeringKind::Unspecified => "unspecified",
    }
}

fn outcome_name(outcome: runstore_pb::VerdictOutcome) -> &'static str {
    match outcome {
        runstore_pb::VerdictOutcome::Succeeded => "succeeded",
        runstore_pb::VerdictOutcome::Failed => "failed",
        runstore_pb::VerdictOutcome::Cancelled => "cancelled",
        runstore_pb::VerdictOutcome::Unspecified => "unspecified",
    }
}

/// A refused SubmitResult. `RUN_TERMINAL` with the same verdict is success (`true`);
/// with a different one, one bounded, redacted line goes to stderr and the runner is
/// done (`false`). Anything else is an error.
pub fn handle_refusal(
    status: &tonic::Status,
    run_id: &str,
    attempted: &runstore_pb::Verdict,
    redactor: &Redactor,
) -> Result<bool, String> {
    if !is_run_terminal(status) {
        return Err(format!("{:?}: {}", status.code(), status.message()));
    }
    let metadata = error_info(status).map(|i| i.metadata).unwrap_or_default();
    let recorded = |k: &str| metadata.get(k).cloned().unwrap_or_default();
    let same = recorded("recorded_verdict_outcome") == outcome_name(attempted.outcome())
        && recorded("recorded_verdict_reason") == attempted.reason
        && recorded("recorded_exit_code")
            == attempted
                .exit_code
                .map(|c| c.to_string())
                .unwrap_or_default();
    if same {
        return Ok(true);
    }
    eprintln!(
        "{}",
        breadcrumb(run_id, attempted, status.message(), redactor)
    );
    Ok(false)
}

/// `result_discarded_run_terminal` and an allowlist of scalars, each at most 512
/// characters, the whole line redacted.
pub fn breadcrumb(
    run_id: &str,
    attempted: &runstore_pb::Verdict,
    error: &str,
    redactor: &Redactor,
) -> String {
    let bounded = |s: &str| -> String {
        let clean: String = s
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        clean.chars().take(512).collect()
    };
    let line = format!(
        "{DISCARDED_PREFIX} run_id={} attempted_outcome={} attempted_reason={} exit_status={} error={:?}",
        bounded(run_id),
        outcome_name(attempted.outcome()),
        bounded(&attempted.reason),
        attempted
            .exit_code
            .map(|c| c.to_string())
            .or_else(|| attempted.signal.map(|s| format!("signal {s}")))
            .unwrap_or_else(|| "none".into()),
        bounded(error),
    );
    redactor.redact(&line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_become_verdicts() {
        let ok = of(ExitStatus::from_raw(0), None);
        assert_eq!(
            (ok.outcome(), ok.reason.as_str(), ok.exit_code),
            (runstore_pb::VerdictOutcome::Succeeded, "exit_zero", Some(0))
        );
        let failed = of(ExitStatus::from_raw(3 << 8), None);
        assert_eq!(
            (failed.outcome(), failed.exit_code),
            (runstore_pb::VerdictOutcome::Failed, Some(3))
        );
        let killed = of(ExitStatus::from_raw(9), None);
        assert_eq!(
            (killed.reason.as_str(), killed.signal),
            ("killed_by_signal", Some(9))
        );
        let interrupted = of(ExitStatus::from_raw(2), Some(""));
        assert_eq!(
            interrupted.outcome(),
            runstore_pb::VerdictOutcome::Cancelled
        );
    }

    #[test]
    fn the_breadcrumb_is_bounded_and_redacted() {
        let redactor = Redactor::new("rk_abcdefghijklmnopqrstuvwxyz");
        let verdict = runstore_pb::Verdict {
            outcome: runstore_pb::VerdictOutcome::Failed as i32,
            reason: "x".repeat(2000),
            exit_code: Some(1),
            ..Default::default()
        };
        let line = breadcrumb(
            "run-1",
            &verdict,
            "leaked rk_abcdefghijklmnopqrstuvwxyz\nnext",
            &redactor,
        );
        assert!(
            line.starts_with("result_discarded_run_terminal run_id=run-1 attempted_outcome=failed")
        );
        assert!(!line.contains("abcdefghijklmnop"));
        assert!(!line.contains('\n'));
        assert!(!line.contains(&"x".repeat(513)));
    }
}
