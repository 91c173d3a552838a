//! Reconciler replicas (`common`): two reconcilers, each with its own connection pool
//! on one database, dispatching, sweeping, waking and ticking at the same moment.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::{
    ReconcileSettings, Reconciler, RunStoreClient, deliver_outbox,
};
use runplane_sandbox_reconciler::store::entities::sandbox;
use runplane_testkit::Backend;

/// Two reconciler replicas, each with its own connection pool on one database, running
/// the same background step at the same moment.
mod two_replicas {
    use super::*;
    use sea_orm::EntityTrait;

    /// Two reconcilers with always-alive probes, one on the world's store and one on a
    /// replica's, and a run-store client for both.
    async fn replicas(w: &World) -> (Reconciler, Reconciler, RunStoreClient) {
        let driver = || Arc::new(FakeDriver::always(Probe::Alive));
        let a = Reconciler::new(w.store.clone(), driver(), ReconcileSettings::default());
        let b = Reconciler::new(
            w.replica_store().await,
            driver(),
            ReconcileSettings::default(),
        );
        (a, b, w.outbox_client().await)
    }

    /// While `held`, each ListRuns waits until two are in flight: both replicas hold the
    /// same answer before either acts on it.
    fn hold_list_runs(w: &World, held: bool) {
        *w.list_runs_barrier.lock().unwrap() = held.then(|| Arc::new(tokio::sync::Barrier::new(2)));
    }

    /// Both replicas read the nodes' room, then both are held at the same point (their
    /// ListRuns of STARTING runs) until each has claimed, so both place against the same
    /// stale room: the node's lock and count at the insert keep every node within its
    /// capacity (4), and no run gets two sandboxes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn dispatching_at_once_they_place_each_run_once_within_each_nodes_capacity() {
        let w = World::start(Backend::postgres().await).await;
        register(&w, "node-a", "a").await;
        register(&w, "node-b", "b").await;
        let mut runs = Vec::new();
        for i in 0..12 {
            runs.push(w.queued_run(&format!("two-dispatch-{i:02}")).await.id);
        }
        let other = w.replica_store().await;
        hold_list_runs(&w, true);
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        hold_list_runs(&w, false);

        let rows = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap();
        let mut per_run = std::collections::HashMap::<&str, usize>::new();
        let mut per_node = std::collections::HashMap::<&str, usize>::new();
        for row in &rows {
            *per_run.entry(row.run_id.as_str()).or_default() += 1;
            *per_node
                .entry(row.active_node_id.as_deref().unwrap_or("unplaced"))
                .or_default() += 1;
        }
        assert!(
            per_run.values().all(|n| *n == 1),
            "a run placed twice: {per_run:?}"
        );
        assert_eq!(per_node.get("node-a"), Some(&4), "{per_node:?}");
        assert_eq!(per_node.get("node-b"), Some(&4), "{per_node:?}");
        assert_eq!(rows.len(), 8);

