//! Fuzzing the node publications' validator (PublishSandboxState).
//!
//! A proptest property rather than a cargo-fuzz target: cargo-fuzz needs a nightly
//! toolchain and runplane builds on stable only. A failing case's seed is saved in
//! `fuzz.proptest-regressions` beside this file and replayed first on later runs.
//! `RUNPLANE_FUZZ_CASES=N` runs N cases instead of the default.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_sandbox_reconciler::grpc::check_publication;

fn cases(default: u32) -> Config {
    let cases = std::env::var("RUNPLANE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9.:_-]{1,130}",
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        any::<String>(),
    ]
}

fn number() -> impl Strategy<Value = u64> {
    prop_oneof![any::<u64>(), 0u64..4, Just(i64::MAX as u64), Just(u64::MAX)]
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn a_publication_is_checked_whole_and_fits_its_columns(
        node_id in text(),
        sandbox_id in text(),
        (epoch, execution_generation, observation_seq) in (number(), number(), number()),
        status in prop_oneof![any::<i32>(), 0i32..8],
        placed in any::<bool>(),
        exit_code in proptest::option::of(any::<i32>()),
    ) {
        let req = reconciler_pb::PublishSandboxStateRequest {
            node_id,
            epoch,
            sandbox_id,
            execution_generation,
            observation_seq,
            status,
            placed,
            exit_code,
            observed_at: None,
            waiting_for_input: None,
        };
        if let Ok((checked_epoch, observation)) = check_publication(&req) {
            prop_assert_eq!(checked_epoch as u64, epoch);
            prop_assert!(observation.generation >= 0 && observation.seq >= 0);
            prop_assert_eq!(observation.generation as u64, execution_generation);
            prop_assert!(uuid::Uuid::parse_str(observation.sandbox_id).is_ok());
        }
    }
}
