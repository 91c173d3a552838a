//! The run store's behaviour over real gRPC, run once on Postgres and once on SQLite.

#[macro_use]
mod common;

use std::collections::HashSet;

use common::*;
use futures::StreamExt;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_run_store::domain::receipt::verify;
use runplane_run_store::domain::verdict::Verdict;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    a_batch_whose_response_was_lost_is_stored_once_when_replayed,
    an_interrupt_whose_poll_response_was_lost_is_served_again,
    invalid_acknowledgements_are_refused_whole,
    a_dropped_steer_writes_one_undeliverable_event,
    concurrent_different_verdicts_have_exactly_one_winner,
    a_replayed_verdict_is_already_recorded_and_a_different_one_is_refused,
    a_key_for_another_run_is_denied,
    revoked_and_unknown_keys_are_refused,
    fail_run_with_a_stale_guard_does_nothing,
    hello_is_replay_safe_per_nonce,
    create_run_is_keyed_by_client_request_id,
    bad_batches_are_refused_and_nothing_is_written,
    concurrent_appends_to_one_run_keep_order_and_chain,
    the_receipt_verifies_and_pins_the_chain,
    org_tokens_are_confined_to_their_org,
    watch_run_streams_events_and_ends_after_the_verdict,
    a_long_poll_wakes_when_a_message_is_enqueued,
    list_runs_filters_and_pages,
    an_interrupt_on_a_queued_run_cancels_it,
    mark_backend_error_is_durable_from_running_and_from_done,
    shutdown_answers_long_polls_instead_of_cutting_them,
    cancel_run_ends_the_run_once_and_replays_its_answer,
    cancel_run_refuses_bad_input_and_writes_nothing,
    a_run_past_its_deadline_ends_once_however_many_sweep,
    max_duration_out_of_range_is_refused_naming_the_field,
    a_delayed_fail_run_for_a_replaced_sandbox_leaves_the_run_alone,
    a_terminal_runs_poll_answers_its_state_and_pending_abort,
    list_runs_by_ids,
    pending_messages_are_listed_and_wake_the_reconciler_as_ends_do,
    claim_slots_fills_a_credential_to_its_capacity_oldest_first,
    concurrent_claims_never_overfill_a_credential,
    numbers_past_their_columns_are_invalid_argument_and_change_nothing,
    a_replayed_verdict_wakes_the_watchers_its_first_attempt_did_not,
);

fn slots(credential: &str, capacity: u32, unavailable: &str) -> runstore_pb::CredentialSlots {
    runstore_pb::CredentialSlots {
        credential_id: credential.into(),
        capacity,
        unavailable: unavailable.into(),
    }
}

