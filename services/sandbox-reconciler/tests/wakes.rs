//! Wakes and routes (`common`): ResolveRoute queues a wake for an unplaced sandbox and
//! signs a route to a placed one; across several hosts a wake goes to the node holding
//! the sandbox, publications are compare-and-sets on ownership, a lost node's suspended
//! runs end through the loss grace, and a failing restore settles instead of looping.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use runplane_clock::Clock;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::route_token;
use runplane_sandbox_reconciler::reconcile::{ReconcileSettings, Reconciler, deliver_outbox};
use runplane_sandbox_reconciler::store::entities::{node, route_identity, sandbox};
use runplane_testkit::Backend;
use tonic::Code;

runplane_testkit::on_both_backends!(
    workers 4,
    World::start =>
    a_reattach_wakes_an_unplaced_sandbox_whatever_its_direct_route_names,
);

async fn a_reattach_wakes_an_unplaced_sandbox_whatever_its_direct_route_names(w: World) {
    let now = w.clock.now().timestamp_micros();
    w.store
        .upsert_node(node::Model {
            id: "node-a".into(),
            endpoint: "127.0.0.1:7443".into(),
            capacity: 8,
            last_heartbeat_us: now,
            boot_id: "boot-a".into(),
            epoch: 1,
            used: 0,
            registered_at_us: now,
            fenced_at_us: 0,
        })
        .await
        .unwrap();
    let kubernetes = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-k",
            "kubernetes",
            "suspended",
            None,
        ))
        .await
        .unwrap();
    let placed = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-p",
            "direct",
            "started",
            Some("node-a"),
        ))
        .await
        .unwrap();
    let idle = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            "run-i",
            "direct",
            "started",
            Some("node-a"),
        ))
        .await
        .unwrap();
    for row in [&placed, &idle] {
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
    }
    // node-a suspends `idle` for idleness and publishes it unplaced; its route identity
    // still names node-a.
    assert!(
        w.store
            .publish(&idle.id, 1, "suspended", None)
            .await
            .unwrap()
    );

    let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
        .await
        .unwrap();
    let resolve = |id: &str| {
        authed(
            reconciler_pb::ResolveRouteRequest {
                sandbox_id: id.into(),
                session_id: "session-1".into(),
            },
            TOKEN,
        )
    };

    for unplaced in [&kubernetes, &idle] {
        let err = api.resolve_route(resolve(&unplaced.id)).await.unwrap_err();
        assert_eq!(
            err.code(),
            Code::FailedPrecondition,
            "{}",
            unplaced.substrate
        );
        let info = error_info(&err).unwrap();
        assert_eq!(info.reason, ErrorReason::NotPlaced.as_str_name());
        let wake = w
            .store
            .open_wake(&unplaced.id)
            .await
            .unwrap()
            .expect("a wake is queued");
        assert_eq!(info.metadata["wake_id"], wake.id);
        // Asking again reuses the one pending wake.
        let again = api.resolve_route(resolve(&unplaced.id)).await.unwrap_err();
        assert_eq!(error_info(&again).unwrap().metadata["wake_id"], wake.id);
        let shown = api
            .get_sandbox(authed(
                reconciler_pb::GetSandboxRequest {
                    sandbox_id: unplaced.id.clone(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert!(
            shown.route_identity.is_none(),
            "placement reads share the rule"
        );
        assert_eq!(shown.pending_wake.unwrap().id, wake.id);
    }

    let route = api
        .resolve_route(resolve(&placed.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (route.node_id.as_str(), route.endpoint.as_str()),
        ("node-a", "127.0.0.1:7443")
    );
    let node_a_key = route_token::node_key(
        &route_token::default_key(runplane_testkit::SERVICE_TOKEN),
        "node-a",
    );
    let claims = route_token::verify(&node_a_key, &route.route_token, w.clock.now().timestamp())
        .expect("a valid route token");
    assert_eq!(
        (claims.sandbox_id, claims.node_id),
        (placed.id.clone(), "node-a".to_owned())
    );
    assert!(
        w.store.open_wake(&placed.id).await.unwrap().is_none(),
        "no wake for a placed row"
    );
}

/// Several hosts: a wake goes to the node holding the sandbox, a node's publication is a
/// compare-and-set on its ownership, a node lost with suspended sandboxes ends their runs
/// through the loss grace, and a failing restore settles instead of looping.
mod many_hosts {
    use super::*;
    use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
    use runplane_sandbox_reconciler::drivers::{ProcessDriver, RoutedDriver};
    use runplane_sandbox_reconciler::store::entities::wake;
    use sea_orm::{
        ActiveModelTrait, ConnectionTrait, EntityTrait, IntoActiveModel, TransactionTrait,
    };

    runplane_testkit::on_both_backends!(
        workers 4,
        World::start =>
        a_wake_goes_to_the_node_holding_the_sandbox_and_waits_for_it,
        a_node_lost_with_suspended_sandboxes_ends_their_runs_once_after_the_grace,
        a_failing_restore_backs_off_and_settles_instead_of_looping,
    );

    async fn heartbeat(w: &World, node: &str, epoch: u64, used: u32) {
        nodes(w)
            .await
            .heartbeat(authed(
                reconciler_pb::HeartbeatRequest {
                    node_id: node.into(),
                    epoch,
                    used,
                },
                &node_token(node),
            ))
            .await
            .unwrap();
    }

    async fn restores_listed(w: &World, node: &str, epoch: u64) -> Vec<reconciler_pb::Assignment> {
        nodes(w)
            .await
            .list_assigned_sandboxes(authed(
                reconciler_pb::ListAssignedSandboxesRequest {
                    node_id: node.into(),
                    epoch,
                    known_revision: 0,
                    wait: None,
                },
                &node_token(node),
            ))
            .await
            .unwrap()
            .into_inner()
            .assignments
            .into_iter()
            .filter(|a| a.intent() == reconciler_pb::AssignmentIntent::Restore)
            .collect()
    }

    /// A running run whose sandbox node `node` ran and then suspended for idleness,
    /// published through NodeService as the agent does.
    async fn suspended_run(w: &World, name: &str, node: &str, epoch: u64) -> sandbox::Model {
        let (row, _) = w.running_sandbox(name).await;
        let mut placed = row.into_active_model();
        placed.active_node_id = sea_orm::Set(Some(node.to_owned()));
        let row = placed.update(w.store.database()).await.unwrap();
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: node.into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let answer = nodes(w)
            .await
            .publish_sandbox_state(publish(
                node,
                epoch,
                &row,
                10,
                reconciler_pb::SandboxStatus::Suspended,
                false,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(answer.applied);
        w.store.sandbox(&row.id).await.unwrap()
    }

    /// The reconciler as `runplane serve` builds it: node sandboxes probed through what
    /// their nodes publish and how recently they heartbeat.
    fn routed(w: &World, state: &std::path::Path) -> Reconciler {
        Reconciler::new(
            w.store.clone(),
            Arc::new(RoutedDriver::new(
                ProcessDriver::new(state, "/nonexistent/runplane"),
                w.store.clone(),
            )),
            ReconcileSettings {
                loss_grace: GRACE,
                dispatch: false,
                ..ReconcileSettings::default()
            },
        )
    }

    async fn a_wake_goes_to_the_node_holding_the_sandbox_and_waits_for_it(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        // node-a is busier: the least-used rule would pick node-b.
        heartbeat(&w, "node-a", a, 3).await;
        heartbeat(&w, "node-b", b, 0).await;
        let row = w.suspended_on("node-a", "run-holder").await;
        let wake = w.store.queue_wake(&row.id, "reattach").await.unwrap();

        // node-a silent: the wake waits for it rather than going to node-b.
        w.clock.advance(Duration::from_secs(11));
        heartbeat(&w, "node-b", b, 0).await;
        assert_eq!(
            w.store.assign_wakes(w.store.silent_since()).await.unwrap(),
            0
        );
        assert!(restores_listed(&w, "node-b", b).await.is_empty());

        heartbeat(&w, "node-a", a, 3).await;
        assert_eq!(
            w.store.assign_wakes(w.store.silent_since()).await.unwrap(),
            1
        );
        let on_a = restores_listed(&w, "node-a", a).await;
        assert_eq!(on_a.len(), 1);
        assert_eq!(on_a[0].wake_id, wake.id);
        assert!(restores_listed(&w, "node-b", b).await.is_empty());
    }

    /// Backends of this test's database waiting on a lock.
    async fn lock_waiters(db: &sea_orm::DatabaseConnection) -> i64 {
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT count(*) AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get::<i64>("", "n").unwrap()
    }

    async fn until_lock_waiters(db: &sea_orm::DatabaseConnection, n: i64) {
        for _ in 0..500 {
            if lock_waiters(db).await >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{n} backends never waited on a lock");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_publication_racing_a_restore_does_not_overwrite_it() {
        let w = World::start(Backend::postgres().await).await;
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-a", "run-publication-race").await;
        // A wake handed to node-b (the least-used rule did this; a driver that restores
        // anywhere still may), which restores the sandbox.
        let queued = w.store.queue_wake(&row.id, "reattach").await.unwrap();
        let mut handed = queued.clone().into_active_model();
        handed.state = sea_orm::Set("assigned".into());
        handed.node_id = sea_orm::Set(Some("node-b".into()));
        handed.attempts = sea_orm::Set(1);
        handed.update(w.store.database()).await.unwrap();

        // A second connection holds the wake row, so the restore stops after writing the
        // sandbox row and before it commits.
        let holder = sea_orm::Database::connect(w._dbs.1.url()).await.unwrap();
        let held = holder.begin().await.unwrap();
        held.execute_unprepared(&format!(
            "SELECT id FROM wakes WHERE id = '{}' FOR UPDATE",
            queued.id
        ))
        .await
        .unwrap();
        let restore = {
            let endpoint = w.reconciler_endpoint.clone();
            let (wake_id, sandbox_id) = (queued.id.clone(), row.id.clone());
            tokio::spawn(async move {
                NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .report_restored(authed(
                        reconciler_pb::ReportRestoredRequest {
                            node_id: "node-b".into(),
                            epoch: b,
                            wake_id,
                            sandbox_id,
                            execution_generation: 1,
                            wake_attempt: 1,
                        },
                        &node_token("node-b"),
                    ))
                    .await
            })
        };
        until_lock_waiters(w.store.database(), 1).await;
        // node-a's publication (its suspend, sent again) reads the row as it was, still
        // node-a's, and its write waits behind the restore.
        let stale = {
            let endpoint = w.reconciler_endpoint.clone();
            let row = row.clone();
            tokio::spawn(async move {
                NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .publish_sandbox_state(publish(
                        "node-a",
                        a,
                        &row,
                        20,
                        reconciler_pb::SandboxStatus::Suspended,
                        false,
                    ))
                    .await
            })
        };
        until_lock_waiters(w.store.database(), 2).await;
        held.commit().await.unwrap();

        let restored = restore.await.unwrap();
        let lost = stale.await.unwrap().unwrap_err();
        assert_eq!(lost.code(), Code::PermissionDenied, "{lost:?}");
        assert_eq!(
            error_info(&lost).unwrap().reason,
            ErrorReason::NodeNotOwner.as_str_name()
        );
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.active_node_id.as_deref()),
            ("started", Some("node-b")),
            "the restore stands"
        );
        restored.unwrap();
        assert_eq!(
            w.store
                .route_of(&row.id)
                .await
                .unwrap()
                .unwrap()
                .current_node_id,
            "node-b"
        );
    }

    async fn a_node_lost_with_suspended_sandboxes_ends_their_runs_once_after_the_grace(w: World) {
        // No sandbox here is local: the process driver is never asked.
        let state = std::env::temp_dir().join(uuid::Uuid::new_v4().to_string());
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let on_a = [
            suspended_run(&w, "lost-host-1", "node-a", a).await,
            suspended_run(&w, "lost-host-2", "node-a", a).await,
        ];
        let on_b = suspended_run(&w, "live-host", "node-b", b).await;
        let waiting = w.store.queue_wake(&on_a[0].id, "reattach").await.unwrap();
        let reconciler = routed(&w, &state);

        // Both nodes heartbeat: suspended sandboxes wait for their wakes.
        assert_eq!(reconciler.tick().await.unwrap().stamped, 0);

        // node-a falls silent for good; node-b keeps heartbeating.
        w.clock.advance(Duration::from_secs(11));
        heartbeat(&w, "node-b", b, 0).await;
        let first = reconciler.tick().await.unwrap();
        assert_eq!(first.stamped, 2, "{first:?}");
        assert_eq!(first.confirmed, 0, "one observation fails nothing");
        assert!(
            w.store
                .sandbox(&on_b.id)
                .await
                .unwrap()
                .loss_observed_at_us
                .is_none()
        );

        // Past the grace: overlapping ticks confirm each loss once.
        w.clock.advance(GRACE);
        heartbeat(&w, "node-b", b, 0).await;
        let (one, two) = tokio::join!(reconciler.tick(), reconciler.tick());
        assert_eq!(one.unwrap().confirmed + two.unwrap().confirmed, 2);
        let client = w.outbox_client().await;
        deliver_outbox(&w.store, &client, 100).await.unwrap();
        reconciler.tick().await.unwrap();
        deliver_outbox(&w.store, &client, 100).await.unwrap();
        assert_eq!(
            w.fail_run_calls.load(Ordering::SeqCst),
            2,
            "one FailRun per run"
        );
        for row in &on_a {
            // No other node can restore a suspended sandbox: its attempt ends, once,
            // and the run's next attempt is due in a new sandbox.
            w.first_attempt_ended(&row.run_id, "sandbox_lost").await;
            assert_eq!(w.store.sandbox(&row.id).await.unwrap().status, "lost");
        }
        let settled = wake::Entity::find_by_id(waiting.id.clone())
            .one(w.store.database())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(settled.state, "failed", "nothing restores a lost sandbox");
        assert_eq!(
            w.run_state(&on_b.run_id).await.state(),
            runstore_pb::RunState::Running,
            "a live host's suspended run waits for its wake"
        );
    }

    async fn a_failing_restore_backs_off_and_settles_instead_of_looping(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-a", "run-failing-restore").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let request_wake = || {
            authed(
                reconciler_pb::RequestWakeRequest {
                    sandbox_id: row.id.clone(),
                    reason: "reattach".into(),
                },
                TOKEN,
            )
        };
        // A minute of a client reattaching four times a second, a reconciler round at
        // each, and node-a failing every restore it is handed.
        let step = Duration::from_millis(250);
        let steps = 4 * 60;
        let mut attempts = 0;
        for _ in 0..steps {
            w.clock.advance(step);
            heartbeat(&w, "node-a", a, 0).await;
            heartbeat(&w, "node-b", b, 0).await;
            api.request_wake(request_wake()).await.unwrap();
            w.store.assign_wakes(w.store.silent_since()).await.unwrap();
            assert!(
                restores_listed(&w, "node-b", b).await.is_empty(),
                "only the holder"
            );
            for restore in restores_listed(&w, "node-a", a).await {
                attempts += 1;
                nodes(&w)
                    .await
                    .report_wake_failed(authed(
                        reconciler_pb::ReportWakeFailedRequest {
                            node_id: "node-a".into(),
                            epoch: a,
                            wake_id: restore.wake_id,
                            wake_attempt: restore.wake_attempt,
                            error: "could not signal the sandbox".into(),
                        },
                        &node_token("node-a"),
                    ))
                    .await
                    .unwrap();
            }
        }
        // A wake tries 3 times within 3 s; the next one waits 30 s after it failed.
        let window = Duration::from_millis(250) * steps;
        let bound = 3 * (window.as_secs() / 30 + 1);
        assert!(
            attempts > 0 && attempts <= bound,
            "{attempts} restores in {window:?}"
        );

        // Once node-a says the process is gone, nothing is handed out again.
        nodes(&w)
            .await
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                30,
                reconciler_pb::SandboxStatus::Lost,
                false,
            ))
            .await
            .unwrap();
        let mut after = 0;
        for _ in 0..steps {
            w.clock.advance(step);
            heartbeat(&w, "node-a", a, 0).await;
            let _ = api.request_wake(request_wake()).await;
            w.store.assign_wakes(w.store.silent_since()).await.unwrap();
            after += restores_listed(&w, "node-a", a).await.len();
        }
        assert_eq!(after, 0, "no restore of a sandbox its holder saw gone");
    }
}
