//! The orphan sweep, on demand and on its own schedule: it ends runs whose budget is
//! spent, deletes the state of ended runs, takes over a lapsed controller with nobody
//! watching (a budget a claim would start afresh included), and leaves alone a run with
//! no controller yet, a held lease and a parked one.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Backend, World, on_every_backend, plan};
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::runstore::v1 as runstore_pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_settles_runs_nobody_can_own_and_leaves_parked_ones() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    // Spend the budget without a successor ever starting.
    for _ in 0..5 {
        w.clock.advance(Duration::from_secs(61));
        w.operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap();
    }
    w.clock.advance(Duration::from_secs(61));
    // An unknown run with state left behind, and a parked one.
    let mut stranger = w.runner(&key).await;
    let _ = stranger
        .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
            run_id: run_id.clone(),
        })
        .await;

    let mut op = w.operator().await;
    let dry = op
        .sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: true,
        })
        .await
        .unwrap()
        .into_inner();
    let action = |r: &recovery_pb::SweepOrphansResponse| {
        r.results
            .iter()
            .find(|x| x.run_id == run_id)
            .map(|x| x.action())
            .unwrap()
    };
    assert_eq!(action(&dry), recovery_pb::OrphanAction::RunEnded);
    assert_eq!(
        w.run_state(&run_id).await.state(),
        runstore_pb::RunState::Running,
        "a dry run changes nothing"
    );

    let swept = op
        .sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(action(&swept), recovery_pb::OrphanAction::RunEnded);
    assert_eq!(
        w.run_state(&run_id).await.failure_reason,
        "stream_recovery_exhausted"
    );
    assert_eq!(
        w.messages(&run_id, runstore_pb::SteeringKind::Abort)
            .await
            .len(),
        1
    );
    // The run is terminal now: the next pass deletes its keys.
    let next = op
        .sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(action(&next), recovery_pb::OrphanAction::KeysDeleted);
}

/// Spends a running run's whole budget: five takeovers, each controller dying at once.
/// Leaves the fifth claim's lease held.
async fn spend_budget(w: &World, run_id: &str) {
    for attempt in 1..=5 {
        w.clock.advance(Duration::from_secs(61));
        let claim = w
            .operator()
            .await
            .plan_recovery(plan(run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(claim.budget.unwrap().attempts, attempt);
    }
}

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..200 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} never happened");
}

async fn the_scheduled_sweep_ends_spent_runs_and_respects_the_reset(backend: Backend) {
    let w = World::sweeping(false, backend, Duration::from_millis(100)).await;
    // A run whose budget is spent now. (The sweep may claim some of these takeovers
    // itself: whoever claims, each lapse is one attempt.)
    let (spent, key) = w.running_run().await;
    w.acquire(&spent, &key).await;
    spend_budget(&w, &spent).await;
    w.clock.advance(Duration::from_secs(61));

    // Nobody calls SweepOrphans: the coordinator's own sweep ends the spent run...
    wait_for("the sweep ending the spent run", async || {
        w.run_state(&spent).await.state() == runstore_pb::RunState::Failed
    })
    .await;
    assert_eq!(
        w.run_state(&spent).await.failure_reason,
        "stream_recovery_exhausted"
    );
    assert_eq!(
        w.messages(&spent, runstore_pb::SteeringKind::Abort)
            .await
            .len(),
        1
    );
    // ...and, the run being terminal, a later round deletes its state.
    wait_for("the sweep deleting the ended run's keys", async || {
        w.budget(&spent).await.budget.unwrap().attempts == 0
    })
    .await;

    // A run whose budget was spent more than 5 minutes ago: a claim starts afresh, so the
    // sweep does not end it but takes its lapsed controller over, as the first takeover
    // of a fresh budget.
    let (quiet, key) = w.running_run().await;
    w.acquire(&quiet, &key).await;
    spend_budget(&w, &quiet).await;
    // One jump, while the fifth claim's lease is still held, past the reset window.
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    wait_for("the sweep taking the quiet run over", async || {
        w.budget(&quiet).await.budget.unwrap().attempts == 1
    })
    .await;
    taken_over_afresh(&w, &quiet).await;
}

