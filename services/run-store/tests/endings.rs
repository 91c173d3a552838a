//! How runs end, over real gRPC, on Postgres and on SQLite: verdicts, cancels, failures
//! reported by services, deadlines and backend errors, each once.

#[macro_use]
mod common;

use common::*;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    concurrent_different_verdicts_have_exactly_one_winner,
    a_replayed_verdict_is_already_recorded_and_a_different_one_is_refused,
    fail_run_with_a_stale_guard_does_nothing,
    mark_backend_error_is_durable_from_running_and_from_done,
    cancel_run_ends_the_run_once_and_replays_its_answer,
    cancel_run_refuses_bad_input_and_writes_nothing,
    a_run_past_its_deadline_ends_once_however_many_sweep,
    max_duration_out_of_range_is_refused_naming_the_field,
    a_delayed_fail_run_for_a_replaced_sandbox_leaves_the_run_alone,
);

async fn cancel_run_ends_the_run_once_and_replays_its_answer(h: Harness) {
    let (run_id, key) = h.running_run("cancel-running").await;
    let mut op = h.operator().await;
    let first = op
        .cancel_run(cancel(&run_id, "operator asked", "cancel-key-0000000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(first.state(), runstore_pb::RunState::Cancelled);
    let verdict = first.verdict.clone().unwrap();
    assert_eq!(verdict.outcome(), runstore_pb::VerdictOutcome::Cancelled);
    assert_eq!(verdict.reason, "cancelled");
    assert_eq!(verdict.message, "operator asked");
    assert_eq!(first.failure_reason, "cancelled");

    let replay = op
        .cancel_run(cancel(&run_id, "operator asked", "cancel-key-0000000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(replay.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(
        replay.ended_at, first.ended_at,
        "the replay ended nothing again"
    );

    let err = op
        .cancel_run(cancel(&run_id, "again", "cancel-key-0000000002"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    let info = error_info(&err).unwrap();
    assert_eq!(info.metadata["recorded_verdict_reason"], "cancelled");
    let err = op
        .cancel_run(cancel(&run_id, "other text", "cancel-key-0000000001"))
        .await
        .unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );

    // The guarded terminal path: key revoked for appends, receipt sealed.
    let mut runner = h.runner(&key).await;
    let err = append(
        &mut runner,
        &run_id,
        "batch-after-cancel-01",
        vec![line("x")],
    )
    .await
    .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    assert_eq!(
        receipt(&h, &run_id).await.verdict.unwrap().reason,
        "cancelled"
    );

    // A queued run is cancelled the same way, before any sandbox exists.
    let queued = h.create_run("cancel-queued").await;
    let run = op
        .cancel_run(cancel(&queued.id, "", "cancel-key-queued-001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(run.state(), runstore_pb::RunState::Cancelled);
    assert_eq!(run.verdict.unwrap().message, "cancelled by an operator");
}

async fn cancel_run_refuses_bad_input_and_writes_nothing(h: Harness) {
    let (run_id, _) = h.running_run("cancel-bad-input").await;
    let mut op = h.operator().await;
    let unknown = "0190aaaa-bbbb-7ccc-8ddd-eeeeeeeeeeee";
    let err = op
        .cancel_run(cancel(unknown, "", "cancel-unknown-run-01"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::NotFound, ErrorReason::RunNotFound);
    // Another org's token sees no such run.
    let mut other = h.operator().await;
    let theirs = other
        .create_run(runstore_pb::CreateRunRequest {
            org_id: "globex".into(),
            ..create_request("cancel-other-org")
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let mut acme = h.operator_with(ACME_TOKEN).await;
    let err = acme
        .cancel_run(cancel(&theirs.id, "", "cancel-other-org-0001"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::NotFound, ErrorReason::RunNotFound);
    let long = "x".repeat(257);
    let err = op
        .cancel_run(cancel(&run_id, &long, "cancel-long-reason-01"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    let err = op
        .cancel_run(cancel(&run_id, "", "short"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    let err = op
        .cancel_run(cancel("not-a-run", "", "cancel-bad-run-id-001"))
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    assert_eq!(
        h.get_run(&run_id).await.state(),
        runstore_pb::RunState::Running
    );
    assert_eq!(
        h.get_run(&theirs.id).await.state(),
        runstore_pb::RunState::Queued
    );
}

fn with_deadline(request_id: &str, d: prost_types::Duration) -> runstore_pb::CreateRunRequest {
    runstore_pb::CreateRunRequest {
        max_duration: Some(d),
        ..create_request(request_id)
    }
}

async fn a_run_past_its_deadline_ends_once_however_many_sweep(h: Harness) {
    let mut op = h.operator().await;
    let short = prost_types::Duration {
        seconds: 0,
        nanos: 1_000_000,
    };
    let due = op
        .create_run(with_deadline("deadline-due", short))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let deadline = due.deadline.expect("a deadline");
    let created = due.created_at.unwrap();
    assert_eq!(
        (deadline.seconds * 1_000_000_000 + i64::from(deadline.nanos))
            - (created.seconds * 1_000_000_000 + i64::from(created.nanos)),
        1_000_000,
        "deadline = created_at + max_duration"
    );
    let key = h.issue_key(&due.id, 1).await;
    let later = op
        .create_run(with_deadline(
            "deadline-later",
            prost_types::Duration {
                seconds: 3600,
                nanos: 0,
            },
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let none = h.create_run("deadline-none").await;
    assert!(none.deadline.is_none());
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;

    // Replicas sweeping at the same moment: the run ends once.
    let sweeps = futures::future::join_all((0..4).map(|_| h.store.sweep_deadlines())).await;
    let ended: u64 = sweeps.into_iter().map(|r| r.unwrap()).sum();
    assert_eq!(ended, 1);
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 0);

    let run = h.get_run(&due.id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    assert_eq!(run.failure_reason, "deadline_exceeded");
    assert_eq!(
        receipt(&h, &due.id).await.verdict.unwrap().reason,
        "deadline_exceeded"
    );
    // The runner learns it from its poll.
    let mut runner = h.runner(&key).await;
    let answer = poll(&mut runner, &due.id, vec![]).await.unwrap();
    assert_eq!(answer.run_state(), runstore_pb::RunState::Failed);
    assert_eq!(
        h.get_run(&later.id).await.state(),
        runstore_pb::RunState::Queued
    );
    assert_eq!(
        h.get_run(&none.id).await.state(),
        runstore_pb::RunState::Queued
    );
}

async fn max_duration_out_of_range_is_refused_naming_the_field(h: Harness) {
    let mut op = h.operator().await;
    for (i, d) in [
        prost_types::Duration {
            seconds: 0,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: -5,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: 0,
            nanos: -1,
        },
        prost_types::Duration {
            seconds: 7 * 24 * 3600 + 1,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: i64::MAX,
            nanos: 0,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let err = op
            .create_run(with_deadline(&format!("bad-deadline-{i}"), d))
            .await
            .unwrap_err();
        assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
        assert_eq!(error_info(&err).unwrap().metadata["field"], "max_duration");
    }
    let listed = op
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.runs.is_empty(), "nothing was written");
}

async fn a_delayed_fail_run_for_a_replaced_sandbox_leaves_the_run_alone(h: Harness) {
    let (run_id, _) = h.running_run("replaced-sandbox").await;
    // The first sandbox (sbx-test, generation 1) was lost and replaced by another sandbox,
    // which starts at generation 1 too.
    let replacement_key = h.issue_key_for(&run_id, "sbx-replacement", 1).await;
    let mut runner = h.runner(&replacement_key).await;
    runner
        .hello(runstore_pb::HelloRequest {
            run_id: run_id.clone(),
            nonce: "replacement-runner-nonce".into(),
            runner_version: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(h.get_run(&run_id).await.sandbox_id, "sbx-replacement");
    let mut op = h.operator().await;
    // A reason no retry policy covers: this is about the guard, not about attempts.
    let lost = |sandbox: &str, key: &str| runstore_pb::FailRunRequest {
        run_id: run_id.clone(),
        reason: "stream_recovery_exhausted".into(),
        message: format!("{sandbox} lost past the grace"),
        idempotency_key: key.into(),
        if_sandbox_generation: Some(1),
        if_sandbox_id: sandbox.into(),
    };
    let delayed = op
        .fail_run(lost("sbx-test", "sandbox-lost:sbx-test:1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        delayed.outcome(),
        runstore_pb::FailRunOutcome::GuardMismatch
    );
    assert_eq!(
        h.get_run(&run_id).await.state(),
        runstore_pb::RunState::Running
    );
    append(
        &mut runner,
        &run_id,
        "batch-replacement-01",
        vec![line("alive")],
    )
    .await
    .unwrap();
    let current = op
        .fail_run(lost("sbx-replacement", "sandbox-lost:sbx-replacement:1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(current.outcome(), runstore_pb::FailRunOutcome::MadeTerminal);
}

async fn concurrent_different_verdicts_have_exactly_one_winner(h: Harness) {
    for round in 0..5 {
        let (run_id, key) = h.running_run(&format!("verdict-race-{round}")).await;
        let mut a = h.runner(&key).await;
        let mut b = h.runner(&key).await;
        let (ra, rb) = tokio::join!(
            submit(&mut a, &run_id, succeeded()),
            submit(&mut b, &run_id, failed(3))
        );
        let (winner, loser, winning_verdict) = match (ra, rb) {
            (Ok(w), Err(l)) => (w, l, succeeded()),
            (Err(l), Ok(w)) => (w, l, failed(3)),
            (a, b) => panic!("round {round}: expected one winner, got {a:?} and {b:?}"),
        };
        assert!(!winner.already_recorded);
        assert_reason(&loser, Code::FailedPrecondition, ErrorReason::RunTerminal);
        let info = error_info(&loser).unwrap();
        assert_eq!(
            info.metadata["recorded_verdict_reason"],
            winning_verdict.reason
        );
        assert_eq!(
            h.get_run(&run_id).await.verdict.unwrap().reason,
            winning_verdict.reason
        );
    }
}

async fn a_replayed_verdict_is_already_recorded_and_a_different_one_is_refused(h: Harness) {
    let (run_id, key) = h.running_run("verdict-replay").await;
    let mut runner = h.runner(&key).await;
    h.cut_next("SubmitResult", 1);
    assert!(submit(&mut runner, &run_id, failed(2)).await.is_err());
    let replay = submit(&mut runner, &run_id, failed(2)).await.unwrap();
    assert!(replay.already_recorded);
    assert_eq!(replay.run.unwrap().state(), runstore_pb::RunState::Failed);
    assert!(replay.receipt.is_some());

    let err = submit(&mut runner, &run_id, succeeded()).await.unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    let info = error_info(&err).unwrap();
    assert_eq!(info.metadata["recorded_verdict_outcome"], "failed");
    assert_eq!(info.metadata["recorded_exit_code"], "2");
}

async fn fail_run_with_a_stale_guard_does_nothing(h: Harness) {
    let (run_id, _) = h.running_run("guarded-fail").await;
    let current_key = h.issue_key(&run_id, 2).await;
    let mut op = h.operator().await;
    // A reason no retry policy covers: this is about the guard, not about attempts.
    let fail = |key: &str, guard: Option<u64>| runstore_pb::FailRunRequest {
        run_id: run_id.clone(),
        reason: "stream_recovery_exhausted".into(),
        message: "lost past the grace".into(),
        idempotency_key: key.into(),
        if_sandbox_generation: guard,
        if_sandbox_id: String::new(),
    };

    let stale = op
        .fail_run(fail("fail-generation-1-lost", Some(1)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stale.outcome(), runstore_pb::FailRunOutcome::GuardMismatch);
    assert_eq!(
        h.get_run(&run_id).await.state(),
        runstore_pb::RunState::Running
    );
    // The live generation's key still works.
    let mut runner = h.runner(&current_key).await;
    runner
        .hello(runstore_pb::HelloRequest {
            run_id: run_id.clone(),
            nonce: "generation-two-nonce-01".into(),
            runner_version: String::new(),
        })
        .await
        .unwrap();

    let won = op
        .fail_run(fail("fail-generation-2-lost", Some(2)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(won.outcome(), runstore_pb::FailRunOutcome::MadeTerminal);
    let replay = op
        .fail_run(fail("fail-generation-2-lost", Some(2)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        replay.outcome(),
        runstore_pb::FailRunOutcome::MadeTerminal,
        "a replay gets the first answer"
    );
    let other = op
        .fail_run(fail("fail-again-other-key", None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        other.outcome(),
        runstore_pb::FailRunOutcome::AlreadyTerminal
    );
    let err = op
        .fail_run(fail("fail-generation-2-lost", Some(7)))
        .await
        .unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );

    let run = h.get_run(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    assert_eq!(run.failure_reason, "stream_recovery_exhausted");
    let err = append(
        &mut runner,
        &run_id,
        "batch-after-failrun1",
        vec![line("x")],
    )
    .await
    .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    assert_eq!(
        receipt(&h, &run_id).await.verdict.unwrap().reason,
        "stream_recovery_exhausted"
    );
}

async fn mark_backend_error_is_durable_from_running_and_from_done(h: Harness) {
    let mut op = h.operator().await;
    let mark = |run_id: &str, key: &str| runstore_pb::MarkBackendErrorRequest {
        run_id: run_id.into(),
        idempotency_key: key.into(),
        kind: runstore_pb::BackendErrorKind::Error as i32,
        reason: "upstream 529 overloaded".into(),
        credential_id: "cred-a".into(),
        incident_id: "inc-1".into(),
        turn_id: "turn-1".into(),
    };
    let (running, _) = h.running_run("backend-running").await;
    let marked = op
        .mark_backend_error(mark(&running, "turn-running-00001"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        marked.outcome(),
        runstore_pb::MarkBackendErrorOutcome::Marked
    );
    let run = marked.run.unwrap();
    assert_eq!(run.state(), runstore_pb::RunState::BackendError);
    assert_eq!(run.failure_reason, "upstream 529 overloaded");
    assert_eq!(
        run.backend_error.unwrap().kind(),
        runstore_pb::BackendErrorKind::Error
    );

    let (done, key) = h.running_run("backend-done").await;
    submit(&mut h.runner(&key).await, &done, failed(1))
        .await
        .unwrap();
    let marked = op
        .mark_backend_error(mark(&done, "turn-done-0000001"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        marked.outcome(),
        runstore_pb::MarkBackendErrorOutcome::Marked
    );
    assert_eq!(
        h.get_run(&done).await.state(),
        runstore_pb::RunState::BackendError
    );
    let replay = op
        .mark_backend_error(mark(&done, "turn-done-0000001"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        replay.outcome(),
        runstore_pb::MarkBackendErrorOutcome::Marked
    );
    let again = op
        .mark_backend_error(mark(&done, "turn-done-0000002"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.outcome(),
        runstore_pb::MarkBackendErrorOutcome::AlreadyMarked
    );

    let listed = op
        .list_runs(runstore_pb::ListRunsRequest {
            states: vec![runstore_pb::RunState::BackendError as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.runs.len(), 2);
}
