//! The runner's calls over real gRPC, on Postgres and on SQLite: Hello, appends and the
//! run key that guards them, and the receipt that pins the chain.

#[macro_use]
mod common;

use std::collections::HashSet;

use common::*;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    a_batch_whose_response_was_lost_is_stored_once_when_replayed,
    a_key_for_another_run_is_denied,
    revoked_and_unknown_keys_are_refused,
    hello_is_replay_safe_per_nonce,
    bad_batches_are_refused_and_nothing_is_written,
    concurrent_appends_to_one_run_keep_order_and_chain,
    the_receipt_verifies_and_pins_the_chain,
);

async fn a_batch_whose_response_was_lost_is_stored_once_when_replayed(h: Harness) {
    let (run_id, key) = h.running_run("lost-batch").await;
    let mut runner = h.runner(&key).await;
    let batch = vec![line("one"), check("lint"), line("three")];

    h.cut_next("AppendEvents", 1);
    let lost = append(&mut runner, &run_id, "batch-lost-response-1", batch.clone()).await;
    assert!(lost.is_err(), "the response was cut: {lost:?}");
    // The server committed before the cut.
    assert_eq!(h.get_run(&run_id).await.last_sequence, 3);

    let replay = append(&mut runner, &run_id, "batch-lost-response-1", batch)
        .await
        .expect("the replay answers like the first call would have");
    assert_eq!((replay.first_sequence, replay.last_sequence), (1, 3));
    assert_eq!(h.get_run(&run_id).await.last_sequence, 3);
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 3);

    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    let body = receipt(&h, &run_id).await;
    assert_eq!(body.event_count, 3);
    assert_eq!(body.check_events.len(), 1);
    assert_eq!(body.chain_head, replay.chain_head);
}

async fn a_key_for_another_run_is_denied(h: Harness) {
    let (run_a, key_a) = h.running_run("key-scope-a").await;
    let (run_b, _) = h.running_run("key-scope-b").await;
    let mut runner = h.runner(&key_a).await;
    let err = append(&mut runner, &run_b, "batch-wrong-run-0001", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::PermissionDenied, ErrorReason::RunKeyWrongRun);
    assert_eq!(h.get_run(&run_b).await.last_sequence, 0);
    append(&mut runner, &run_a, "batch-right-run-0001", vec![line("x")])
        .await
        .unwrap();
}

async fn revoked_and_unknown_keys_are_refused(h: Harness) {
    let (run_id, first_key) = h.running_run("revoked").await;
    let second_key = h.issue_key(&run_id, 2).await;
    let mut old = h.runner(&first_key).await;
    let err = append(&mut old, &run_id, "batch-old-generation", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::Unauthenticated, ErrorReason::RunKeyRevoked);

    let mut unknown = h.runner("rk_not-a-key-we-issued").await;
    let err = append(
        &mut unknown,
        &run_id,
        "batch-unknown-key-01",
        vec![line("x")],
    )
    .await
    .unwrap_err();
    assert_reason(&err, Code::Unauthenticated, ErrorReason::RunKeyInvalid);

    let mut current = h.runner(&second_key).await;
    current
        .hello(runstore_pb::HelloRequest {
            run_id: run_id.clone(),
            nonce: "second-generation-nonce".into(),
            runner_version: String::new(),
        })
        .await
        .unwrap();
    submit(&mut current, &run_id, succeeded()).await.unwrap();
    // Revoked by the terminal verdict: runner calls now learn the run is over.
    let err = append(
        &mut current,
        &run_id,
        "batch-after-verdict1",
        vec![line("x")],
    )
    .await
    .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    // The steering poll answers with the terminal state, so the runner stops its agent.
    let answer = poll(&mut current, &run_id, vec![]).await.unwrap();
    assert_eq!(answer.run_state(), runstore_pb::RunState::Succeeded);
    assert!(answer.messages.is_empty());
}

