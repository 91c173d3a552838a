//! Attempts: which endings start a run's next attempt, and after how long.
//!
//! Classified by what the failure proves, on the model of Kubernetes' `podFailurePolicy`:
//! an infrastructure ending (the runner or its sandbox died without a verdict, a sandbox
//! or node lost past its grace) says nothing against the agent's work and is retried
//! while attempts remain; the agent's own failure is not, unless the profile lists its
//! exit code or retries a kill at the memory limit. Cancels, deadlines, pauses past
//! their bound, backend errors and the stream budget never come here.

use std::collections::BTreeMap;
use std::time::Duration;

use runplane_config::{ProfileConfig, RetryPolicy};

use super::verdict::{Verdict, VerdictOutcome};

/// The runner exited without a verdict (the driver saw it exit).
pub const REASON_RUNNER_EXITED: &str = "runner_exited";
/// The sandbox (or its node) was lost past the loss grace.
pub const REASON_SANDBOX_LOST: &str = "sandbox_lost";
/// The agent was killed at its sandbox's memory limit.
pub const REASON_OUT_OF_MEMORY: &str = "out_of_memory";
/// The agent exited non-zero.
pub const REASON_EXIT_NONZERO: &str = "exit_nonzero";
/// The sandbox's image could not be had (not on the engine, or its pull failed).
pub const REASON_IMAGE_UNAVAILABLE: &str = "image_unavailable";

/// Each profile's retry policy; a profile that says nothing gets the default.
#[derive(Debug, Clone, Default)]
pub struct RetryRules {
    by_profile: BTreeMap<String, RetryPolicy>,
    default: RetryPolicy,
}

impl RetryRules {
    pub fn from_profiles(profiles: &[ProfileConfig]) -> Self {
        Self {
            by_profile: profiles
                .iter()
                .filter_map(|p| Some((p.name.clone(), p.retry.clone()?)))
                .collect(),
            default: RetryPolicy::default(),
        }
    }

    /// The policy of `profile`'s runs.
    pub fn of(&self, profile: &str) -> &RetryPolicy {
        self.by_profile.get(profile).unwrap_or(&self.default)
    }
}

/// Whether `verdict`, ending attempt `attempt` (1, 2, …), starts another under `policy`.
pub fn retries(policy: &RetryPolicy, verdict: &Verdict, attempt: u32) -> bool {
    attempt < policy.max_attempts && retryable(policy, verdict)
}

/// Whether `verdict` is a failure `policy` retries at all.
pub fn retryable(policy: &RetryPolicy, verdict: &Verdict) -> bool {
    if verdict.outcome != VerdictOutcome::Failed {
        return false;
    }
    match verdict.reason.as_str() {
        REASON_RUNNER_EXITED | REASON_SANDBOX_LOST => true,
        REASON_OUT_OF_MEMORY => policy.on_out_of_memory,
        REASON_IMAGE_UNAVAILABLE => policy.on_image_unavailable,
        REASON_EXIT_NONZERO => verdict
            .exit_code
            .is_some_and(|code| policy.exit_codes.contains(&code)),
        _ => false,
    }
}

/// The wait before attempt `next` (2, 3, …): `backoff_seconds` doubling per attempt up to
/// `max_backoff_seconds`, drawn from the upper half of that (`unit` in 0..1), so runs
/// that failed together do not all come back at once.
pub fn backoff(policy: &RetryPolicy, next: u32, unit: f64) -> Duration {
    let doublings = next.saturating_sub(2).min(30);
    let full = (policy.backoff_seconds * f64::from(1u32 << doublings))
        .min(policy.max_backoff_seconds)
        .max(0.0);
    Duration::from_secs_f64(full * (0.5 + 0.5 * unit.clamp(0.0, 1.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(reason: &str, exit_code: Option<i32>) -> Verdict {
        Verdict {
            exit_code,
            ..Verdict::new(VerdictOutcome::Failed, reason, "")
        }
    }

    #[test]
    fn infrastructure_endings_are_retried_while_attempts_remain() {
        let policy = RetryPolicy::default();
        for reason in [REASON_RUNNER_EXITED, REASON_SANDBOX_LOST] {
            assert!(retries(&policy, &failed(reason, None), 1));
            assert!(retries(&policy, &failed(reason, None), 2));
            assert!(!retries(&policy, &failed(reason, None), 3), "3 is the last");
        }
    }

    #[test]
    fn the_agents_own_failure_is_not_retried_unless_listed() {
        let mut policy = RetryPolicy::default();
        let exit3 = failed(REASON_EXIT_NONZERO, Some(3));
        assert!(!retries(&policy, &exit3, 1));
        assert!(!retries(&policy, &failed(REASON_OUT_OF_MEMORY, None), 1));
        assert!(!retries(
            &policy,
            &failed(REASON_IMAGE_UNAVAILABLE, None),
            1
        ));
        assert!(!retries(&policy, &failed("deadline_exceeded", None), 1));
        assert!(!retries(&policy, &failed("backend_error", None), 1));
        assert!(!retries(
            &policy,
            &Verdict::new(VerdictOutcome::Cancelled, "cancelled", ""),
            1
        ));
        policy.exit_codes = vec![3];
        policy.on_out_of_memory = true;
        policy.on_image_unavailable = true;
        assert!(retries(&policy, &failed(REASON_IMAGE_UNAVAILABLE, None), 1));
        assert!(retries(&policy, &exit3, 1));
        assert!(!retries(&policy, &failed(REASON_EXIT_NONZERO, Some(4)), 1));
        assert!(retries(&policy, &failed(REASON_OUT_OF_MEMORY, None), 1));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_is_jittered_within_the_upper_half() {
        let policy = RetryPolicy::default();
        let full = |next| backoff(&policy, next, 1.0).as_secs_f64();
        assert_eq!(
            [full(2), full(3), full(4), full(6), full(7), full(40)],
            [1.0, 2.0, 4.0, 16.0, 30.0, 30.0]
        );
        assert_eq!(backoff(&policy, 3, 0.0).as_secs_f64(), 1.0);
        assert_eq!(backoff(&policy, 3, 0.5).as_secs_f64(), 1.5);
        let none = RetryPolicy {
            backoff_seconds: 0.0,
            max_backoff_seconds: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(backoff(&none, 5, 1.0), Duration::ZERO);
    }
}
