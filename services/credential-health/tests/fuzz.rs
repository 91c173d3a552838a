//! Fuzzing the failure-tail classifier.
//!
//! A proptest property rather than a cargo-fuzz target: cargo-fuzz needs a nightly
//! toolchain and runplane builds on stable only. A failing case's seed is saved in
//! `fuzz.proptest-regressions` beside this file and replayed first on later runs.
//! `RUNPLANE_FUZZ_CASES=N` runs N cases instead of the default.

use proptest::prelude::*;
use proptest::test_runner::{Config as Cases, FileFailurePersistence};
use runplane_config::Config;
use runplane_credential_health::domain::profiles::{MAX_REASON_BYTES, Profiles};
use runplane_proto::credentials::v1::TurnOutcome;

fn cases(default: u32) -> Cases {
    let cases = std::env::var("RUNPLANE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Cases {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Cases::default()
    }
}

/// Patterns as operators write them: the default ones, ones that match empty or
/// multi-byte text, multi-line ones, and arbitrary text (most of which does not compile).
fn pattern() -> impl Strategy<Value = String> {
    let default = runplane_config::ProfileConfig::default();
    prop_oneof![
        Just(default.error_pattern),
        Just(default.exhausted_pattern),
        Just(String::new()),
        Just("(?s).*".to_owned()),
        Just("^$".to_owned()),
        Just("é+".to_owned()),
        Just(r"(?m)^\s*$".to_owned()),
        "[a-zA-Z .*+?|()é]{0,12}",
        any::<String>(),
    ]
}

/// Tails that look like agent output, and bytes that do not.
fn tail() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(
            prop_oneof![
                Just("API Error: No response from API".to_owned()),
                Just("Error: Your credit balance is too low".to_owned()),
                Just(String::new()),
                (any::<char>(), 0usize..700).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
                any::<String>(),
            ],
            0..12,
        )
        .prop_map(|lines| lines.join("\n")),
        (any::<char>(), 0usize..9000).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
    ]
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn every_tail_gets_one_typed_outcome_and_a_bounded_reason(
        error in pattern(),
        exhausted in pattern(),
        tail in tail(),
    ) {
        let mut config = Config::default();
        config.credential_health.profiles[0].error_pattern = error;
        config.credential_health.profiles[0].exhausted_pattern = exhausted;
        // An invalid pattern is refused at start, naming the profile; nothing to classify.
        let Ok(profiles) = Profiles::compile(&config) else {
            return Ok(());
        };
        let (outcome, reason) = profiles.all()[0].classify(&tail);
        prop_assert!(reason.len() <= MAX_REASON_BYTES);
        match outcome {
            TurnOutcome::Other => prop_assert!(reason.is_empty()),
            TurnOutcome::BackendError | TurnOutcome::BackendExhausted => {
                prop_assert!(!reason.is_empty())
            }
            TurnOutcome::Unspecified => prop_assert!(false, "never unspecified"),
        }
    }
}
