//! Fuzzing the run store's request validators and the receipt verifier.
//!
//! These are proptest properties, not cargo-fuzz targets: cargo-fuzz needs a nightly
//! toolchain (libFuzzer's sanitizer flags), and runplane builds on stable only. Each
//! property feeds arbitrary input to a pure function and asserts it answers, never panics,
//! and that what it accepts keeps the documented bounds. A failing case's seed is saved
//! in `fuzz.proptest-regressions` beside this file (committed: the regression corpus) and
//! replayed first on every later run; the first entry is the AppendEvents `observed_at`
//! overflow this found.
//!
//! The normal test run uses a few hundred cases per property (well under a second each);
//! `RUNPLANE_FUZZ_CASES=200000 cargo test -p runplane-run-store --test fuzz` runs longer.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_run_store::domain::limits::Limits;
use runplane_run_store::domain::receipt::{ReceiptSigner, verify};
use runplane_run_store::domain::validate;
use runplane_run_store::grpc::{check_acks, check_create_run};

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

/// Strings that reach the edges: empty, ASCII names, multi-byte text, long runs.
fn text(max: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[A-Za-z0-9._:-]{1,130}",
        any::<String>(),
        proptest::collection::vec(any::<char>(), 0..max).prop_map(|c| c.into_iter().collect()),
        (any::<char>(), 0..max).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
    ]
}

fn duration() -> impl Strategy<Value = prost_types::Duration> {
    (
        prop_oneof![any::<i64>(), -2i64..700_000, Just(i64::MAX), Just(i64::MIN)],
        prop_oneof![any::<i32>(), 0i32..1_000_000_000, Just(i32::MAX)],
    )
        .prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos })
}

fn create_request() -> impl Strategy<Value = runstore_pb::CreateRunRequest> {
    (
        (text(140), text(140), text(140)),
        prop_oneof![
            Just(None),
            text(140).prop_map(|p| Some(runstore_pb::create_run_request::Target::Profile(p))),
            text(140).prop_map(|c| Some(runstore_pb::create_run_request::Target::CredentialId(c))),
        ],
        text(4200),
        proptest::collection::vec(text(64), 0..260),
        proptest::collection::hash_map(text(70), text(300), 0..40),
        (
            proptest::option::of(duration()),
            proptest::option::of(prop_oneof![any::<i32>(), -2i32..12]),
        ),
    )
        .prop_map(
            |(
                (client_request_id, org_id, lead_id),
                target,
                command,
                args,
                labels,
                (max, priority),
            )| {
                runstore_pb::CreateRunRequest {
                    client_request_id,
                    org_id,
                    lead_id,
                    target,
                    command,
                    args,
                    labels: labels.into_iter().collect::<HashMap<_, _>>(),
                    max_duration: max,
                    priority,
                }
            },
        )
}

fn timestamp() -> impl Strategy<Value = prost_types::Timestamp> {
    (
        prop_oneof![
            any::<i64>(),
            Just(i64::MAX),
            Just(i64::MIN),
            0i64..2_000_000_000
        ],
        prop_oneof![any::<i32>(), 0i32..1_000_000_000],
    )
        .prop_map(|(seconds, nanos)| prost_types::Timestamp { seconds, nanos })
}

fn json_value(depth: u32) -> impl Strategy<Value = prost_types::Value> {
    use prost_types::value::Kind;
    let leaf = prop_oneof![
        Just(Kind::NullValue(0)),
        any::<f64>().prop_map(Kind::NumberValue),
        any::<bool>().prop_map(Kind::BoolValue),
        text(64).prop_map(Kind::StringValue),
        any::<i32>().prop_map(Kind::NullValue),
    ]
    .prop_map(|kind| prost_types::Value { kind: Some(kind) });
    leaf.prop_recursive(depth, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(|values| {
                prost_types::Value {
                    kind: Some(Kind::ListValue(prost_types::ListValue { values })),
                }
            }),
            proptest::collection::btree_map(text(16), inner, 0..8).prop_map(|fields| {
                prost_types::Value {
                    kind: Some(Kind::StructValue(prost_types::Struct { fields })),
                }
            }),
            Just(prost_types::Value { kind: None }),
        ]
    })
}

