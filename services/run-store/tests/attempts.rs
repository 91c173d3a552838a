//! Attempts, over real gRPC, on Postgres and on SQLite: an infrastructure ending ends the
//! attempt, not the run; the next attempt's key waits out the backoff; the earlier
//! attempt's key and late verdict are refused `ATTEMPT_SUPERSEDED` (the verdict recorded);
//! the last attempt ends the run with the attempt count; the agent's own failure is not
//! retried unless the profile lists its exit code; the receipt lists the attempts.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Attempts::start =>
    a_lost_sandbox_ends_the_attempt_and_the_next_runs_after_its_backoff,
    the_last_attempt_ends_the_run_and_the_receipt_lists_every_attempt,
    the_agents_own_failure_ends_the_run_unless_its_exit_code_is_listed,
    a_cancel_in_the_backoff_ends_the_run_and_no_attempt_starts,
    a_retry_that_could_not_start_before_the_deadline_ends_the_run,
    steers_not_acknowledged_by_an_attempt_reach_the_next,
);

/// Profiles `retry-3` (an agent exiting 3 is retried) and `once` (never retried), on a
/// clock the test moves; runs naming the credential get the default (3 attempts, 1 s
/// doubling to 30 s).
fn configure(config: &mut runplane_config::Config) {
    let profile =
        |name: &str, retry: runplane_config::RetryPolicy| runplane_config::ProfileConfig {
            name: name.into(),
            credential_id: "cred-a".into(),
            retry: Some(retry),
            ..Default::default()
        };
    config.credential_health.profiles = vec![
        profile(
            "retry-3",
            runplane_config::RetryPolicy {
                exit_codes: vec![3],
                ..Default::default()
            },
        ),
        profile(
            "once",
            runplane_config::RetryPolicy {
                max_attempts: 1,
                ..Default::default()
            },
        ),
    ];
}

struct Attempts;

impl Attempts {
    async fn start(backend: Backend) -> Harness {
        Harness::start_manual(backend, configure).await
    }
}

fn lost(run_id: &str, sandbox: &str, generation: u64) -> runstore_pb::FailRunRequest {
    runstore_pb::FailRunRequest {
        run_id: run_id.into(),
        reason: "sandbox_lost".into(),
        message: format!("sandbox {sandbox} lost past the grace"),
        idempotency_key: format!("sandbox-lost:{sandbox}:{generation}"),
        if_sandbox_generation: Some(generation),
        if_sandbox_id: sandbox.into(),
    }
}

/// IssueRunKey for `attempt` of `run_id` in `sandbox`, generation 1, on `node`.
async fn key_for(
    h: &Harness,
    run_id: &str,
    sandbox: &str,
    attempt: u32,
) -> Result<String, tonic::Status> {
    h.operator()
        .await
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run_id.into(),
            sandbox_id: sandbox.into(),
            sandbox_generation: 1,
            idempotency_key: format!("{sandbox}:1:issued-key"),
            attempt,
            node_id: format!("node-of-{sandbox}"),
        })
        .await
        .map(|r| r.into_inner().run_key)
}

async fn hello(h: &Harness, run_id: &str, key: &str) -> runstore_pb::HelloResponse {
    h.runner(key)
        .await
        .hello(runstore_pb::HelloRequest {
            run_id: run_id.into(),
            nonce: format!("nonce-{}", &key[key.len() - 12..]),
            runner_version: "test".into(),
        })
        .await
        .expect("hello")
        .into_inner()
}

/// A run through `profile` (empty: naming the credential) whose attempt 1 runs in
/// `sbx-1`; returns its id and attempt 1's key.
async fn running(h: &Harness, request_id: &str, profile: &str) -> (String, String) {
    let mut request = create_request(request_id);
    if !profile.is_empty() {
        request.target = Some(runstore_pb::create_run_request::Target::Profile(
            profile.into(),
        ));
    }
    running_as(h, request).await
}

