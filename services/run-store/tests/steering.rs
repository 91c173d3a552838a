//! Steering over real gRPC, on Postgres and on SQLite: interrupts, acknowledgements,
//! long polls, and what a poll answers once the run ended or the store shuts down.

#[macro_use]
mod common;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    an_interrupt_whose_poll_response_was_lost_is_served_again,
    invalid_acknowledgements_are_refused_whole,
    a_dropped_steer_writes_one_undeliverable_event,
    a_long_poll_wakes_when_a_message_is_enqueued,
    an_interrupt_on_a_queued_run_cancels_it,
    shutdown_answers_long_polls_instead_of_cutting_them,
    a_terminal_runs_poll_answers_its_state_and_pending_abort,
);

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
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
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