fn event() -> impl Strategy<Value = runstore_pb::EventInput> {
    (
        prop_oneof![any::<i32>(), 0i32..12],
        text(1200),
        proptest::option::of(proptest::collection::btree_map(
            text(16),
            json_value(4),
            0..6,
        )),
        any::<bool>(),
        text(140),
        proptest::option::of(timestamp()),
    )
        .prop_map(
            |(kind, text, data, check, name, observed_at)| runstore_pb::EventInput {
                kind,
                text,
                data: data.map(|fields| prost_types::Struct { fields }),
                check,
                name,
                observed_at,
            },
        )
}

fn ack() -> impl Strategy<Value = runstore_pb::SteeringAck> {
    (
        prop_oneof![text(40), "msg_[0-9a-f]{32}", "msg_[0-9a-fA-Fé]{30,34}",],
        prop_oneof![any::<i32>(), 0i32..4],
        any::<u32>(),
        text(600),
    )
        .prop_map(
            |(message_id, outcome, attempts, error)| runstore_pb::SteeringAck {
                message_id,
                outcome,
                attempts,
                error,
            },
        )
}

/// Small limits, so arbitrary batches cross every bound.
fn limits() -> Limits {
    Limits {
        max_batch_events: 8,
        max_batch_bytes: 4096,
        max_event_text_bytes: 512,
        ..Limits::default()
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn create_run_answers_every_request_and_keeps_its_bounds(
        req in create_request(),
        bound in prop_oneof![Just(1u32), Just(604_800u32), any::<u32>()],
    ) {
        if let Ok(checked) = check_create_run(&req, bound) {
            prop_assert!(runplane_config::is_name(&req.org_id));
            prop_assert!((1..=4096).contains(&req.command.len()));
            prop_assert!(req.args.len() <= 256 && req.args.iter().all(|a| a.len() <= 4096));
            prop_assert!(checked.labels.len() <= 32);
            prop_assert!(checked.profile.is_empty() != checked.credential_id.is_empty());
            if let Some(d) = checked.max_duration {
                prop_assert!(!d.is_zero() && d.as_secs() <= u64::from(bound));
            }
        }
    }

    #[test]
    fn append_events_answers_every_batch_and_keeps_its_bounds(
        events in proptest::collection::vec(event(), 0..12),
        allow_empty in any::<bool>(),
    ) {
        let l = limits();
        if let Ok(checked) = validate::batch(&events, &l, allow_empty) {
            prop_assert_eq!(checked.len(), events.len());
            prop_assert!(checked.len() <= l.max_batch_events as usize);
            for e in &checked {
                prop_assert!(e.text.len() <= l.max_event_text_bytes as usize);
                prop_assert!(e.data.len() <= l.max_event_text_bytes as usize);
                prop_assert!(e.name.len() <= 128);
            }
            let _ = validate::batch_digest(&checked);
        }
    }

    #[test]
    fn poll_steering_acks_are_accepted_whole_or_refused_whole(
        acks in proptest::collection::vec(ack(), 0..40),
        max in 0usize..40,
    ) {
        if let Ok(checked) = check_acks(&acks, max) {
            prop_assert_eq!(checked.len(), acks.len());
            prop_assert!(checked.len() <= max);
            prop_assert!(checked.iter().all(|a| a.attempts >= 1 && a.error.len() <= 512));
        }
    }

    #[test]
    fn the_receipt_verifier_answers_any_receipt(
        payload in proptest::collection::vec(any::<u8>(), 0..512),
        signature in proptest::collection::vec(any::<u8>(), 0..80),
        key_id in text(80),
        public_key in any::<[u8; 32]>(),
    ) {
        let receipt = runstore_pb::Receipt {
            signed_payload: payload,
            signature,
            key_id,
            ..Default::default()
        };
        let _ = verify(&receipt, &public_key);
    }

    #[test]
    fn a_receipt_changed_anywhere_does_not_verify(
        run_id in text(64),
        event_count in any::<u64>(),
        flip in any::<(usize, u8)>(),
        in_signature in any::<bool>(),
    ) {
        let signer = ReceiptSigner::from_seed([7; 32]);
        let sealed = signer.seal(runstore_pb::ReceiptBody {
            run_id,
            event_count,
            ..Default::default()
        });
        prop_assert!(verify(&sealed, &signer.public_key()).is_ok());
        let mut changed = sealed.clone();
        let bytes = if in_signature {
            &mut changed.signature
        } else {
            &mut changed.signed_payload
        };
        if !bytes.is_empty() {
            let (at, bit) = flip;
            let at = at % bytes.len();
            bytes[at] ^= 1 << (bit % 8);
            prop_assert!(verify(&changed, &signer.public_key()).is_err());
        }
    }
}