        // Room frees (two runs end): the next round places runs that waited, still within
        // capacity, and never a run twice.
        let mut op = w.run_store().await;
        for row in rows
            .iter()
            .filter(|r| r.active_node_id.as_deref() == Some("node-a"))
            .take(2)
        {
            op.cancel_run(authed(
                runstore_pb::CancelRunRequest {
                    run_id: row.run_id.clone(),
                    reason: String::new(),
                    idempotency_key: format!("free-{}", row.id),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            w.store.mark_deleted(&row.id, 1).await.unwrap();
        }
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        let rows = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap();
        let live: Vec<_> = rows.iter().filter(|r| r.status != "deleted").collect();
        let on_a = live
            .iter()
            .filter(|r| r.active_node_id.as_deref() == Some("node-a"))
            .count();
        assert_eq!(on_a, 4, "node-a filled to its capacity again, not past it");
        let mut runs_placed: Vec<&str> = rows.iter().map(|r| r.run_id.as_str()).collect();
        let placed = runs_placed.len();
        runs_placed.sort();
        runs_placed.dedup();
        assert_eq!(runs_placed.len(), placed, "a run placed twice");
        assert_eq!(placed, 10);
    }

    /// A run's attempt ended: both replicas, held at the same point, place its next
    /// attempt at once. The attempt's dispatch key makes one sandbox of it, and the sweep
    /// deletes attempt 1's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_replicas_start_a_runs_next_attempt_once() {
        let w = World::start(Backend::postgres().await).await;
        register(&w, "node-a", "a").await;
        register(&w, "node-b", "b").await;
        let run = w.queued_run("next-attempt-once").await;
        w.dispatch_once(&w.store).await;
        let ended = w
            .run_store()
            .await
            .fail_run(authed(
                runstore_pb::FailRunRequest {
                    run_id: run.id.clone(),
                    reason: "runner_exited".into(),
                    message: "the runner was killed by signal 9 without a verdict".into(),
                    idempotency_key: "runner-exited:next-attempt-once".into(),
                    if_sandbox_generation: None,
                    if_sandbox_id: String::new(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ended.outcome(), runstore_pb::FailRunOutcome::AttemptEnded);
        // This world's reconciler clock is months ahead of the run store's: the backoff
        // is over as the reconciler sees it.
        let other = w.replica_store().await;
        hold_list_runs(&w, true);
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        hold_list_runs(&w, false);
        let rows = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap();
        let attempts: Vec<i64> = rows.iter().map(|r| r.attempt).collect();
        assert_eq!(
            (
                attempts.iter().filter(|a| **a == 1).count(),
                attempts.iter().filter(|a| **a == 2).count()
            ),
            (1, 1),
            "one sandbox per attempt: {rows:?}"
        );
        let reconciler = w.reconciler(FakeDriver::always(Probe::Alive));
        assert_eq!(
            reconciler
                .delete_sandboxes_of_ended_runs(&w.outbox_client().await)
                .await
                .unwrap(),
            1,
            "attempt 1's sandbox is deleted, attempt 2's kept"
        );
        let first = rows.iter().find(|r| r.attempt == 1).unwrap();
        assert_eq!(w.store.sandbox(&first.id).await.unwrap().status, "deleted");
    }

    /// A sandbox lost while it was created, before its run key was issued (its node fenced):
    /// the run store refuses the loss's FailRun (it knows no sandbox of the run yet), so
    /// the run is still STARTING on attempt 1 with no key. Both replicas, dispatching at
    /// once, place one sandbox in its stead, on the node that is left, for that attempt;
    /// a later round places nothing more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_replicas_replace_a_sandbox_lost_before_its_key_once() {
        use sea_orm::{ColumnTrait, QueryFilter};
        let w = World::start(Backend::postgres().await).await;
        register(&w, "node-a", "a").await;
        let run = w.queued_run("lost-before-key").await;
        w.dispatch_once(&w.store).await;
        let first = w
            .store
            .live_sandbox_of(&run.id)
            .await
            .unwrap()
            .expect("placed");
        assert_eq!(first.active_node_id.as_deref(), Some("node-a"));
        w.store.revoke_node_credentials("node-a").await.unwrap();
        assert_eq!(w.store.sandbox(&first.id).await.unwrap().status, "lost");
        deliver_outbox(&w.store, &w.outbox_client().await, 10)
            .await
            .unwrap();
        register(&w, "node-b", "b").await;

        let other = w.replica_store().await;
        hold_list_runs(&w, true);
        tokio::join!(w.dispatch_once(&w.store), w.dispatch_once(&other));
        hold_list_runs(&w, false);
        w.dispatch_once(&w.store).await;

        let rows = sandbox::Entity::find()
            .filter(sandbox::Column::RunId.eq(run.id.as_str()))
            .all(w.store.database())
            .await
            .unwrap();
        let creating: Vec<_> = rows.iter().filter(|r| r.status == "creating").collect();
        assert_eq!(
            creating.len(),
            1,
            "one sandbox in the lost one's stead: {rows:?}"
        );
        assert_eq!(creating[0].active_node_id.as_deref(), Some("node-b"));
        assert_eq!(
            creating[0].attempt, 1,
            "the attempt never began: it is not spent"
        );
        assert_eq!(rows.len(), 2, "{rows:?}");
    }

    /// Both replicas sweep the sandboxes of ended runs at once, both holding the same
    /// answer from the run store: each sandbox is deleted by exactly one of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sweeping_ended_runs_at_once_they_delete_each_sandbox_once() {
        let w = World::start(Backend::postgres().await).await;
        let mut op = w.run_store().await;
        let mut rows = Vec::new();
        for i in 0..5 {
            let (row, _) = w.running_sandbox(&format!("two-sweeps-{i}")).await;
            op.cancel_run(authed(
                runstore_pb::CancelRunRequest {
                    run_id: row.run_id.clone(),
                    reason: String::new(),
                    idempotency_key: format!("two-sweeps-cancel-{i}"),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            rows.push(row);
        }
        let (a, b, client) = replicas(&w).await;
        hold_list_runs(&w, true);
        let (da, db) = tokio::join!(
            a.delete_sandboxes_of_ended_runs(&client),
            b.delete_sandboxes_of_ended_runs(&client)
        );
        hold_list_runs(&w, false);
        assert_eq!(da.unwrap() + db.unwrap(), 5, "each deleted by one replica");
        for row in &rows {
            assert_eq!(w.store.sandbox(&row.id).await.unwrap().status, "deleted");
        }
    }

    /// Both replicas find the same parked runs with a message waiting at once: each
    /// sandbox gets one wake, queued by one of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn waking_parked_runs_at_once_they_queue_one_wake_each() {
        use runplane_sandbox_reconciler::store::entities::wake;
        let w = World::start(Backend::postgres().await).await;
        let mut op = w.run_store().await;
        let mut parked = Vec::new();
        for i in 0..4 {
            let (row, _) = w.running_sandbox(&format!("two-wakes-{i}")).await;
            w.store.mark_deleted(&row.id, 1).await.unwrap();
            op.steer(authed(
                runstore_pb::SteerRequest {
                    run_id: row.run_id.clone(),
                    text: "are you there".into(),
                    idempotency_key: format!("two-wakes-steer-{i}"),
                },
                TOKEN,
            ))
            .await
            .unwrap();
            parked.push(w.suspended_on("node-a", &row.run_id).await);
        }
        let (a, b, client) = replicas(&w).await;
        hold_list_runs(&w, true);
        let (qa, qb) = tokio::join!(
            a.wake_sandboxes_with_messages(&client),
            b.wake_sandboxes_with_messages(&client)
        );
        hold_list_runs(&w, false);
        assert_eq!(
            qa.unwrap() + qb.unwrap(),
            4,
            "each wake queued by one replica"
        );
        let wakes = wake::Entity::find().all(w.store.database()).await.unwrap();
        assert_eq!(wakes.len(), 4, "{wakes:?}");
        for row in &parked {
            assert_eq!(wakes.iter().filter(|k| k.sandbox_id == row.id).count(), 1);
        }
        // Asked again, nothing more is queued: the open wakes stand.
        assert_eq!(a.wake_sandboxes_with_messages(&client).await.unwrap(), 0);
    }

    /// Both replicas tick over the same sandboxes past their loss grace at once: every
    /// loss is confirmed by exactly one of them, one FailRun owed for each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn ticking_at_once_they_confirm_each_loss_once() {
        let w = World::start(Backend::postgres().await).await;
        let mut rows = Vec::new();
        for i in 0..6 {
            let (row, _) = w.running_sandbox(&format!("two-ticks-{i}")).await;
            rows.push(w.stamp(&row).await);
        }
        w.clock.advance(GRACE + Duration::from_secs(1));
        let other = w.replica_store().await;
        let settings = ReconcileSettings {
            loss_grace: GRACE,
            // Small batches, so the replicas' passes interleave row by row.
            batch: 2,
            ..ReconcileSettings::default()
        };
        let a = Reconciler::new(
            w.store.clone(),
            Arc::new(FakeDriver::always(Probe::Lost)),
            settings.clone(),
        );
        let b = Reconciler::new(other, Arc::new(FakeDriver::always(Probe::Lost)), settings);
        let (ra, rb) = tokio::join!(a.tick(), b.tick());
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(ra.confirmed + rb.confirmed, 6, "{ra:?} {rb:?}");
        assert_eq!(w.store.outbox().await.unwrap().len(), 6);

        let client = w.outbox_client().await;
        let (da, db) = tokio::join!(
            deliver_outbox(&w.store, &client, 10),
            deliver_outbox(&w.store, &client, 10)
        );
        assert_eq!(da.unwrap() + db.unwrap(), 6);
        assert_eq!(
            w.fail_run_calls.load(Ordering::SeqCst),
            6,
            "FailRun once per loss"
        );
        // Each run's attempt ended once (attempt 2 is due, not 3).
        for row in &rows {
            w.first_attempt_ended(&row.run_id, "sandbox_lost").await;
        }
    }
}