async fn hello_is_replay_safe_per_nonce(h: Harness) {
    let run = h.create_run("hello-nonce").await;
    let key = h.issue_key(&run.id, 1).await;
    let mut runner = h.runner(&key).await;
    let hello = |nonce: &str| runstore_pb::HelloRequest {
        run_id: run.id.clone(),
        nonce: nonce.into(),
        runner_version: "t".into(),
    };
    h.cut_next("Hello", 1);
    assert!(runner.hello(hello("instance-a-0000000001")).await.is_err());
    let first = runner
        .hello(hello("instance-a-0000000001"))
        .await
        .unwrap()
        .into_inner();
    let again = runner
        .hello(hello("instance-a-0000000001"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.claimed_at, again.claimed_at);
    assert_eq!(first.run.unwrap().state(), runstore_pb::RunState::Running);
    let err = runner
        .hello(hello("instance-b-0000000001"))
        .await
        .unwrap_err();
    assert_reason(
        &err,
        Code::FailedPrecondition,
        ErrorReason::HelloNonceMismatch,
    );
}

async fn bad_batches_are_refused_and_nothing_is_written(h: Harness) {
    let (run_id, key) = h.running_run("bad-batch").await;
    let mut runner = h.runner(&key).await;
    let too_many: Vec<_> = (0..101).map(|i| line(&i.to_string())).collect();
    let err = append(&mut runner, &run_id, "batch-too-many-0001", too_many)
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::BatchTooLarge);

    let mut malformed = vec![line("fine"), line("also fine")];
    malformed[1].kind = 0;
    let err = append(&mut runner, &run_id, "batch-malformed-0001", malformed)
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::EventMalformed);
    assert_eq!(error_info(&err).unwrap().metadata["index"], "1");

    let huge = vec![line(&"x".repeat(17 << 10))];
    let err = append(&mut runner, &run_id, "batch-huge-event-001", huge)
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::EventMalformed);

    // A NUL byte: PostgreSQL keeps no text with one (SQLite would), so both refuse it
    // as the runner's mistake, never as storage failing.
    for (field, event) in [
        ("text", line("before\0after")),
        (
            "name",
            runstore_pb::EventInput {
                name: "check\0name".into(),
                ..line("named")
            },
        ),
    ] {
        let err = append(
            &mut runner,
            &run_id,
            &format!("batch-nul-{field}-0001"),
            vec![event],
        )
        .await
        .unwrap_err();
        assert_reason(&err, Code::InvalidArgument, ErrorReason::EventMalformed);
        assert!(err.message().contains("NUL"), "{field}: {}", err.message());
    }

    let err = append(&mut runner, &run_id, "short", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);

    assert_eq!(h.get_run(&run_id).await.last_sequence, 0);
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 0);

    // The same key with other events is a reuse, not a replay.
    append(
        &mut runner,
        &run_id,
        "batch-reused-key-001",
        vec![line("a")],
    )
    .await
    .unwrap();
    let err = append(
        &mut runner,
        &run_id,
        "batch-reused-key-001",
        vec![line("b")],
    )
    .await
    .unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );
    assert_eq!(h.get_run(&run_id).await.last_sequence, 1);
}

async fn concurrent_appends_to_one_run_keep_order_and_chain(h: Harness) {
    let (run_id, key) = h.running_run("concurrent-appends").await;
    let mut tasks = Vec::new();
    for writer in 0..8 {
        let mut runner = h.runner(&key).await;
        let run_id = run_id.clone();
        tasks.push(tokio::spawn(async move {
            for batch in 0..5 {
                let events = (0..3)
                    .map(|i| line(&format!("w{writer} b{batch} e{i}")))
                    .collect();
                append(
                    &mut runner,
                    &run_id,
                    &format!("writer-{writer}-batch-{batch}-key"),
                    events,
                )
                .await
                .expect("append");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let events = h
        .store
        .store()
        .events_after(&run_id, 0, 1000)
        .await
        .unwrap();
    assert_eq!(events.len(), 120);
    assert_chain_from_genesis(&run_id, &events);
    // Each writer's batches kept their internal order.
    let texts: HashSet<_> = events.iter().map(|e| e.text.clone()).collect();
    assert_eq!(texts.len(), 120);
}

async fn the_receipt_verifies_and_pins_the_chain(h: Harness) {
    let (run_id, key) = h.running_run("receipt").await;
    let mut runner = h.runner(&key).await;
    let appended = append(
        &mut runner,
        &run_id,
        "batch-receipt-00001",
        vec![line("a"), check("tests"), line("b")],
    )
    .await
    .unwrap();
    let mut op = h.operator().await;
    let err = op
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap_err();
    assert_reason(
        &err,
        Code::FailedPrecondition,
        ErrorReason::ReceiptNotSealed,
    );

    let result = runner
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: run_id.clone(),
            verdict: Some(succeeded()),
            failure_tail: String::new(),
            final_batch_key: "batch-final-000001".into(),
            final_events: vec![check("final-check")],
        })
        .await
        .unwrap()
        .into_inner();
    let body = receipt(&h, &run_id).await;
    assert_eq!(body.event_count, 4);
    assert_eq!(
        body.check_events
            .iter()
            .map(|c| (c.sequence, c.name.as_str()))
            .collect::<Vec<_>>(),
        [(2, "tests"), (4, "final-check")]
    );
    assert_ne!(body.chain_head, appended.chain_head);
    assert_eq!(
        result.receipt.unwrap().body.unwrap().chain_head,
        body.chain_head
    );

    let key_id = body.key_id.clone();
    let public = op
        .get_receipt_public_key(runstore_pb::GetReceiptPublicKeyRequest { key_id })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(public.public_key, h.store.receipt_public_key().to_vec());
}
