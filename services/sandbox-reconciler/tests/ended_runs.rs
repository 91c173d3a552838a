//! Ended runs (`common`): a round deletes every sandbox of an ended run, stops the local
//! ones itself and tells each node to stop its own; a late wake or restore is refused.

mod common;

use std::sync::Arc;

use common::*;
use runplane_clock::Clock;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::{ReconcileSettings, Reconciler, RunnerEndpoints};
use runplane_sandbox_reconciler::store::entities::{route_identity, sandbox};
use tonic::Code;

/// Whatever ends a run, its sandboxes go (suspended ones included) and nothing revives
/// them (docs/architecture.md "A run's life and its end").
mod convergence {
    use super::*;
    use runplane_proto::reconciler::v1::node_service_client::NodeServiceClient;
    use runplane_sandbox_reconciler::store::entities::wake;
    use sea_orm::{ActiveModelTrait, EntityTrait, IntoActiveModel};

    runplane_testkit::on_both_backends!(
        World::start =>
        every_sandbox_of_an_ended_run_is_deleted_in_one_round_and_stopped_by_its_owner,
        a_late_wake_or_restore_of_a_destroyed_sandbox_is_refused_and_settles_the_wake,
        a_wake_of_a_sandbox_whose_run_ended_is_refused_and_deletes_it,
        a_restore_that_races_the_sweep_loses_and_its_node_stops_the_sandbox,
        a_run_id_the_run_store_does_not_take_does_not_stop_the_sweep_of_the_others,
        ended_records_go_after_their_retention_and_a_stop_still_owed_stays,
    );

    /// Deleted sandboxes whose stop was acknowledged, settled wakes and delivered outbox
    /// rows stayed for ever. A round now deletes them past retention, and never a
    /// sandbox still owed a stop (its node has not stopped it yet).
    async fn ended_records_go_after_their_retention_and_a_stop_still_owed_stays(w: World) {
        let mut stopped = w.row(
            "sbx-stopped",
            &new_id(),
            "direct",
            "deleted",
            Some("node-a"),
        );
        stopped.observed_status = "deleted".into();
        let stopped = w.insert(stopped, None).await;
        let owed = w
            .insert(
                w.row("sbx-owed", &new_id(), "direct", "deleted", Some("node-a")),
                None,
            )
            .await;
        let live = w
            .insert(
                w.row("sbx-live", &new_id(), "direct", "started", Some("node-a")),
                None,
            )
            .await;
        let settled = wake::Model {
            id: new_id(),
            sandbox_id: live.id.clone(),
            state: "restored".into(),
            node_id: Some("node-a".into()),
            attempts: 1,
            last_error: String::new(),
            reason: "message".into(),
            requested_at_us: w.clock.now().timestamp_micros(),
            settled_at_us: Some(w.clock.now().timestamp_micros()),
            not_before_us: None,
        };
        settled
            .clone()
            .into_active_model()
            .insert(w.store.database())
            .await
            .unwrap();
        let reconciler = Reconciler::new(
            w.store.clone(),
            Arc::new(FakeDriver::always(Probe::Alive)),
            ReconcileSettings {
                dispatch: false,
                retention: std::time::Duration::from_secs(60),
                ..ReconcileSettings::default()
            },
        );
        // Within retention nothing goes.
        assert_eq!(reconciler.prune().await.unwrap(), Default::default());
        w.clock.advance(std::time::Duration::from_secs(61));
        let pruned = reconciler.prune().await.unwrap();
        assert_eq!((pruned.sandboxes, pruned.wakes), (1, 1), "{pruned:?}");
        let left: Vec<String> = sandbox::Entity::find()
            .all(w.store.database())
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert!(!left.contains(&stopped.id), "{left:?}");
        assert!(
            left.contains(&owed.id) && left.contains(&live.id),
            "{left:?}"
        );
        assert!(
            wake::Entity::find_by_id(settled.id)
                .one(w.store.database())
                .await
                .unwrap()
                .is_none()
        );
        // The node still owes sbx-owed a stop, and is still told to.
        let owed_stops = w.store.destroys_owed("node-a", 10).await.unwrap();
        assert_eq!(owed_stops.len(), 1);
        assert_eq!(owed_stops[0].id, owed.id);
    }

    impl World {
        /// Ends `run_id` the way a service does (FailRun with the service token).
        async fn end_run(&self, run_id: &str) {
            self.run_store()
                .await
                .fail_run(authed(
                    runstore_pb::FailRunRequest {
                        run_id: run_id.into(),
                        reason: "test_ended".into(),
                        message: "ended by the test".into(),
                        idempotency_key: format!("end-{run_id}"),
                        ..Default::default()
                    },
                    TOKEN,
                ))
                .await
                .unwrap();
            assert!(self.run_state(run_id).await.state().is_terminal());
        }