/// The run `request` creates, its attempt 1 running in `sbx-1`; its id and the key.
async fn running_as(h: &Harness, request: runstore_pb::CreateRunRequest) -> (String, String) {
    let run = h
        .operator()
        .await
        .create_run(request)
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = key_for(h, &run.id, "sbx-1", 0).await.unwrap();
    let answer = hello(h, &run.id, &key).await;
    assert_eq!(
        (answer.attempt, answer.previous_attempt_reason.as_str()),
        (1, "")
    );
    (run.id, key)
}

async fn events_of(
    h: &Harness,
    run_id: &str,
) -> Vec<runplane_run_store::store::entities::event::Model> {
    h.store
        .store()
        .events_after(run_id, 0, 10_000)
        .await
        .unwrap()
}

async fn a_lost_sandbox_ends_the_attempt_and_the_next_runs_after_its_backoff(h: Harness) {
    let (run_id, first_key) = running(&h, "attempt-lost", "").await;
    let mut first = h.runner(&first_key).await;
    append(
        &mut first,
        &run_id,
        "batch-attempt-1-0001",
        vec![line("one")],
    )
    .await
    .unwrap();
    let mut op = h.operator().await;
    let answer = op
        .fail_run(lost(&run_id, "sbx-1", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.outcome(), runstore_pb::FailRunOutcome::AttemptEnded);
    let run = h.get_run(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Starting, "{run:?}");
    assert_eq!((run.attempt, run.sandbox_id.as_str()), (2, ""));
    assert!(run.retry_at.is_some(), "{run:?}");
    // A replay of the same FailRun gets the same answer and ends nothing more.
    let replay = op
        .fail_run(lost(&run_id, "sbx-1", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(replay.outcome(), runstore_pb::FailRunOutcome::AttemptEnded);
    assert_eq!(h.get_run(&run_id).await.attempt, 2);

    // Attempt 1's runner is done for: its calls are refused, its late verdict recorded.
    let refused = append(&mut first, &run_id, "batch-attempt-1-0002", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(
        &refused,
        Code::FailedPrecondition,
        ErrorReason::AttemptSuperseded,
    );
    let late = submit(&mut first, &run_id, succeeded()).await.unwrap_err();
    assert_reason(
        &late,
        Code::FailedPrecondition,
        ErrorReason::AttemptSuperseded,
    );
    assert_eq!(error_info(&late).unwrap().metadata["current_attempt"], "2");

    // The next attempt's key waits out the backoff; attempt 1 gets no key again.
    let early = key_for(&h, &run_id, "sbx-2", 2).await.unwrap_err();
    assert_reason(&early, Code::Unavailable, ErrorReason::RetryBackoff);
    let stale = key_for(&h, &run_id, "sbx-old", 1).await.unwrap_err();
    assert_reason(
        &stale,
        Code::FailedPrecondition,
        ErrorReason::AttemptSuperseded,
    );
    h.advance(Duration::from_secs(2));
    let second_key = key_for(&h, &run_id, "sbx-2", 2).await.unwrap();
    let answer = hello(&h, &run_id, &second_key).await;
    assert_eq!(
        (answer.attempt, answer.previous_attempt_reason.as_str()),
        (2, "sandbox_lost")
    );
    let mut second = h.runner(&second_key).await;
    append(
        &mut second,
        &run_id,
        "batch-attempt-2-0001",
        vec![line("two")],
    )
    .await
    .unwrap();
    // FailRun for attempt 1's sandbox, delayed: the guard no longer holds.
    let delayed = op
        .fail_run(runstore_pb::FailRunRequest {
            idempotency_key: "runner-exited:sbx-1:1".into(),
            reason: "runner_exited".into(),
            ..lost(&run_id, "sbx-1", 1)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        delayed.outcome(),
        runstore_pb::FailRunOutcome::GuardMismatch
    );
    let done = submit(&mut second, &run_id, succeeded()).await.unwrap();
    assert_eq!(done.run.unwrap().state(), runstore_pb::RunState::Succeeded);

    // One chain: attempt 1's line, its end, attempt 2's start, attempt 2's line.
    let events = events_of(&h, &run_id).await;
    let kinds: Vec<(i32, String)> = events.iter().map(|e| (e.kind, e.text.clone())).collect();
    assert_eq!(
        kinds,
        [
            (runstore_pb::EventKind::Stdout as i32, "one".into()),
            (runstore_pb::EventKind::AttemptEnded as i32, String::new()),
            (runstore_pb::EventKind::AttemptStarted as i32, String::new()),
            (runstore_pb::EventKind::Stdout as i32, "two".into()),
        ]
    );
    assert_chain_from_genesis(&run_id, &events);
    let ended: serde_json::Value = serde_json::from_str(&events[1].data).unwrap();
    assert_eq!(
        (ended["attempt"].as_u64(), ended["reason"].as_str()),
        (Some(1), Some("sandbox_lost"))
    );
    let started: serde_json::Value = serde_json::from_str(&events[2].data).unwrap();
    assert_eq!(
        (started["attempt"].as_u64(), started["sandbox_id"].as_str()),
        (Some(2), Some("sbx-2"))
    );

    let run = h.get_run(&run_id).await;
    let attempts: Vec<(u32, &str, &str, &str)> = run
        .attempts
        .iter()
        .map(|a| {
            (
                a.number,
                a.sandbox_id.as_str(),
                a.end_reason.as_str(),
                a.superseded_verdict.as_str(),
            )
        })
        .collect();
    assert_eq!(
        attempts,
        [
            (1, "sbx-1", "sandbox_lost", "succeeded exit_zero"),
            (2, "sbx-2", "exit_zero", ""),
        ]
    );
    assert_eq!(run.attempts[1].node_id, "node-of-sbx-2");
    assert!(run.retry_at.is_none());
}

async fn the_last_attempt_ends_the_run_and_the_receipt_lists_every_attempt(h: Harness) {
    let (run_id, _) = running(&h, "attempt-last", "").await;
    let mut op = h.operator().await;
    for attempt in 2..=3u32 {
        let previous = format!("sbx-{}", attempt - 1);
        let answer = op
            .fail_run(lost(&run_id, &previous, 1))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.outcome(), runstore_pb::FailRunOutcome::AttemptEnded);
        h.advance(Duration::from_secs(30));
        let key = key_for(&h, &run_id, &format!("sbx-{attempt}"), attempt)
            .await
            .unwrap();
        hello(&h, &run_id, &key).await;
    }
    let last = op
        .fail_run(lost(&run_id, "sbx-3", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(last.outcome(), runstore_pb::FailRunOutcome::MadeTerminal);
    let run = last.run.unwrap();
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    assert_eq!(run.attempt, 3);
    assert_eq!(run.verdict.unwrap().reason, "sandbox_lost");
    let body = receipt(&h, &run_id).await;
    let listed: Vec<(u32, String, String)> = body
        .attempts
        .iter()
        .map(|a| (a.number, a.sandbox_id.clone(), a.end_reason.clone()))
        .collect();
    assert_eq!(
        listed,
        (1..=3)
            .map(|n| (n, format!("sbx-{n}"), "sandbox_lost".to_owned()))
            .collect::<Vec<_>>()
    );
}

async fn the_agents_own_failure_ends_the_run_unless_its_exit_code_is_listed(h: Harness) {
    // exit 2 on the default policy: the agent's own failure ends the run.
    let (plain, key) = running(&h, "attempt-exit-2", "").await;
    let answer = submit(&mut h.runner(&key).await, &plain, failed(2))
        .await
        .unwrap();
    assert_eq!(answer.run.unwrap().state(), runstore_pb::RunState::Failed);
    // exit 3 through `retry-3`: retried, and the replay of that verdict is answered.
    let (listed, key) = running(&h, "attempt-exit-3", "retry-3").await;
    let mut runner = h.runner(&key).await;
    let answer = submit(&mut runner, &listed, failed(3)).await.unwrap();
    let run = answer.run.unwrap();
    assert_eq!(
        (run.state(), run.attempt),
        (runstore_pb::RunState::Starting, 2)
    );
    let replay = submit(&mut runner, &listed, failed(3)).await.unwrap();
    assert!(replay.already_recorded);
    assert_eq!(h.get_run(&listed).await.attempts[0].superseded_verdict, "");
    // `once` never retries, whatever ended it.
    let (once, _) = running(&h, "attempt-once-01", "once").await;
    let answer = h
        .operator()
        .await
        .fail_run(lost(&once, "sbx-1", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.outcome(), runstore_pb::FailRunOutcome::MadeTerminal);
}

async fn a_cancel_in_the_backoff_ends_the_run_and_no_attempt_starts(h: Harness) {
    let (run_id, _) = running(&h, "attempt-cancel", "").await;
    let mut op = h.operator().await;
    op.fail_run(lost(&run_id, "sbx-1", 1)).await.unwrap();
    let cancelled = op
        .cancel_run(cancel(&run_id, "not needed", "cancel-in-backoff-01"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(cancelled.state(), runstore_pb::RunState::Cancelled);
    assert!(cancelled.retry_at.is_none());
    h.advance(Duration::from_secs(30));
    let refused = key_for(&h, &run_id, "sbx-2", 2).await.unwrap_err();
    assert_reason(&refused, Code::FailedPrecondition, ErrorReason::RunTerminal);
    let run = h.get_run(&run_id).await;
    assert_eq!(run.attempts.len(), 1, "{run:?}");
    assert_eq!(receipt(&h, &run_id).await.attempts.len(), 1);
}

async fn a_retry_that_could_not_start_before_the_deadline_ends_the_run(h: Harness) {
    let mut request = create_request("attempt-deadline");
    request.max_duration = Some(prost_types::Duration {
        seconds: 10,
        nanos: 0,
    });
    let (run_id, _) = running_as(&h, request).await;
    // 9.5 s in, even the shortest backoff (0.5 s) reaches the deadline.
    h.advance(Duration::from_millis(9_500));
    let answer = h
        .operator()
        .await
        .fail_run(lost(&run_id, "sbx-1", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.outcome(), runstore_pb::FailRunOutcome::MadeTerminal);
    assert_eq!(answer.run.unwrap().verdict.unwrap().reason, "sandbox_lost");
}

async fn steers_not_acknowledged_by_an_attempt_reach_the_next(h: Harness) {
    let (run_id, first_key) = running(&h, "attempt-steers", "").await;
    let mut op = h.operator().await;
    let steer = |text: &str, key: &str| runstore_pb::SteerRequest {
        run_id: run_id.clone(),
        text: text.into(),
        idempotency_key: key.into(),
    };
    // Delivered to attempt 1, never acknowledged: its runner died with it.
    op.steer(steer("before", "steer-before-the-loss"))
        .await
        .unwrap();
    let mut first = h.runner(&first_key).await;
    let delivered = poll(&mut first, &run_id, vec![]).await.unwrap();
    assert_eq!(delivered.messages.len(), 1);
    op.fail_run(lost(&run_id, "sbx-1", 1)).await.unwrap();
    // Queued in the gap between the attempts.
    op.steer(steer("between", "steer-between-attempts"))
        .await
        .unwrap();
    h.advance(Duration::from_secs(2));
    let second_key = key_for(&h, &run_id, "sbx-2", 2).await.unwrap();
    hello(&h, &run_id, &second_key).await;
    let mut second = h.runner(&second_key).await;
    let answer = poll(&mut second, &run_id, vec![]).await.unwrap();
    let texts: Vec<&str> = answer
        .messages
        .iter()
        .map(|m| match &m.payload {
            Some(runstore_pb::steering_message::Payload::Steer(s)) => s.text.as_str(),
            _ => "",
        })
        .collect();
    assert_eq!(texts, ["before", "between"], "{answer:?}");
    let acks = answer
        .messages
        .iter()
        .map(|m| applied(&m.id))
        .collect::<Vec<_>>();
    let after = poll(&mut second, &run_id, acks).await.unwrap();
    assert!(after.messages.is_empty(), "{after:?}");
}
