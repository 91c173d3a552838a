//! Takeovers over real gRPC, real Redis and a real run store: bounded, handed to the
//! runner as resume_stream, and ending the run with exactly one abort.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Backend, World, frames, on_every_backend, plan};
use runplane_clock::Clock;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

/// How each controller fails.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// It dies (a thrown error, a killed process): its lease lapses.
    LeaseLapses,
    /// Its append keeps failing and it hands off: it releases its lease at once.
    HandsOff,
}

/// Controllers keep failing. `tails` planners ask at once at every step, as several tabs
/// or pods tailing one run would.
async fn exhausts_after_five_takeovers_with_one_abort(tails: usize, failure: Failure) {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let first = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: first.controller_token.clone(),
            frames: frames(1..=3),
            resync: false,
        })
        .await
        .unwrap();

    let mut waits = Vec::new();
    let mut current = first.controller_token.clone();
    for attempt in 1..=5u32 {
        match failure {
            // The controller died: its lease lapses, and any backoff runs out.
            Failure::LeaseLapses => w.clock.advance(Duration::from_secs(61)),
            // The controller gives up: it releases, and the planners wait out the backoff.
            Failure::HandsOff => {
                let released = runner
                    .release_lease(recovery_pb::ReleaseLeaseRequest {
                        run_id: run_id.clone(),
                        controller_token: current.clone(),
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(released.released);
                let budget = w.budget(&run_id).await.budget.unwrap();
                let now = w.clock.now().timestamp_millis();
                let wait_ms = budget
                    .not_before
                    .map(|t| t.seconds * 1000 + i64::from(t.nanos / 1_000_000) - now + 1)
                    .unwrap_or(0)
                    .max(0);
                w.clock.advance(Duration::from_millis(wait_ms as u64));
            }
        }
        let calls: Vec<_> = (0..tails)
            .map(|_| {
                let run_id = run_id.clone();
                let w = &w;
                async move { w.operator().await.plan_recovery(plan(&run_id)).await }
            })
            .collect();
        let answers = futures::future::join_all(calls).await;
        let claimed: Vec<_> = answers
            .iter()
            .filter_map(|a| a.as_ref().ok())
            .filter(|a| a.get_ref().decision() == recovery_pb::RecoveryDecision::Claimed)
            .collect();
        assert_eq!(
            claimed.len(),
            1,
            "attempt {attempt}: one claim among {tails} planners"
        );
        let budget = w.budget(&run_id).await.budget.unwrap();
        assert_eq!(budget.attempts, attempt);
        waits.push(budget.not_before.unwrap().seconds - budget.claimed_at.unwrap().seconds);
        let resumes = w
            .messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await;
        if let Some(runstore_pb::steering_message::Payload::ResumeStream(p)) =
            &resumes.last().unwrap().payload
        {
            current = p.controller_token.clone();
        }
    }
    assert!(
        waits.windows(2).all(|p| p[1] >= p[0]),
        "the waits grow: {waits:?}"
    );
    assert!(waits.last() > waits.first(), "the waits grow: {waits:?}");

    let resumes = w
        .messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
        .await;
    assert_eq!(resumes.len(), 5, "exactly five resume_stream messages");
    for (i, m) in resumes.iter().enumerate() {
        let Some(runstore_pb::steering_message::Payload::ResumeStream(p)) = &m.payload else {
            panic!("not a resume_stream payload");
        };
        assert_eq!((p.attempt, p.next_sequence), (i as u32 + 1, 4));
    }

    w.clock.advance(Duration::from_secs(61));
    let err = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&err).unwrap().reason,
        ErrorReason::RecoveryExhausted.as_str_name()
    );
    let run = w.run_state(&run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    assert_eq!(run.failure_reason, "stream_recovery_exhausted");

    // Later tails find the run terminal; nothing more reaches the runner.
    for _ in 0..3 {
        w.clock.advance(Duration::from_secs(61));
        let later = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(later.decision(), recovery_pb::RecoveryDecision::RunTerminal);
    }
    assert_eq!(
        w.messages(&run_id, runstore_pb::SteeringKind::Abort)
            .await
            .len(),
        1,
        "exactly one abort"
    );
    assert_eq!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .len(),
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_controllers_keep_dying_ends_after_five_takeovers_with_one_tail() {
    exhausts_after_five_takeovers_with_one_abort(1, Failure::LeaseLapses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_controllers_keep_dying_ends_after_five_takeovers_with_three_tails() {
    exhausts_after_five_takeovers_with_one_abort(3, Failure::LeaseLapses).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_appends_keep_failing_ends_after_five_hand_offs_with_one_tail() {
    exhausts_after_five_takeovers_with_one_abort(1, Failure::HandsOff).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_appends_keep_failing_ends_after_five_hand_offs_with_three_tails() {
    exhausts_after_five_takeovers_with_one_abort(3, Failure::HandsOff).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_takeover_is_immediate_and_completes_what_the_old_controller_could_not() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let old = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: old.clone(),
            frames: frames(1..=2),
            resync: false,
        })
        .await
        .unwrap();
    // The old controller's next append never lands; its lease lapses.
    w.clock.advance(Duration::from_secs(31));
    let claim = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        claim.decision(),
        recovery_pb::RecoveryDecision::Claimed,
        "immediate: no backoff before the first"
    );
    assert_eq!(claim.next_sequence, 3);

    let fenced = runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: old,
            frames: frames(3..=3),
            resync: false,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&fenced).unwrap().reason,
        ErrorReason::LeaseFenced.as_str_name()
    );

    let resume = w
        .messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
        .await;
    let Some(runstore_pb::steering_message::Payload::ResumeStream(p)) = &resume[0].payload else {
        panic!("a resume_stream message");
    };
    let appended = runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: p.controller_token.clone(),
            frames: frames(3..=4),
            resync: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        appended.next_sequence, 5,
        "the next controller completed the stream"
    );

    // The new controller fails too and hands off at once (releases its lease): the next
    // takeover waits out the backoff instead of following straight away.
    let released = runner
        .release_lease(recovery_pb::ReleaseLeaseRequest {
            run_id: run_id.clone(),
            controller_token: p.controller_token.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(released.released);
    let wait = w.operator().await.plan_recovery(plan(&run_id)).await;
    match wait {
        Err(e) => assert_eq!(
            error_info(&e).unwrap().reason,
            ErrorReason::RecoveryNotBefore.as_str_name()
        ),
        Ok(a) => panic!("claimed again inside the backoff: {:?}", a.into_inner()),
    }
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 1);
    w.clock.advance(Duration::from_secs(2));
    let second = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.decision(), recovery_pb::RecoveryDecision::Claimed);
    assert_eq!(second.budget.unwrap().attempts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_fails_before_it_starts_spends_nothing() {
    let w = World::new(true).await;
    let err = w
        .operator()
        .await
        .plan_recovery(plan("01a22b9d-7bd7-76e7-a072-4dd6efe3ec58"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        error_info(&err).unwrap().reason,
        ErrorReason::UpstreamUnavailable.as_str_name()
    );
    let budget = w.budget("01a22b9d-7bd7-76e7-a072-4dd6efe3ec58").await;
    assert_eq!(budget.budget.unwrap().attempts, 0);
    assert_eq!(budget.lease.unwrap().state(), recovery_pb::LeaseState::Free);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_run_is_never_taken_over() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let token = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "parked-controller-0001".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    for _ in 0..10 {
        w.clock.advance(Duration::from_secs(20));
        runner
            .renew_lease(recovery_pb::RenewLeaseRequest {
                run_id: run_id.clone(),
                controller_token: token.clone(),
                ttl: None,
            })
            .await
            .unwrap();
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.decision(), recovery_pb::RecoveryDecision::LeaseHeld);
    }
    assert!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 0);
    let _ = w.clock.now();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_controller_must_come_through_a_claim_and_keys_are_checked() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-first-controller".into(),
            ttl: None,
        })
        .await
        .unwrap();
    let held = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "a-second-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&held).unwrap().reason,
        ErrorReason::LeaseHeld.as_str_name()
    );
    w.clock.advance(Duration::from_secs(31));
    let takeover = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "a-second-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        error_info(&takeover).unwrap().reason,
        ErrorReason::LeaseTakeoverRequired.as_str_name()
    );

    let mut stranger = w.runner("rk_not-a-key-anyone-was-given").await;
    let refused = stranger
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id,
            controller_id: "stranger-controller-01".into(),
            ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_window_starts_a_fresh_budget() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    for attempt in 1..=2 {
        w.clock.advance(Duration::from_secs(61));
        let claim = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(claim.budget.unwrap().attempts, attempt);
    }
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    let fresh = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.decision(), recovery_pb::RecoveryDecision::Claimed);
    assert_eq!(
        fresh.budget.unwrap().attempts,
        1,
        "a takeover after 5 quiet minutes starts over"
    );
}

async fn a_failed_hand_off_after_a_claim_changes_nothing(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let old = w.acquire(&run_id, &key).await;
    // One takeover already spent, so "unchanged" has a budget to compare with.
    w.clock.advance(Duration::from_secs(31));
    let first = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.decision(), recovery_pb::RecoveryDecision::Claimed);
    w.clock.advance(Duration::from_secs(61));
    let before = w.budget(&run_id).await;

    w.fail_enqueue.store(true, Ordering::SeqCst);
    let err = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let after = w.budget(&run_id).await;
    assert_eq!(after.budget, before.budget, "the budget is unchanged");
    assert_eq!(after.lease, before.lease, "the lease is as it was (lapsed)");
    assert_eq!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .len(),
        1
    );

    // The run store answers again: the next plan claims attempt 2, not 3.
    w.fail_enqueue.store(false, Ordering::SeqCst);
    let second = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.decision(), recovery_pb::RecoveryDecision::Claimed);
    assert_eq!(second.budget.unwrap().attempts, 2);
    let _ = old;
}

on_every_backend! {
    a_failed_hand_off_after_a_claim_changes_nothing: a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_on_redis, a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_on_a_cluster, a_failed_enqueue_after_a_claim_leaves_the_budget_unchanged_in_memory;
}
