//! Loss grace through the tick (`common`): one loss observation only stamps, the run
//! fails once after the grace, and fake-driver probes replay the races between ticks
//! that clear, stamp and confirm the same row; a runner exit the driver recorded is
//! certain and ends the run in the round that sees it, changing nothing of a run that
//! already has its verdict.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::deliver_outbox;
use tonic::Code;

runplane_testkit::on_both_backends!(
    workers 4,
    World::start =>
    one_loss_observation_only_stamps_and_the_attempt_ends_after_the_grace,
    a_stamp_cleared_while_the_probe_is_in_flight_keeps_the_run_alive,
    a_stale_clear_cannot_delete_a_stamp_written_after_it_was_read,
    grace_expiry_seen_by_three_concurrent_ticks_ends_the_attempt_once,
    a_recorded_runner_exit_ends_the_attempt_at_once_and_leaves_a_verdict_alone,
);

async fn one_loss_observation_only_stamps_and_the_attempt_ends_after_the_grace(w: World) {
    let (row, key) = w.running_sandbox("grace").await;
    let lost = w.reconciler(FakeDriver::always(Probe::Lost));

    let first = lost.tick().await.unwrap();
    assert_eq!(first.stamped, 1);
    assert!(
        w.store
            .sandbox(&row.id)
            .await
            .unwrap()
            .loss_observed_at_us
            .is_some()
    );
    w.clock.advance(GRACE - Duration::from_secs(1));
    assert_eq!(
        lost.tick().await.unwrap().confirmed,
        0,
        "still within the grace"
    );
    assert!(w.store.outbox().await.unwrap().is_empty());
    w.key_works(&row.run_id, &key, "batch-within-grace-1")
        .await
        .unwrap();

    w.clock.advance(Duration::from_secs(1));
    assert_eq!(lost.tick().await.unwrap().confirmed, 1);
    let sandbox = w.store.sandbox(&row.id).await.unwrap();
    assert_eq!((sandbox.status.as_str(), sandbox.exit_code), ("lost", None));
    assert_eq!(
        deliver_outbox(&w.store, &w.outbox_client().await, 10)
            .await
            .unwrap(),
        1
    );
    // The run outlives its sandbox: its attempt ended, the next is due.
    w.first_attempt_ended(&row.run_id, "sandbox_lost").await;
    // A sandbox seen alive again before the grace ends clears the stamp instead.
    let (row2, _) = w.running_sandbox("grace-recovers").await;
    lost.observe(row2.clone()).await.unwrap();
    let alive = w.reconciler(FakeDriver::always(Probe::Alive));
    assert_eq!(alive.tick().await.unwrap().cleared, 1);
    assert!(
        w.store
            .sandbox(&row2.id)
            .await
            .unwrap()
            .loss_observed_at_us
            .is_none()
    );
}

async fn a_stamp_cleared_while_the_probe_is_in_flight_keeps_the_run_alive(w: World) {
    let (row, key) = w.running_sandbox("cleared-mid-probe").await;
    let stamped = w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(30));

    // Tick B saw the sandbox alive and clears the stamp while tick A's probe is in flight;
    // A's probe then reports the sandbox lost, from before B's observation.
    let b = w.reconciler(FakeDriver::always(Probe::Alive));
    let store = w.store.clone();
    let a = w.reconciler(FakeDriver::new(move |row| {
        let b = b.clone();
        let store = store.clone();
        Box::pin(async move {
            let fresh = store.sandbox(&row.id).await.unwrap();
            assert_eq!(b.observe(fresh).await.unwrap().cleared, 1);
            Probe::Lost
        })
    }));
    let report = a.observe(stamped).await.unwrap();
    assert_eq!((report.confirmed, report.lost_races), (0, 1));

    let now = w.store.sandbox(&row.id).await.unwrap();
    assert_eq!(now.status, "started");
    assert!(now.loss_observed_at_us.is_none());
    assert!(
        w.store.outbox().await.unwrap().is_empty(),
        "no FailRun was queued"
    );
    assert_eq!(
        w.run_state(&row.run_id).await.state(),
        runstore_pb::RunState::Running
    );
    w.key_works(&row.run_id, &key, "batch-after-the-race-1")
        .await
        .expect("the key still works");
}

