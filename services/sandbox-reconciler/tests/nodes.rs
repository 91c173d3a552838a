//! Nodes and the sandbox API (`common`): dispatch waits for a registered node agent, a
//! new boot fences the old epoch, a node publishes only for rows it owns, a restore
//! settles its wake, and every field and page is bounded before anything is written.

mod common;

use common::*;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_proto::reconciler::v1::sandbox_service_client::SandboxServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_sandbox_reconciler::store::entities::route_identity;
use tonic::Code;

mod node_protocol {
    use super::*;

    runplane_testkit::on_both_backends!(
        World::start =>
        without_local_sandboxes_a_queued_run_waits_for_a_node_agent,
        a_new_boot_fences_the_old_epoch,
        a_node_publishes_only_for_rows_it_owns_and_never_an_older_observation,
        a_restore_writes_placement_and_route_identity_and_settles_the_wake,
        numbers_past_their_columns_and_oversized_strings_are_refused_before_any_write,
        an_oversized_page_is_refused_by_both_lists,
        create_is_keyed_and_destroy_ends_the_sandbox,
        a_far_off_idle_timeout_does_not_overflow_create,
    );

    async fn without_local_sandboxes_a_queued_run_waits_for_a_node_agent(w: World) {
        // Several reconciler replicas: none may run a sandbox in its own process tree,
        // where the others could not probe or signal it.
        let run = w.queued_run("waits-for-a-node").await;
        w.dispatch_once(&w.store).await;
        assert!(
            w.store.live_sandbox_of(&run.id).await.unwrap().is_none(),
            "no sandbox without a node agent"
        );
        assert_eq!(
            w.run_state(&run.id).await.state(),
            runstore_pb::RunState::Queued
        );

        register(&w, "node-a", "a").await;
        w.dispatch_once(&w.store).await;
        let row = w
            .store
            .live_sandbox_of(&run.id)
            .await
            .unwrap()
            .expect("placed");
        assert_eq!(row.active_node_id.as_deref(), Some("node-a"));
    }

    async fn a_new_boot_fences_the_old_epoch(w: World) {
        let first = register(&w, "node-a", "one").await;
        assert_eq!(
            register(&w, "node-a", "one").await,
            first,
            "the same boot keeps its epoch"
        );
        let second = register(&w, "node-a", "two").await;
        assert_eq!(second, first + 1);
        let err = nodes(&w)
            .await
            .heartbeat(authed(
                reconciler_pb::HeartbeatRequest {
                    node_id: "node-a".into(),
                    epoch: first,
                    used: 0,
                },
                &node_token("node-a"),
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::NodeEpochStale.as_str_name()
        );
    }

    async fn a_node_publishes_only_for_rows_it_owns_and_never_an_older_observation(w: World) {
        let a = register(&w, "node-a", "a").await;
        let b = register(&w, "node-b", "b").await;
        let row = w
            .store
            .insert_sandbox(w.row(
                &uuid::Uuid::new_v4().to_string(),
                "run-o",
                "direct",
                "started",
                Some("node-a"),
            ))
            .await
            .unwrap();
        w.store
            .set_route_identity(route_identity::Model {
                sandbox_id: row.id.clone(),
                current_node_id: "node-a".into(),
                execution_generation: 1,
            })
            .await
            .unwrap();
        let mut client = nodes(&w).await;

        let err = client
            .publish_sandbox_state(publish(
                "node-b",
                b,
                &row,
                10,
                reconciler_pb::SandboxStatus::Exited,
                true,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied);
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::NodeNotOwner.as_str_name()
        );

        // node-a suspends for idleness and gives up the placement; its route identity stays.
        let answer = client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                10,
                reconciler_pb::SandboxStatus::Suspended,
                false,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(answer.applied);
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.active_node_id),
            ("suspended", None)
        );
        // Still node-a's to publish for (its route identity, same generation); not node-b's.
        let older = client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                9,
                reconciler_pb::SandboxStatus::Started,
                true,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(!older.applied, "an older observation changes nothing");
        assert!(
            client
                .publish_sandbox_state(publish(
                    "node-b",
                    b,
                    &row,
                    11,
                    reconciler_pb::SandboxStatus::Started,
                    true
                ))
                .await
                .is_err()
        );

