//! Loss grace: one observation of what is unknown never fails a run; what is certain ends
//! it at once.
//!
//! A runner whose exit status the driver recorded (the process driver's exit file, which
//! the sandbox's shell writes when the runner returns, however it ended: a verdict, a
//! crash, a SIGKILL at an OOM) has exited for good: nothing in the sandbox runs it again.
//! That is certain, and its run ends in the round that sees it ([`Decision::ConfirmExit`]).
//! Anything else (a probe that cannot find the sandbox, a node gone silent) is unknown: the
//! first such probe only stamps `loss_observed_at`; a later probe that sees the sandbox
//! alive clears the stamp; the run is failed only when the loss outlives the grace. Every
//! one of these writes is a compare-and-set against the stamp the tick read (see
//! `store`), so a tick holding a stale snapshot loses to one that saw more recently.

use std::time::Duration;

use runplane_sandbox::Probe;

/// What the tick does with one observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Nothing,
    /// First loss observation: stamp it, fail nothing.
    StampLoss,
    /// The stamp lies in the future (a corrupt or skewed write): it could never confirm,
    /// so replace it with now.
    ReplaceStamp,
    /// Seen alive with a stamp: clear it.
    ClearLoss,
    /// The loss outlived the grace: fail the run (once, by compare-and-set on the stamp).
    ConfirmLoss,
    /// The runner's exit is recorded: it exited for good, so the run ends now (once, by
    /// compare-and-set on the stamp as read), whatever the grace.
    ConfirmExit,
}

pub fn decide(stamp_us: Option<i64>, probe: &Probe, now_us: i64, grace: Duration) -> Decision {
    match (probe, stamp_us) {
        (Probe::Exited(Some(_)), _) => Decision::ConfirmExit,
        (Probe::Alive, Some(_)) => Decision::ClearLoss,
        (Probe::Alive, None) => Decision::Nothing,
        (_, None) => Decision::StampLoss,
        (_, Some(stamp)) if stamp > now_us => Decision::ReplaceStamp,
        (_, Some(stamp)) if now_us - stamp >= grace.as_micros() as i64 => Decision::ConfirmLoss,
        (_, Some(_)) => Decision::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(90);
    const S: i64 = 1_000_000_000;

    #[test]
    fn one_observation_of_what_is_unknown_only_stamps() {
        assert_eq!(decide(None, &Probe::Lost, S, GRACE), Decision::StampLoss);
        assert_eq!(
            decide(None, &Probe::Exited(None), S, GRACE),
            Decision::StampLoss
        );
        assert_eq!(decide(None, &Probe::Alive, S, GRACE), Decision::Nothing);
    }

    #[test]
    fn the_loss_must_outlive_the_grace() {
        let stamp = S;
        let almost = S + GRACE.as_micros() as i64 - 1;
        let past = S + GRACE.as_micros() as i64;
        assert_eq!(
            decide(Some(stamp), &Probe::Lost, almost, GRACE),
            Decision::Nothing
        );
        assert_eq!(
            decide(Some(stamp), &Probe::Lost, past, GRACE),
            Decision::ConfirmLoss
        );
        assert_eq!(
            decide(Some(stamp), &Probe::Alive, past, GRACE),
            Decision::ClearLoss
        );
        assert_eq!(
            decide(Some(S + 10), &Probe::Lost, S, GRACE),
            Decision::ReplaceStamp
        );
    }

    /// A recorded exit is certain: the run ends now, with or without a stamp.
    #[test]
    fn a_recorded_exit_ends_the_run_at_once() {
        for stamp in [None, Some(S - 1), Some(S + 10)] {
            assert_eq!(
                decide(stamp, &Probe::Exited(Some(137)), S, GRACE),
                Decision::ConfirmExit
            );
        }
    }
}