async fn a_stale_clear_cannot_delete_a_stamp_written_after_it_was_read(w: World) {
    let (row, _) = w.running_sandbox("stale-clear").await;
    let stamped = w.stamp(&row).await;

    // While tick A (which read the old stamp) probes, B clears it and C stamps a new loss.
    let b = w.reconciler(FakeDriver::always(Probe::Alive));
    let c = w.reconciler(FakeDriver::always(Probe::Lost));
    let store = w.store.clone();
    let clock = w.clock.clone();
    let a = w.reconciler(FakeDriver::new(move |row| {
        let (b, c, store, clock) = (b.clone(), c.clone(), store.clone(), clock.clone());
        Box::pin(async move {
            b.observe(store.sandbox(&row.id).await.unwrap())
                .await
                .unwrap();
            clock.advance(Duration::from_secs(5));
            c.observe(store.sandbox(&row.id).await.unwrap())
                .await
                .unwrap();
            Probe::Alive
        })
    }));
    let report = a.observe(stamped.clone()).await.unwrap();
    assert_eq!((report.cleared, report.lost_races), (0, 1));
    let now = w.store.sandbox(&row.id).await.unwrap();
    let newer = stamped.loss_observed_at_us.unwrap() + 5_000_000;
    assert_eq!(
        now.loss_observed_at_us,
        Some(newer),
        "C's stamp survives A's stale clear"
    );
}

async fn grace_expiry_seen_by_three_concurrent_ticks_ends_the_attempt_once(w: World) {
    let (row, key) = w.running_sandbox("three-ticks").await;
    let stamped = w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(1));

    // All three read the row, then all three probes answer at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let driver = FakeDriver::new(move |_| {
        let barrier = barrier.clone();
        Box::pin(async move {
            barrier.wait().await;
            Probe::Lost
        })
    });
    let ticks: Vec<_> = (0..3).map(|_| w.reconciler(driver.clone())).collect();
    let (r1, r2, r3) = tokio::join!(
        ticks[0].observe(stamped.clone()),
        ticks[1].observe(stamped.clone()),
        ticks[2].observe(stamped.clone()),
    );
    let confirmed: u64 = [r1, r2, r3].into_iter().map(|r| r.unwrap().confirmed).sum();
    assert_eq!(confirmed, 1, "exactly one tick wins the compare-and-set");
    assert_eq!(w.store.outbox().await.unwrap().len(), 1);

    let client = w.outbox_client().await;
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 1);
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 0);
    assert_eq!(
        w.fail_run_calls.load(Ordering::SeqCst),
        1,
        "FailRun called once"
    );
    // Once: attempt 1 ended and attempt 2 is due, not 3 or 4.
    w.first_attempt_ended(&row.run_id, "sandbox_lost").await;
    let err = w
        .key_works(&row.run_id, &key, "batch-after-failure-1")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
}

async fn a_recorded_runner_exit_ends_the_attempt_at_once_and_leaves_a_verdict_alone(w: World) {
    let (row, _) = w.running_sandbox("runner-killed").await;
    let exited = w.reconciler(FakeDriver::always(Probe::Exited(Some(137))));
    // No time passes: the exit is certain, the grace is for what is unknown.
    assert_eq!(exited.tick().await.unwrap().confirmed, 1);
    let sandbox = w.store.sandbox(&row.id).await.unwrap();
    assert_eq!(
        (sandbox.status.as_str(), sandbox.exit_code),
        ("exited", Some(137))
    );
    assert_eq!(exited.tick().await.unwrap().confirmed, 0, "ended once");
    assert_eq!(
        deliver_outbox(&w.store, &w.outbox_client().await, 10)
            .await
            .unwrap(),
        1
    );
    let first = w.first_attempt_ended(&row.run_id, "runner_exited").await;
    assert_eq!(
        first.end_message,
        format!(
            "the runner of sandbox {} was killed by signal 9 without a verdict",
            row.id
        )
    );

    // A runner that submitted its verdict and then exited: its run keeps its verdict.
    let (row, key) = w.running_sandbox("runner-done").await;
    w.submit_success(&row.run_id, &key).await;
    assert_eq!(
        w.reconciler(FakeDriver::always(Probe::Exited(Some(0))))
            .tick()
            .await
            .unwrap()
            .confirmed,
        1
    );
    assert_eq!(
        deliver_outbox(&w.store, &w.outbox_client().await, 10)
            .await
            .unwrap(),
        1,
        "the FailRun is delivered and answered with the verdict"
    );
    let run = w.run_state(&row.run_id).await;
    assert_eq!(run.state(), runstore_pb::RunState::Succeeded);
    assert_eq!(run.verdict.unwrap().reason, "exit_zero");
}