        /// A reconciler whose rounds do everything but dispatch.
        fn sweeper(&self, driver: FakeDriver) -> Reconciler {
            Reconciler::new(
                self.store.clone(),
                Arc::new(driver),
                ReconcileSettings {
                    loss_grace: GRACE,
                    dispatch: false,
                    ..ReconcileSettings::default()
                },
            )
        }

        fn endpoints(&self) -> RunnerEndpoints {
            RunnerEndpoints {
                run_store: self.run_store_endpoint.clone(),
                stream_recovery: self.run_store_endpoint.clone(),
            }
        }

        async fn insert(&self, row: sandbox::Model, routed_to: Option<&str>) -> sandbox::Model {
            let row = self.store.insert_sandbox(row).await.unwrap();
            if let Some(node) = routed_to {
                self.store
                    .set_route_identity(route_identity::Model {
                        sandbox_id: row.id.clone(),
                        current_node_id: node.into(),
                        execution_generation: row.execution_generation,
                    })
                    .await
                    .unwrap();
            }
            row
        }

        async fn wake_row(&self, id: &str) -> wake::Model {
            wake::Entity::find_by_id(id.to_owned())
                .one(self.store.database())
                .await
                .unwrap()
                .unwrap()
        }

        async fn status_shown(&self, id: &str) -> reconciler_pb::Sandbox {
            SandboxServiceClient::connect(self.reconciler_endpoint.clone())
                .await
                .unwrap()
                .get_sandbox(authed(
                    reconciler_pb::GetSandboxRequest {
                        sandbox_id: id.into(),
                    },
                    TOKEN,
                ))
                .await
                .unwrap()
                .into_inner()
                .sandbox
                .unwrap()
        }
    }

    fn new_id() -> String {
        uuid::Uuid::new_v4().to_string()
    }

    async fn assigned(w: &World, node: &str, epoch: u64) -> Vec<reconciler_pb::Assignment> {
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
    }

    fn intents(
        assignments: &[reconciler_pb::Assignment],
        intent: reconciler_pb::AssignmentIntent,
    ) -> Vec<String> {
        let mut ids: Vec<String> = assignments
            .iter()
            .filter(|a| a.intent() == intent)
            .map(|a| a.sandbox_id.clone())
            .collect();
        ids.sort();
        ids
    }

    fn report_restored(
        node: &str,
        epoch: u64,
        wake_id: &str,
        sandbox_id: &str,
    ) -> tonic::Request<reconciler_pb::ReportRestoredRequest> {
        authed(
            reconciler_pb::ReportRestoredRequest {
                node_id: node.into(),
                epoch,
                wake_id: wake_id.into(),
                sandbox_id: sandbox_id.into(),
                execution_generation: 1,
                wake_attempt: 1,
            },
            &node_token(node),
        )
    }