async fn claim(h: &Harness, credentials: Vec<runstore_pb::CredentialSlots>) -> Vec<String> {
    h.operator()
        .await
        .claim_slots(runstore_pb::ClaimSlotsRequest {
            credentials,
            unlimited: false,
            max_runs: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .claimed
        .into_iter()
        .map(|r| {
            assert_eq!(r.state(), runstore_pb::RunState::Starting);
            r.id
        })
        .collect()
}

async fn claim_slots_fills_a_credential_to_its_capacity_oldest_first(h: Harness) {
    let first = h.create_run("slots-first").await;
    let second = h.create_run("slots-second").await;
    let third = h.create_run("slots-third").await;
    let cred_a = || vec![slots("cred-a", 2, "")];
    assert_eq!(
        claim(&h, cred_a()).await,
        [first.id.clone(), second.id.clone()]
    );
    let waiting = h.get_run(&third.id).await;
    assert_eq!(waiting.state(), runstore_pb::RunState::Queued);
    assert_eq!(
        waiting.waiting_reason,
        "credential cred-a is full: 2 of 2 slots busy"
    );
    let counts = h
        .operator()
        .await
        .count_active_runs(runstore_pb::CountActiveRunsRequest {
            credential_ids: vec!["cred-a".into()],
            profiles: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(counts.active_by_credential["cred-a"], 2);
    assert_eq!(counts.queued_by_credential["cred-a"], 1);
    // Claiming again changes nothing while both slots are busy.
    assert!(claim(&h, cred_a()).await.is_empty());
    // A cooling-off credential takes nothing and says why.
    assert!(
        claim(&h, vec![slots("cred-a", 5, "cooling off for 42 s")])
            .await
            .is_empty()
    );
    assert_eq!(
        h.get_run(&third.id).await.waiting_reason,
        "credential cred-a is cooling off for 42 s"
    );
    assert!(claim(&h, vec![]).await.is_empty());
    assert_eq!(
        h.get_run(&third.id).await.waiting_reason,
        "credential cred-a is not in the fleet"
    );
    // One of the two ends: its slot goes to the waiting run.
    h.operator()
        .await
        .cancel_run(cancel(&first.id, "", "cancel-frees-a-slot-1"))
        .await
        .unwrap();
    assert_eq!(claim(&h, cred_a()).await, [third.id.as_str()]);
    assert_eq!(h.get_run(&third.id).await.waiting_reason, "");
}

async fn concurrent_claims_never_overfill_a_credential(h: Harness) {
    for i in 0..10 {
        h.create_run(&format!("slots-race-{i}")).await;
    }
    let claims =
        futures::future::join_all((0..4).map(|_| claim(&h, vec![slots("cred-a", 3, "")]))).await;
    let claimed: Vec<String> = claims.into_iter().flatten().collect();
    assert_eq!(claimed.len(), 3, "{claimed:?}");
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), 3);
}

fn cancel(run_id: &str, reason: &str, key: &str) -> runstore_pb::CancelRunRequest {
    runstore_pb::CancelRunRequest {
        run_id: run_id.into(),
        reason: reason.into(),
        idempotency_key: key.into(),
    }
}

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
    let lost = |sandbox: &str, key: &str| runstore_pb::FailRunRequest {
        run_id: run_id.clone(),
        reason: "sandbox_lost".into(),
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

async fn a_terminal_runs_poll_answers_its_state_and_pending_abort(h: Harness) {
    let (run_id, key) = h.running_run("terminal-poll").await;
    let mut op = h.operator().await;
    // As the coordinator ends an exhausted run: the abort first, then the failure.
    op.enqueue_control(runstore_pb::EnqueueControlRequest {
        run_id: run_id.clone(),
        idempotency_key: format!("{run_id}:abort"),
        control: Some(runstore_pb::enqueue_control_request::Control::Abort(
            runstore_pb::AbortPayload {
                reason: "stream_recovery_exhausted".into(),
            },
        )),
    })
    .await
    .unwrap();
    op.steer(runstore_pb::SteerRequest {
        run_id: run_id.clone(),
        text: "too late".into(),
        idempotency_key: "steer-before-the-end-01".into(),
    })
    .await
    .unwrap();
    op.fail_run(runstore_pb::FailRunRequest {
        run_id: run_id.clone(),
        reason: "stream_recovery_exhausted".into(),
        message: "taken over 5 times".into(),
        idempotency_key: format!("{run_id}:recovery-exhausted"),
        if_sandbox_generation: None,
        if_sandbox_id: String::new(),
    })
    .await
    .unwrap();
    let mut runner = h.runner(&key).await;
    let answer = poll(&mut runner, &run_id, vec![]).await.unwrap();
    assert_eq!(answer.run_state(), runstore_pb::RunState::Failed);
    assert_eq!(
        answer.messages.iter().map(|m| m.kind()).collect::<Vec<_>>(),
        [runstore_pb::SteeringKind::Abort],
        "only the abort still matters"
    );
    let abort = answer.messages[0].id.clone();
    let answer = poll(&mut runner, &run_id, vec![applied(&abort)])
        .await
        .unwrap();
    assert!(
        answer.messages.is_empty(),
        "the abort is served once acknowledged"
    );
    assert_eq!(answer.run_state(), runstore_pb::RunState::Failed);
}

async fn list_runs_by_ids(h: Harness) {
    let a = h.create_run("by-id-a").await;
    let b = h.create_run("by-id-b").await;
    let _c = h.create_run("by-id-c").await;
    let mut op = h.operator().await;
    let listed = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec![a.id.clone(), b.id.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut ids: Vec<_> = listed.runs.into_iter().map(|r| r.id).collect();
    ids.sort();
    let mut want = vec![a.id, b.id];
    want.sort();
    assert_eq!(ids, want);
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec!["nope".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec![h.create_run("by-id-d").await.id; 501],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
}

/// A WaitForRuns long poll, answered in the background.
async fn wait_for_runs(h: &Harness) -> tokio::task::JoinHandle<bool> {
    let mut op = h.operator().await;
    tokio::spawn(async move {
        op.wait_for_runs(runstore_pb::WaitForRunsRequest {
            wait: Some(prost_types::Duration {
                seconds: 20,
                nanos: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .woken
    })
}

/// What the reconciler relies on to wake a parked run: a queued message wakes
/// WaitForRuns, and ListRuns names the runs whose messages are not yet acknowledged; a
/// run ending wakes WaitForRuns too (its sandboxes are destroyed at once).
async fn pending_messages_are_listed_and_wake_the_reconciler_as_ends_do(h: Harness) {
    let (steered, key) = h.running_run("pending-steered").await;
    let (quiet, _) = h.running_run("pending-quiet").await;
    let queued = h.create_run("pending-queued").await;
    let ids = vec![steered.clone(), quiet.clone(), queued.id.clone()];
    let pending = async |h: &Harness| {
        let mut listed: Vec<String> = h
            .operator()
            .await
            .list_runs(runstore_pb::ListRunsRequest {
                run_ids: ids.clone(),
                with_pending_messages: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .runs
            .into_iter()
            .map(|r| r.id)
            .collect();
        listed.sort();
        listed
    };
    assert!(pending(&h).await.is_empty());

    let waiting = wait_for_runs(&h).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "WaitForRuns answered with nothing to say"
    );
    h.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: steered.clone(),
            text: "are you there".into(),
            idempotency_key: "pending-steer-0001".into(),
        })
        .await
        .unwrap();
    assert!(
        waiting.await.unwrap(),
        "a queued message wakes the reconciler"
    );
    assert_eq!(pending(&h).await, std::slice::from_ref(&steered));

    // Served is not acknowledged: still pending until the runner says it landed.
    let mut runner = h.runner(&key).await;
    let served = poll(&mut runner, &steered, vec![]).await.unwrap();
    assert_eq!(pending(&h).await, std::slice::from_ref(&steered));
    poll(&mut runner, &steered, vec![applied(&served.messages[0].id)])
        .await
        .unwrap();
    assert!(pending(&h).await.is_empty());

    let waiting = wait_for_runs(&h).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    h.operator()
        .await
        .cancel_run(runstore_pb::CancelRunRequest {
            run_id: quiet.clone(),
            reason: String::new(),
            idempotency_key: "pending-cancel-0001".into(),
        })
        .await
        .unwrap();
    assert!(waiting.await.unwrap(), "a run's end wakes the reconciler");
}

async fn append(
    runner: &mut RunnerClient,
    run_id: &str,
    batch_key: &str,
    events: Vec<runstore_pb::EventInput>,
) -> Result<runstore_pb::AppendEventsResponse, tonic::Status> {
    runner
        .append_events(runstore_pb::AppendEventsRequest {
            run_id: run_id.into(),
            batch_key: batch_key.into(),
            events,
        })
        .await
        .map(|r| r.into_inner())
}

async fn poll(
    runner: &mut RunnerClient,
    run_id: &str,
    acks: Vec<runstore_pb::SteeringAck>,
) -> Result<runstore_pb::PollSteeringResponse, tonic::Status> {
    runner
        .poll_steering(runstore_pb::PollSteeringRequest {
            run_id: run_id.into(),
            acks,
            wait: None,
            max_messages: 0,
        })
        .await
        .map(|r| r.into_inner())
}

fn applied(id: &str) -> runstore_pb::SteeringAck {
    runstore_pb::SteeringAck {
        message_id: id.into(),
        outcome: runstore_pb::AckOutcome::Applied as i32,
        attempts: 1,
        error: String::new(),
    }
}

async fn submit(
    runner: &mut RunnerClient,
    run_id: &str,
    verdict: runstore_pb::Verdict,
) -> Result<runstore_pb::SubmitResultResponse, tonic::Status> {
    runner
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: run_id.into(),
            verdict: Some(verdict),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

async fn receipt(h: &Harness, run_id: &str) -> runstore_pb::ReceiptBody {
    let receipt = h
        .operator()
        .await
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .receipt
        .unwrap();
    verify(&receipt, &h.store.receipt_public_key()).expect("receipt verifies")
}

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

async fn an_interrupt_whose_poll_response_was_lost_is_served_again(h: Harness) {
    let (run_id, key) = h.running_run("lost-poll").await;
    let interrupt = h
        .operator()
        .await
        .interrupt(runstore_pb::InterruptRequest {
            run_id: run_id.clone(),
            reason: "operator stop".into(),
            grace: None,
            idempotency_key: "interrupt-0000000001".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let mut runner = h.runner(&key).await;

    h.cut_next("PollSteering", 1);
    assert!(poll(&mut runner, &run_id, vec![]).await.is_err());

    let again = poll(&mut runner, &run_id, vec![]).await.unwrap();
    assert_eq!(again.messages.len(), 1);
    assert_eq!(again.messages[0].id, interrupt.id);
    assert_eq!(
        again.messages[0].kind(),
        runstore_pb::SteeringKind::Interrupt
    );

    // Only the acknowledgement retires it; until then every poll serves it.
    let still = poll(&mut runner, &run_id, vec![]).await.unwrap();
    assert_eq!(still.messages[0].id, interrupt.id);
    let after_ack = poll(&mut runner, &run_id, vec![applied(&interrupt.id)])
        .await
        .unwrap();
    assert!(after_ack.messages.is_empty());
    // Acknowledging again changes nothing.
    assert!(
        poll(&mut runner, &run_id, vec![applied(&interrupt.id)])
            .await
            .unwrap()
            .messages
            .is_empty()
    );
}

async fn invalid_acknowledgements_are_refused_whole(h: Harness) {
    let (run_id, key) = h.running_run("bad-acks").await;
    let mut op = h.operator().await;
    let steer = op
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "also run lint".into(),
            idempotency_key: "steer-000000000001".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let interrupt = op
        .interrupt(runstore_pb::InterruptRequest {
            run_id: run_id.clone(),
            reason: String::new(),
            grace: None,
            idempotency_key: "interrupt-000000001".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    // A message of another run.
    let (other_run, _) = h.running_run("bad-acks-other").await;
    let foreign = op
        .steer(runstore_pb::SteerRequest {
            run_id: other_run,
            text: "x".into(),
            idempotency_key: "steer-000000000002".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let mut runner = h.runner(&key).await;

    let cases: Vec<(Vec<runstore_pb::SteeringAck>, ErrorReason)> = vec![
        (
            vec![applied(&steer.id), applied("msg_not-a-real-id")],
            ErrorReason::AckIdInvalid,
        ),
        (
            vec![
                applied(&steer.id),
                applied(&format!("msg_{}", "0".repeat(32))),
            ],
            ErrorReason::AckIdInvalid,
        ),
        (
            vec![applied(&steer.id), applied(&foreign.id)],
            ErrorReason::AckIdInvalid,
        ),
        (
            vec![
                applied(&steer.id),
                runstore_pb::SteeringAck {
                    message_id: interrupt.id.clone(),
                    outcome: runstore_pb::AckOutcome::DroppedUndeliverable as i32,
                    attempts: 3,
                    error: "child gone".into(),
                },
            ],
            ErrorReason::AckDropForbidden,
        ),
        (
            (0..33).map(|_| applied(&steer.id)).collect(),
            ErrorReason::AckIdInvalid,
        ),
        (
            vec![runstore_pb::SteeringAck {
                message_id: steer.id.clone(),
                outcome: 0,
                attempts: 1,
                error: String::new(),
            }],
            ErrorReason::AckIdInvalid,
        ),
    ];
    for (acks, expected) in cases {
        let err = poll(&mut runner, &run_id, acks).await.unwrap_err();
        assert_reason(&err, Code::InvalidArgument, expected);
        // Nothing was marked: both messages are still pending, in order.
        let pending = poll(&mut runner, &run_id, vec![]).await.unwrap();
        let ids: Vec<_> = pending.messages.iter().map(|m| m.id.clone()).collect();
        assert_eq!(ids, [steer.id.clone(), interrupt.id.clone()]);
    }
}

async fn a_dropped_steer_writes_one_undeliverable_event(h: Harness) {
    let (run_id, key) = h.running_run("drop-steer").await;
    let steer = h
        .operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "unappliable".into(),
            idempotency_key: "steer-000000000009".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let drop = runstore_pb::SteeringAck {
        message_id: steer.id.clone(),
        outcome: runstore_pb::AckOutcome::DroppedUndeliverable as i32,
        attempts: 3,
        error: "stdin closed".into(),
    };
    let mut runner = h.runner(&key).await;
    assert!(
        poll(&mut runner, &run_id, vec![drop.clone()])
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    // The replayed acknowledgement (its response lost) changes nothing.
    assert!(
        poll(&mut runner, &run_id, vec![drop])
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    let events = h.store.store().events_after(&run_id, 0, 100).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(
        events[0].kind,
        runstore_pb::EventKind::SteerUndeliverable as i32
    );
    assert!(events[0].data.contains(&steer.id));
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

async fn fail_run_with_a_stale_guard_does_nothing(h: Harness) {
    let (run_id, _) = h.running_run("guarded-fail").await;
    let current_key = h.issue_key(&run_id, 2).await;
    let mut op = h.operator().await;
    let fail = |key: &str, guard: Option<u64>| runstore_pb::FailRunRequest {
        run_id: run_id.clone(),
        reason: "sandbox_lost".into(),
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
    assert_eq!(run.failure_reason, "sandbox_lost");
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
        "sandbox_lost"
    );
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

async fn create_run_is_keyed_by_client_request_id(h: Harness) {
    let mut op = h.operator().await;
    h.cut_next("CreateRun", 1);
    assert!(op.create_run(create_request("keyed-create")).await.is_err());
    let first = op
        .create_run(create_request("keyed-create"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let again = op
        .create_run(create_request("keyed-create"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(first.id, again.id);

    let mut different = create_request("keyed-create");
    different.command = "other-agent".into();
    let err = op.create_run(different).await.unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );

    let mut bad = create_request("bad-create");
    bad.target = None;
    let err = op.create_run(bad).await.unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    assert_eq!(error_info(&err).unwrap().metadata["field"], "target");
    let listed = op
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.runs.len(), 1, "the refused request wrote nothing");
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

async fn org_tokens_are_confined_to_their_org(h: Harness) {
    let mut service = h.operator().await;
    let mut globex = create_request("globex-run");
    globex.org_id = "globex".into();
    let globex_run = service
        .create_run(globex.clone())
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();

    let mut acme = h.operator_with(ACME_TOKEN).await;
    let err = acme.create_run(globex).await.unwrap_err();
    assert_reason(&err, Code::PermissionDenied, ErrorReason::PermissionDenied);
    let err = acme
        .get_run(runstore_pb::GetRunRequest {
            run_id: globex_run.id.clone(),
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::NotFound, ErrorReason::RunNotFound);
    let acme_run = acme
        .create_run(create_request("acme-run"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let listed = acme
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed
            .runs
            .iter()
            .map(|r| r.id.as_str())
            .collect::<Vec<_>>(),
        [acme_run.id.as_str()]
    );
    let err = acme
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: acme_run.id,
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "org-token-issue-key".into(),
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::PermissionDenied, ErrorReason::PermissionDenied);

    let mut nobody = h.operator_with("not-a-token-at-all-0123456789abcdef").await;
    let err = nobody
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
}

async fn watch_run_streams_events_and_ends_after_the_verdict(h: Harness) {
    let (run_id, key) = h.running_run("watch").await;
    let mut runner = h.runner(&key).await;
    append(
        &mut runner,
        &run_id,
        "batch-watch-000001",
        vec![line("a"), line("b")],
    )
    .await
    .unwrap();
    let mut stream = h
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: 1,
            states_only: false,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
    let writer = tokio::spawn(async move {
        append(&mut runner, &run_id, "batch-watch-000002", vec![line("c")])
            .await
            .unwrap();
        submit(&mut runner, &run_id, succeeded()).await.unwrap();
    });
    use runstore_pb::watch_run_response::Update;
    let mut seen = Vec::new();
    while let Some(item) = stream.next().await {
        match item.unwrap().update.unwrap() {
            Update::Run(run) => seen.push(format!("run:{}", run.state().as_str_name())),
            Update::Event(e) => seen.push(format!("event:{}:{}", e.sequence, e.text)),
            Update::Gap(g) => seen.push(format!("gap:{}", g.from_sequence)),
            Update::Heartbeat(_) => {}
        }
    }
    writer.await.unwrap();
    assert_eq!(
        seen.first().map(String::as_str),
        Some("run:RUN_STATE_RUNNING")
    );
    assert_eq!(
        seen.last().map(String::as_str),
        Some("run:RUN_STATE_SUCCEEDED")
    );
    let events: Vec<_> = seen
        .iter()
        .filter(|s| s.starts_with("event:"))
        .cloned()
        .collect();
    assert_eq!(events, ["event:2:b", "event:3:c"]);
}

/// A SubmitResult whose first attempt committed and was dropped before it woke anyone
/// (a client deadline mid-call: the commit completes, the handler does not) is replayed
/// by the runner. The replay wakes the run's watchers, which would otherwise wait for the
/// 30 s re-check.
async fn a_replayed_verdict_wakes_the_watchers_its_first_attempt_did_not(h: Harness) {
    use runstore_pb::watch_run_response::Update;
    let (run_id, key) = h.running_run("replayed-wake").await;
    let mut stream = h
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: 0,
            states_only: true,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
    // The RUNNING snapshot: the watch has read and waits for a change.
    match stream.next().await.unwrap().unwrap().update.unwrap() {
        Update::Run(run) => assert_eq!(run.state(), runstore_pb::RunState::Running),
        other => panic!("{other:?}"),
    }
    // The first attempt: committed, nobody woken.
    let verdict = Verdict::try_from(&succeeded()).unwrap();
    let first = h
        .store
        .store()
        .submit_result(&run_id, &verdict, "", None, &h.signer)
        .await
        .unwrap();
    assert!(first.made_terminal);
    let mut runner = h.runner(&key).await;
    let replay = submit(&mut runner, &run_id, succeeded()).await.unwrap();
    assert!(replay.already_recorded);
    let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            match stream.next().await.unwrap().unwrap().update.unwrap() {
                Update::Run(run) => break run.state(),
                _ => continue,
            }
        }
    })
    .await
    .expect("the replay did not wake the watcher");
    assert_eq!(ended, runstore_pb::RunState::Succeeded);
}

async fn a_long_poll_wakes_when_a_message_is_enqueued(h: Harness) {
    let (run_id, key) = h.running_run("long-poll").await;
    let mut runner = h.runner(&key).await;
    let poller = {
        let run_id = run_id.clone();
        tokio::spawn(async move {
            runner
                .poll_steering(runstore_pb::PollSteeringRequest {
                    run_id,
                    acks: vec![],
                    wait: Some(prost_types::Duration {
                        seconds: 20,
                        nanos: 0,
                    }),
                    max_messages: 0,
                })
                .await
                .unwrap()
                .into_inner()
        })
    };
    tokio::task::yield_now().await;
    h.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id,
            text: "wake up".into(),
            idempotency_key: "steer-long-poll-0001".into(),
        })
        .await
        .unwrap();
    let answer = poller.await.unwrap();
    assert_eq!(answer.messages.len(), 1);
    assert_eq!(answer.messages[0].kind(), runstore_pb::SteeringKind::Steer);
}

async fn list_runs_filters_and_pages(h: Harness) {
    let mut op = h.operator().await;
    for i in 0..5 {
        let mut req = create_request(&format!("list-{i}"));
        if i % 2 == 0 {
            req.target = Some(runstore_pb::create_run_request::Target::Profile(
                "fast".into(),
            ));
        }
        op.create_run(req).await.unwrap();
    }
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let page = op
            .list_runs(runstore_pb::ListRunsRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(page.runs.into_iter().map(|r| r.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(ids.len(), 5);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 5);

    let fast = op
        .list_runs(runstore_pb::ListRunsRequest {
            profile: "fast".into(),
            states: vec![runstore_pb::RunState::Queued as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fast.runs.len(), 3);

    let first_page = op
        .list_runs(runstore_pb::ListRunsRequest {
            page_size: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            page_size: 2,
            profile: "fast".into(),
            page_token: first_page.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::CursorInvalid);
}

async fn an_interrupt_on_a_queued_run_cancels_it(h: Harness) {
    let run = h.create_run("cancel-queued").await;
    let answer = h
        .operator()
        .await
        .interrupt(runstore_pb::InterruptRequest {
            run_id: run.id.clone(),
            reason: "not needed".into(),
            grace: None,
            idempotency_key: "interrupt-queued-01".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.message.is_none());
    assert_eq!(
        answer.run.unwrap().state(),
        runstore_pb::RunState::Cancelled
    );
    let err = h
        .operator()
        .await
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run.id,
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "issue-after-cancel".into(),
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
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

async fn shutdown_answers_long_polls_instead_of_cutting_them(mut h: Harness) {
    let (run_id, key) = h.running_run("shutdown-poll").await;
    let mut runner = h.runner(&key).await;
    let poller = tokio::spawn(async move {
        runner
            .poll_steering(runstore_pb::PollSteeringRequest {
                run_id,
                acks: vec![],
                wait: Some(prost_types::Duration {
                    seconds: 25,
                    nanos: 0,
                }),
                max_messages: 0,
            })
            .await
    });
    // Let the poll reach its wait, then begin the shutdown (1 s grace in this harness).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // The poll is answered at once, so the shutdown drains instead of waiting out the grace.
    assert_eq!(h.shut_down().await, runplane_grpc::Stopped::Drained);
    let answer = poller.await.unwrap();
    let answer = answer.expect("the long poll is answered, not cut");
    assert!(answer.into_inner().messages.is_empty());
}

async fn numbers_past_their_columns_are_invalid_argument_and_change_nothing(h: Harness) {
    let (run_id, _) = h.running_run("numbers-past-i64").await;
    let mut op = h.operator().await;
    let field = |e: &tonic::Status| {
        assert_reason(e, Code::InvalidArgument, ErrorReason::InvalidField);
        error_info(e).unwrap().metadata["field"].clone()
    };
    let past = i64::MAX as u64 + 1;
    // A wrapped after_sequence would be negative: every event again, not a refusal.
    let watched = match op
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: past,
            states_only: false,
            heartbeat_interval: None,
        })
        .await
    {
        Err(e) => e,
        Ok(stream) => match stream.into_inner().next().await {
            Some(Err(e)) => e,
            other => panic!("watched past i64::MAX: {other:?}"),
        },
    };
    assert_eq!(field(&watched), "after_sequence");
    let e = op
        .fail_run(runstore_pb::FailRunRequest {
            run_id: run_id.clone(),
            reason: "sandbox_lost".into(),
            message: String::new(),
            idempotency_key: "fail-past-i64-max-01".into(),
            if_sandbox_generation: Some(u64::MAX),
            if_sandbox_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(field(&e), "if_sandbox_generation");
    let e = op
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run_id.clone(),
            sandbox_id: "sbx-past".into(),
            sandbox_generation: past,
            idempotency_key: "issue-past-i64-max-1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(field(&e), "sandbox_generation");
    assert_eq!(
        h.get_run(&run_id).await.state(),
        runstore_pb::RunState::Running
    );
}