/// `run_id` is still running with no abort sent, and its takeover was claimed as the
/// first of a fresh budget: its lease is held and a resume_stream is on its way.
async fn taken_over_afresh(w: &World, run_id: &str) {
    assert_eq!(
        w.run_state(run_id).await.state(),
        runstore_pb::RunState::Running
    );
    assert!(
        w.messages(run_id, runstore_pb::SteeringKind::Abort)
            .await
            .is_empty()
    );
    assert_eq!(w.budget(run_id).await.budget.unwrap().attempts, 1);
    let again = w
        .operator()
        .await
        .plan_recovery(plan(run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.decision(),
        recovery_pb::RecoveryDecision::LeaseHeld,
        "the claim holds the lease"
    );
}

/// A sweep held up reading the run judges the budget at the run store's answer, not at
/// the time it asked: a spent budget whose window lapsed meanwhile starts afresh on the
/// next claim, so the run is not ended but taken over afresh.
async fn a_sweep_held_up_by_the_run_store_judges_the_budget_when_it_answers(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    w.acquire(&run_id, &key).await;
    spend_budget(&w, &run_id).await;

    // The run store is slow: the sweep asks about the run while the fifth claim's lease
    // is held, and hears back after the window (and the lease) lapsed.
    let held = w.get_run_gate.lock().await;
    let asked = w.get_runs.load(Ordering::SeqCst);
    let mut op = w.operator().await;
    let sweep = tokio::spawn(async move {
        op.sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner()
    });
    wait_for("the sweep asking the run store", async || {
        w.get_runs.load(Ordering::SeqCst) > asked
    })
    .await;
    w.clock.advance(Duration::from_secs(5 * 60 + 1));
    drop(held);
    let swept = sweep.await.unwrap();

    let action = swept.results.iter().find(|r| r.run_id == run_id).unwrap();
    assert_eq!(action.action(), recovery_pb::OrphanAction::TakeoverPlanned);
    taken_over_afresh(&w, &run_id).await;
}

/// A running run whose controller's lease lapsed, and nobody tails it: the sweep plans
/// its takeover (a resume_stream for its runner), once; a dry run only names it. A run
/// whose runner never acquired, a queued run, a held lease and a parked one are left
/// alone.
async fn a_lapsed_controller_is_taken_over_by_the_sweep_with_nobody_watching(backend: Backend) {
    let w = World::on(false, backend).await;
    let (lapsed, key) = w.running_run().await;
    w.acquire(&lapsed, &key).await;
    let (never_acquired, _) = w.running_run().await;
    let queued = w.queued_run().await;
    let (held, key) = w.running_run().await;
    let (parked, parked_key) = w.running_run().await;
    w.acquire(&parked, &parked_key).await;
    w.operator()
        .await
        .park_stream(recovery_pb::ParkStreamRequest {
            run_id: parked.clone(),
            sandbox_id: "sbx".into(),
        })
        .await
        .unwrap();
    // Every lease lapses; then one controller acquires again.
    w.clock.advance(Duration::from_secs(61));
    w.acquire(&held, &key).await;

    let sweep = |dry_run| {
        let w = &w;
        async move {
            let swept = w
                .operator()
                .await
                .sweep_orphans(recovery_pb::SweepOrphansRequest {
                    cursor: String::new(),
                    limit: 100,
                    dry_run,
                })
                .await
                .unwrap()
                .into_inner();
            move |run_id: &str| {
                swept
                    .results
                    .iter()
                    .find(|r| r.run_id == run_id)
                    .map(|r| r.action())
            }
        }
    };
    let dry = sweep(true).await;
    assert_eq!(
        dry(&lapsed),
        Some(recovery_pb::OrphanAction::TakeoverPlanned)
    );
    assert_eq!(w.budget(&lapsed).await.budget.unwrap().attempts, 0);

    let swept = sweep(false).await;
    assert_eq!(
        swept(&lapsed),
        Some(recovery_pb::OrphanAction::TakeoverPlanned)
    );
    for alone in [&held, &parked] {
        assert_eq!(
            swept(alone),
            Some(recovery_pb::OrphanAction::Skipped),
            "{alone}"
        );
    }
    // With no controller ever, the coordinator keeps nothing of them to sweep.
    for nothing in [&never_acquired, &queued] {
        assert!(
            matches!(
                swept(nothing),
                None | Some(recovery_pb::OrphanAction::Skipped)
            ),
            "{nothing} has no controller to replace"
        );
    }
    assert_eq!(
        w.messages(&lapsed, runstore_pb::SteeringKind::ResumeStream)
            .await
            .len(),
        1
    );
    for untouched in [&never_acquired, &held, &parked] {
        assert!(
            w.messages(untouched, runstore_pb::SteeringKind::ResumeStream)
                .await
                .is_empty()
        );
    }
    // A second pass finds the claim's lease held: nothing twice.
    let again = sweep(false).await;
    assert_eq!(again(&lapsed), Some(recovery_pb::OrphanAction::Skipped));
    assert_eq!(w.budget(&lapsed).await.budget.unwrap().attempts, 1);
}

on_every_backend! {
    a_lapsed_controller_is_taken_over_by_the_sweep_with_nobody_watching: the_sweep_takes_over_a_lapsed_controller_on_redis, the_sweep_takes_over_a_lapsed_controller_on_a_cluster, the_sweep_takes_over_a_lapsed_controller_in_memory;
    the_scheduled_sweep_ends_spent_runs_and_respects_the_reset: the_sweep_runs_by_itself_and_respects_the_reset_on_redis, the_sweep_runs_by_itself_and_respects_the_reset_on_a_cluster, the_sweep_runs_by_itself_and_respects_the_reset_in_memory;
    a_sweep_held_up_by_the_run_store_judges_the_budget_when_it_answers: a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_on_redis, a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_on_a_cluster, a_slow_run_store_does_not_make_the_sweep_end_a_reset_run_in_memory;
}