    async fn every_sandbox_of_an_ended_run_is_deleted_in_one_round_and_stopped_by_its_owner(
        w: World,
    ) {
        let a = register(&w, "node-a", "a").await;
        let (started, _) = w.running_sandbox("ended").await;
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: started.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let run = started.run_id.clone();
        let creating = w
            .insert(
                w.row(&new_id(), &run, "direct", "creating", Some("node-a")),
                Some("node-a"),
            )
            .await;
        // Idle-suspended by node-a and published unplaced, with a wake waiting.
        let suspended = w
            .insert(
                w.row(&new_id(), &run, "direct", "suspended", None),
                Some("node-a"),
            )
            .await;
        let wake = w.store.queue_wake(&suspended.id, "reattach").await.unwrap();
        let local = w
            .insert(
                sandbox::Model {
                    driver_handle: "fake:local".into(),
                    ..w.row(&new_id(), &run, "direct", "started", Some("local"))
                },
                None,
            )
            .await;
        // An exit already confirmed, and an exit only observed: neither is deleted yet.
        let exited = w
            .insert(
                w.row(&new_id(), &run, "direct", "exited", Some("local")),
                None,
            )
            .await;
        let observed_exit = w
            .insert(
                sandbox::Model {
                    observed_status: "exited".into(),
                    ..w.row(&new_id(), &run, "direct", "started", Some("node-a"))
                },
                Some("node-a"),
            )
            .await;
        let (survivor, _) = w.running_sandbox("still-running").await;
        w.end_run(&run).await;

        let driver = FakeDriver::always(Probe::Alive);
        let reconciler = w.sweeper(driver.clone());
        reconciler
            .round(&w.outbox_client().await, &w.endpoints())
            .await;

        let ended = [
            &started,
            &creating,
            &suspended,
            &local,
            &exited,
            &observed_exit,
        ];
        let listed = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap()
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    run_id: run.clone(),
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandboxes;
        assert_eq!(listed.len(), ended.len());
        for s in &listed {
            assert_eq!(s.status(), reconciler_pb::SandboxStatus::Deleted, "{s:?}");
            assert!(s.pending_wake.is_none());
        }
        assert_eq!(
            w.status_shown(&survivor.id).await.status(),
            reconciler_pb::SandboxStatus::Started,
            "a running run keeps its sandbox"
        );
        // The deletion settled the wake: no node restores what was destroyed.
        let settled = w.wake_row(&wake.id).await;
        assert_eq!(settled.state, "failed");
        assert!(settled.settled_at_us.is_some());

        // Local ones were stopped by the reconciler itself, in the same round.
        let mut stopped = driver.destroyed();
        stopped.sort();
        let mut local_ids = vec![local.id.clone(), exited.id.clone()];
        local_ids.sort();
        assert_eq!(stopped, local_ids);

        // node-a is told to stop its own, the suspended one included, and the survivor
        // keeps running; once it acknowledges, nothing more is owed.
        let list = assigned(&w, "node-a", a).await;
        let mut node_ids = vec![
            started.id.clone(),
            creating.id.clone(),
            suspended.id.clone(),
            observed_exit.id.clone(),
        ];
        node_ids.sort();
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Destroy),
            node_ids
        );
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Run),
            vec![survivor.id.clone()]
        );
        for id in &node_ids {
            let acked = nodes(&w)
                .await
                .publish_sandbox_state(authed(
                    reconciler_pb::PublishSandboxStateRequest {
                        node_id: "node-a".into(),
                        epoch: a,
                        sandbox_id: id.clone(),
                        execution_generation: 1,
                        observation_seq: 100,
                        status: reconciler_pb::SandboxStatus::Deleted as i32,
                        placed: false,
                        exit_code: None,
                        observed_at: None,
                        waiting_for_input: None,
                    },
                    &node_token("node-a"),
                ))
                .await
                .unwrap()
                .into_inner();
            assert!(acked.applied);
            assert_eq!(
                acked.sandbox.unwrap().status(),
                reconciler_pb::SandboxStatus::Deleted
            );
        }
        assert!(
            intents(
                &assigned(&w, "node-a", a).await,
                reconciler_pb::AssignmentIntent::Destroy
            )
            .is_empty()
        );
        // A second round owes nothing again: every stop was acknowledged.
        reconciler
            .round(&w.outbox_client().await, &w.endpoints())
            .await;
        assert_eq!(driver.destroyed().len(), 2);
    }

    async fn a_late_wake_or_restore_of_a_destroyed_sandbox_is_refused_and_settles_the_wake(
        w: World,
    ) {
        let b = register(&w, "node-b", "b").await;
        let (row, _) = w.running_sandbox("late-wake").await;
        // node-b ran it and suspended it: node-b holds it, and its wakes go to node-b.
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
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
        let wake = api
            .request_wake(request_wake())
            .await
            .unwrap()
            .into_inner()
            .wake
            .expect("a wake for an unplaced sandbox of a running run");
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);

        // Destroyed while node-b restores it.
        let destroyed = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: row.id.clone(),
                    reason: "test".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(destroyed.status(), reconciler_pb::SandboxStatus::Deleted);
        assert_eq!(
            w.wake_row(&wake.id).await.state,
            "failed",
            "settled with it"
        );

        let late = nodes(&w)
            .await
            .report_restored(report_restored("node-b", b, &wake.id, &row.id))
            .await
            .unwrap_err();
        assert_eq!(late.code(), Code::FailedPrecondition);
        assert_eq!(
            error_info(&late).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        let shown = w.status_shown(&row.id).await;
        assert_eq!(shown.status(), reconciler_pb::SandboxStatus::Deleted);
        assert!(
            shown.active_node_id.is_empty(),
            "not placed by the late restore"
        );

        // A late reattach or wake request queues nothing.
        for err in [
            api.request_wake(request_wake()).await.unwrap_err(),
            api.resolve_route(authed(
                reconciler_pb::ResolveRouteRequest {
                    sandbox_id: row.id.clone(),
                    session_id: "session-1".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err(),
        ] {
            assert_eq!(
                error_info(&err).unwrap().reason,
                ErrorReason::SandboxEnded.as_str_name()
            );
        }
        assert!(w.store.open_wake(&row.id).await.unwrap().is_none());

        // A wake that got in anyway (queued as the deletion committed) is settled, not
        // assigned.
        let stray = wake::Model {
            id: new_id(),
            sandbox_id: row.id.clone(),
            state: "pending".into(),
            node_id: None,
            attempts: 0,
            last_error: String::new(),
            reason: "stray".into(),
            requested_at_us: w.clock.now().timestamp_micros(),
            settled_at_us: None,
            not_before_us: None,
        };
        stray
            .clone()
            .into_active_model()
            .insert(w.store.database())
            .await
            .unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 0);
        assert_eq!(w.wake_row(&stray.id).await.state, "failed");

        // And one assigned before the row was deleted behind its back: the restore itself
        // refuses an ended row and settles the wake.
        let (other, _) = w.running_sandbox("restore-after-delete").await;
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: other.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&other.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        let wake = w.store.queue_wake(&other.id, "reattach").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let mut deleted = other.clone().into_active_model();
        deleted.status = sea_orm::Set(sandbox::SandboxStatus::Deleted);
        deleted.update(w.store.database()).await.unwrap();
        let late = nodes(&w)
            .await
            .report_restored(report_restored("node-b", b, &wake.id, &other.id))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&late).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        assert_eq!(w.wake_row(&wake.id).await.state, "failed");
        assert_eq!(
            w.status_shown(&other.id).await.status(),
            reconciler_pb::SandboxStatus::Deleted,
            "never revived"
        );
    }

    async fn a_wake_of_a_sandbox_whose_run_ended_is_refused_and_deletes_it(w: World) {
        let (row, _) = w.running_sandbox("wake-ended-run").await;
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        w.end_run(&row.run_id).await;
        let err = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap()
            .request_wake(authed(
                reconciler_pb::RequestWakeRequest {
                    sandbox_id: row.id.clone(),
                    reason: "reattach".into(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );
        assert!(w.store.open_wake(&row.id).await.unwrap().is_none());
        assert_eq!(
            w.status_shown(&row.id).await.status(),
            reconciler_pb::SandboxStatus::Deleted
        );
    }

    async fn a_restore_that_races_the_sweep_loses_and_its_node_stops_the_sandbox(w: World) {
        let b = register(&w, "node-b", "b").await;
        let (row, _) = w.running_sandbox("restore-race").await;
        // Suspended by node-b, which holds it.
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-b".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        assert!(
            w.store
                .publish(&row.id, 1, "suspended", None)
                .await
                .unwrap()
        );
        let wake = w.store.queue_wake(&row.id, "reattach").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        w.end_run(&row.run_id).await;

        // The sweep has read the row (suspended, unplaced) and asks the run store; node-b's
        // restore lands while that question is in flight.
        let endpoint = w.reconciler_endpoint.clone();
        let (wake_id, sandbox_id) = (wake.id.clone(), row.id.clone());
        *w.on_list_runs.lock().unwrap() = Some(Box::new(move || {
            Box::pin(async move {
                let restored = NodeServiceClient::connect(endpoint)
                    .await
                    .unwrap()
                    .report_restored(report_restored("node-b", b, &wake_id, &sandbox_id))
                    .await
                    .unwrap()
                    .into_inner()
                    .sandbox
                    .unwrap();
                assert_eq!(restored.active_node_id, "node-b");
            })
        }));
        w.sweeper(FakeDriver::always(Probe::Alive))
            .delete_sandboxes_of_ended_runs(&w.outbox_client().await)
            .await
            .unwrap();
        assert!(w.on_list_runs.lock().unwrap().is_none(), "the hook ran");

        let shown = w.status_shown(&row.id).await;
        assert_eq!(
            shown.status(),
            reconciler_pb::SandboxStatus::Deleted,
            "the deletion wins"
        );
        // The node that restored it is the one told to stop it.
        let list = assigned(&w, "node-b", b).await;
        assert_eq!(
            intents(&list, reconciler_pb::AssignmentIntent::Destroy),
            vec![row.id.clone()]
        );
        assert!(intents(&list, reconciler_pb::AssignmentIntent::Run).is_empty());
    }

    /// A sandbox row that names its run in a spelling the run store does not take (a UUID
    /// without hyphens, say, written by hand or by an older version) is left out of the
    /// question: the run store refuses a whole ListRuns question for one such id, which
    /// stopped the sweep of every other sandbox in the batch with it.
    async fn a_run_id_the_run_store_does_not_take_does_not_stop_the_sweep_of_the_others(w: World) {
        let (ended, _) = w.running_sandbox("ended-beside-odd-id").await;
        let odd_run = uuid::Uuid::new_v4().simple().to_string();
        let odd = w
            .insert(
                w.row(&new_id(), &odd_run, "direct", "started", Some("local")),
                None,
            )
            .await;
        w.end_run(&ended.run_id).await;

        let deleted = w
            .sweeper(FakeDriver::always(Probe::Alive))
            .delete_sandboxes_of_ended_runs(&w.outbox_client().await)
            .await
            .expect("the sweep asks about the run ids the run store takes");
        assert_eq!(deleted, 1);
        assert!(w.store.sandbox(&ended.id).await.unwrap().status.is_ended());
        assert!(!w.store.sandbox(&odd.id).await.unwrap().status.is_ended());
    }
}