        // An exit is an observation: the row stays live until the loss grace decides.
        client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                12,
                reconciler_pb::SandboxStatus::Started,
                true,
            ))
            .await
            .unwrap();
        client
            .publish_sandbox_state(publish(
                "node-a",
                a,
                &row,
                13,
                reconciler_pb::SandboxStatus::Exited,
                true,
            ))
            .await
            .unwrap();
        let now = w.store.sandbox(&row.id).await.unwrap();
        assert_eq!(
            (now.status.as_str(), now.observed_status.as_str()),
            ("started", "exited")
        );
    }

    async fn a_restore_writes_placement_and_route_identity_and_settles_the_wake(w: World) {
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-b", "run-w").await;
        let wake = w.store.queue_wake(&row.id, "test").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let mut client = nodes(&w).await;
        let assigned = client
            .list_assigned_sandboxes(authed(
                reconciler_pb::ListAssignedSandboxesRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    known_revision: 0,
                    wait: None,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap()
            .into_inner();
        let restore = assigned
            .assignments
            .iter()
            .find(|a| a.intent() == reconciler_pb::AssignmentIntent::Restore)
            .expect("a restore assignment");
        assert_eq!(
            (restore.wake_id.as_str(), restore.wake_attempt),
            (wake.id.as_str(), 1)
        );

        let restored = client
            .report_restored(authed(
                reconciler_pb::ReportRestoredRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    wake_id: wake.id.clone(),
                    sandbox_id: row.id.clone(),
                    execution_generation: 1,
                    wake_attempt: 1,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(restored.active_node_id, "node-b");
        assert_eq!(
            restored.route_identity.as_ref().unwrap().current_node_id,
            "node-b"
        );
        assert!(
            w.store.open_wake(&row.id).await.unwrap().is_none(),
            "the wake is settled"
        );
        // The same report again (its answer was lost) gets the same answer, as the
        // method's replay safety says, and writes nothing.
        let report = |attempt: u32, node: &str, epoch: u64| {
            authed(
                reconciler_pb::ReportRestoredRequest {
                    node_id: node.into(),
                    epoch,
                    wake_id: wake.id.clone(),
                    sandbox_id: row.id.clone(),
                    execution_generation: 1,
                    wake_attempt: attempt,
                },
                &node_token(node),
            )
        };
        let before = w.store.sandbox(&row.id).await.unwrap();
        let again = client
            .report_restored(report(1, "node-b", b))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(again, restored);
        assert_eq!(w.store.sandbox(&row.id).await.unwrap(), before);
        // Another attempt's report finds the wake settled.
        let other = client
            .report_restored(report(2, "node-b", b))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&other).unwrap().reason,
            ErrorReason::WakeSettled.as_str_name()
        );
    }

    async fn numbers_past_their_columns_and_oversized_strings_are_refused_before_any_write(
        w: World,
    ) {
        use runplane_sandbox_reconciler::store::entities::wake;
        use sea_orm::EntityTrait;
        let b = register(&w, "node-b", "b").await;
        let row = w.suspended_on("node-b", "run-bounds").await;
        let queued = w.store.queue_wake(&row.id, "test").await.unwrap();
        assert_eq!(w.store.assign_wakes(0).await.unwrap(), 1);
        let wake_of = || async {
            wake::Entity::find_by_id(queued.id.clone())
                .one(w.store.database())
                .await
                .unwrap()
                .unwrap()
        };
        let assigned = wake_of().await;
        let mut client = nodes(&w).await;
        let failed = |epoch: u64, attempt: u32, error: String| {
            authed(
                reconciler_pb::ReportWakeFailedRequest {
                    node_id: "node-b".into(),
                    epoch,
                    wake_id: queued.id.clone(),
                    wake_attempt: attempt,
                    error,
                },
                &node_token("node-b"),
            )
        };
        let field = |e: &tonic::Status| {
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            error_info(e).unwrap().metadata["field"].clone()
        };
        // 2 bytes a character: 513 bytes over the bound, ending inside a character at 512.
        let long = format!("x{}", "é".repeat(256));
        let e = client
            .report_wake_failed(failed(b, 1, long.clone()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "error");
        let e = client
            .report_wake_failed(failed(u64::MAX, 1, "boom".into()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "epoch");
        let e = client
            .report_wake_failed(failed(b, u32::MAX, "boom".into()))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "wake_attempt");
        assert_eq!(wake_of().await, assigned, "nothing written");

        let e = client
            .publish_sandbox_state(authed(
                reconciler_pb::PublishSandboxStateRequest {
                    node_id: "node-b".into(),
                    epoch: b,
                    sandbox_id: row.id.clone(),
                    execution_generation: u64::MAX,
                    observation_seq: 1,
                    status: reconciler_pb::SandboxStatus::Started as i32,
                    placed: true,
                    exit_code: None,
                    observed_at: None,
                    waiting_for_input: None,
                },
                &node_token("node-b"),
            ))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "execution_generation");

        // Inside the service the store still bounds the error, at a character boundary.
        let stored = w
            .store
            .report_wake_failed("node-b", &queued.id, 1, &long)
            .await
            .unwrap();
        let kept = stored.last_error;
        assert!(kept.len() <= 512 && long.starts_with(&kept), "{kept}");

        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let e = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: row.id.clone(),
                    reason: "r".repeat(257),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(field(&e), "reason");
        assert_ne!(
            w.store.sandbox(&row.id).await.unwrap().status,
            runplane_sandbox_reconciler::store::DELETED,
            "an oversized reason destroys nothing"
        );
    }

    async fn an_oversized_page_is_refused_by_both_lists(w: World) {
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let sandboxes = api
            .list_sandboxes(authed(
                reconciler_pb::ListSandboxesRequest {
                    page_size: 501,
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        let nodes = api
            .list_nodes(authed(
                reconciler_pb::ListNodesRequest {
                    page_size: 501,
                    ..Default::default()
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        for err in [sandboxes, nodes] {
            assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
            let info = error_info(&err).unwrap();
            assert_eq!(info.reason, ErrorReason::InvalidField.as_str_name());
            assert_eq!(info.metadata["field"], "page_size");
        }
        // The boundary is accepted.
        api.list_nodes(authed(
            reconciler_pb::ListNodesRequest {
                page_size: 500,
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap();
    }

    /// CreateSandbox converts `idle_timeout` to milliseconds before anything else; a
    /// far-off number of seconds saturates instead of overflowing (a panic in a checked
    /// build), and the call is answered as any other would be.
    async fn a_far_off_idle_timeout_does_not_overflow_create(w: World) {
        let (existing, _) = w.running_sandbox("far-off-idle").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let err = api
            .create_sandbox(authed(
                reconciler_pb::CreateSandboxRequest {
                    client_request_id: "far-off-idle-request".into(),
                    run_id: existing.run_id.clone(),
                    substrate: reconciler_pb::Substrate::Direct as i32,
                    idle_timeout: Some(prost_types::Duration {
                        seconds: i64::MAX,
                        nanos: 999_999_999,
                    }),
                    node_id: String::new(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    }

    async fn create_is_keyed_and_destroy_ends_the_sandbox(w: World) {
        let (existing, _) = w.running_sandbox("create-keyed").await;
        let mut api = SandboxServiceClient::connect(w.reconciler_endpoint.clone())
            .await
            .unwrap();
        let create = |key: &str, substrate: reconciler_pb::Substrate| {
            authed(
                reconciler_pb::CreateSandboxRequest {
                    client_request_id: key.into(),
                    run_id: existing.run_id.clone(),
                    substrate: substrate as i32,
                    idle_timeout: None,
                    node_id: String::new(),
                },
                TOKEN,
            )
        };
        let err = api
            .create_sandbox(create(
                "another-request-0001",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists);
        assert_eq!(
            error_info(&err).unwrap().metadata["sandbox_id"],
            existing.id
        );
        let err = api
            .create_sandbox(create(
                "kubernetes-request-01",
                reconciler_pb::Substrate::Kubernetes,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);

        let destroyed = api
            .destroy_sandbox(authed(
                reconciler_pb::DestroySandboxRequest {
                    sandbox_id: existing.id.clone(),
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
        let err = api
            .resolve_route(authed(
                reconciler_pb::ResolveRouteRequest {
                    sandbox_id: existing.id.clone(),
                    session_id: String::new(),
                },
                TOKEN,
            ))
            .await
            .unwrap_err();
        assert_eq!(
            error_info(&err).unwrap().reason,
            ErrorReason::SandboxEnded.as_str_name()
        );

        // With the old one gone, a new sandbox for the run can be created, once per key.
        let first = api
            .create_sandbox(create(
                "replacement-request-1",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        let again = api
            .create_sandbox(create(
                "replacement-request-1",
                reconciler_pb::Substrate::Direct,
            ))
            .await
            .unwrap()
            .into_inner()
            .sandbox
            .unwrap();
        assert_eq!(first.id, again.id);
        assert_eq!(first.status(), reconciler_pb::SandboxStatus::Creating);
    }
}
