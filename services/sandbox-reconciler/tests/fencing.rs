//! Fencing (`common`): revoking a node's last credential fences it in the same
//! transaction. Its live sandboxes, placed or suspended on it, are lost at once (no
//! grace) and each run's attempt ends `sandbox_lost` once, whichever of the fence and a
//! tick past the grace gets there first; dispatch places nothing on it; a registration
//! authenticated before the revocation cannot lift the fence, and a new credential makes
//! it a fresh node.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use runplane_proto::reconciler::v1 as reconciler_pb;
use runplane_sandbox::Probe;
use runplane_sandbox_reconciler::ReconcilerError;
use runplane_sandbox_reconciler::drivers::FakeDriver;
use runplane_sandbox_reconciler::reconcile::deliver_outbox;
use runplane_sandbox_reconciler::store::entities::route_identity;
use runplane_sandbox_reconciler::store::node_credentials::Revoked;
use tonic::Code;

runplane_testkit::on_both_backends!(
    World::start =>
    revoking_a_nodes_last_credential_ends_its_sandboxes_attempts_at_once_and_places_nothing_on_it,
    a_fence_during_a_probe_past_the_grace_ends_the_attempt_once,
    a_loss_confirmed_before_the_fence_is_not_ended_again,
    a_registration_with_the_revoked_credential_cannot_lift_the_fence_and_a_new_credential_can,
);

/// The run store's view of `run_id`'s first attempt's end message.
async fn first_end_message(w: &World, run_id: &str) -> String {
    w.first_attempt_ended(run_id, "sandbox_lost")
        .await
        .end_message
}

/// Node `node`'s heartbeat at `epoch` with its original credential.
async fn heartbeat(w: &World, node: &str, epoch: u64) -> Result<(), tonic::Status> {
    nodes(w)
        .await
        .heartbeat(authed(
            reconciler_pb::HeartbeatRequest {
                node_id: node.into(),
                epoch,
                used: 0,
            },
            &node_token(node),
        ))
        .await
        .map(|_| ())
}

async fn revoking_a_nodes_last_credential_ends_its_sandboxes_attempts_at_once_and_places_nothing_on_it(
    w: World,
) {
    let a = register(&w, "node-a", "a").await;
    register(&w, "node-b", "b").await;
    // One sandbox running on node-a, one it suspended for idleness (unplaced, its route
    // identity naming node-a), and one on node-b.
    let (running, _) = w.running_sandbox("fenced-running").await;
    let (parked, _) = w.running_sandbox("fenced-parked").await;
    w.store
        .set_route_identity(route_identity::Model {
            sandbox_id: parked.id.clone(),
            current_node_id: "node-a".into(),
            execution_generation: 1,
        })
        .await
        .unwrap();
    nodes(&w)
        .await
        .publish_sandbox_state(publish(
            "node-a",
            a,
            &parked,
            1,
            reconciler_pb::SandboxStatus::Suspended,
            false,
        ))
        .await
        .unwrap();
    let elsewhere_run = w.queued_run("on-node-b").await;
    let elsewhere = w
        .store
        .insert_sandbox(w.row(
            &uuid::Uuid::new_v4().to_string(),
            &elsewhere_run.id,
            "direct",
            "started",
            Some("node-b"),
        ))
        .await
        .unwrap();
    heartbeat(&w, "node-a", a)
        .await
        .expect("node-a is heartbeating");

    // No time passes: the grace plays no part.
    assert_eq!(
        w.store.revoke_node_credentials("node-a").await.unwrap(),
        Revoked {
            credentials: 1,
            fenced: true,
            fenced_sandboxes: 2,
        }
    );
    for row in [&running, &parked] {
        assert_eq!(w.store.sandbox(&row.id).await.unwrap().status, "lost");
    }
    assert_eq!(
        w.store.sandbox(&elsewhere.id).await.unwrap().status,
        "started"
    );
    let client = w.outbox_client().await;
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 2);
    for row in [&running, &parked] {
        assert_eq!(
            first_end_message(&w, &row.run_id).await,
            format!(
                "sandbox {} lost: its node node-a was fenced (its credentials were revoked)",
                row.id
            )
        );
    }

    // node-a, empty and heartbeating a moment ago, has the most room, yet gets nothing.
    let next = w.queued_run("after-the-fence").await;
    w.dispatch_once(&w.store).await;
    let placed = w
        .store
        .live_sandbox_of(&next.id)
        .await
        .unwrap()
        .expect("placed");
    assert_eq!(placed.active_node_id.as_deref(), Some("node-b"));

    // Its next call is refused; a tick that probes the lost sandboxes ends nothing again.
    let refused = heartbeat(&w, "node-a", a).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    w.clock.advance(GRACE + Duration::from_secs(1));
    let tick = w
        .reconciler(FakeDriver::always(Probe::Lost))
        .tick()
        .await
        .unwrap();
    assert_eq!(tick.confirmed, 0, "{tick:?}");
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 0);
    assert_eq!(w.fail_run_calls.load(Ordering::SeqCst), 2);

    // A replay revokes nothing and fences nothing.
    assert_eq!(
        w.store.revoke_node_credentials("node-a").await.unwrap(),
        Revoked::default()
    );
}

async fn a_fence_during_a_probe_past_the_grace_ends_the_attempt_once(w: World) {
    register(&w, "node-a", "a").await;
    let (row, _) = w.running_sandbox("fenced-mid-probe").await;
    let stamped = w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(1));

    // The tick read the row; while its probe is out, the operator revokes node-a.
    let store = w.store.clone();
    let tick = w.reconciler(FakeDriver::new(move |_| {
        let store = store.clone();
        Box::pin(async move {
            let revoked = store.revoke_node_credentials("node-a").await.unwrap();
            assert_eq!(revoked.fenced_sandboxes, 1);
            Probe::Lost
        })
    }));
    let report = tick.observe(stamped).await.unwrap();
    assert_eq!((report.confirmed, report.lost_races), (0, 1));

    let client = w.outbox_client().await;
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 1);
    assert_eq!(w.fail_run_calls.load(Ordering::SeqCst), 1, "FailRun once");
    assert!(
        first_end_message(&w, &row.run_id)
            .await
            .contains("node-a was fenced")
    );
}

async fn a_loss_confirmed_before_the_fence_is_not_ended_again(w: World) {
    register(&w, "node-a", "a").await;
    let (row, _) = w.running_sandbox("lost-before-the-fence").await;
    w.stamp(&row).await;
    w.clock.advance(GRACE + Duration::from_secs(1));
    let tick = w
        .reconciler(FakeDriver::always(Probe::Lost))
        .tick()
        .await
        .unwrap();
    assert_eq!(tick.confirmed, 1);

    assert_eq!(
        w.store.revoke_node_credentials("node-a").await.unwrap(),
        Revoked {
            credentials: 1,
            fenced: true,
            fenced_sandboxes: 0,
        }
    );
    let client = w.outbox_client().await;
    assert_eq!(deliver_outbox(&w.store, &client, 10).await.unwrap(), 1);
    assert_eq!(w.fail_run_calls.load(Ordering::SeqCst), 1, "FailRun once");
    assert!(
        first_end_message(&w, &row.run_id)
            .await
            .contains("loss grace")
    );
}

async fn a_registration_with_the_revoked_credential_cannot_lift_the_fence_and_a_new_credential_can(
    w: World,
) {
    let first = register(&w, "node-a", "a").await;
    w.store.revoke_node_credentials("node-a").await.unwrap();

    // A RegisterNode authenticated just before the revocation reaches the store after it.
    let late = w
        .store
        .register_node(
            "credential-of-node-a",
            "node-a",
            "a-boot-id-0000000",
            "x:1",
            4,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(late, ReconcilerError::NodeCredentialRevoked),
        "{late:?}"
    );
    let run = w.queued_run("while-fenced").await;
    w.dispatch_once(&w.store).await;
    assert!(
        w.store.live_sandbox_of(&run.id).await.unwrap().is_none(),
        "nothing placed on a fenced node"
    );

    // The operator re-issues a credential: the same node id, even the same boot, is a
    // fresh node with a new epoch, and takes runs.
    let (_, renewed) = w.store.create_node_credential("node-a", 0).await.unwrap();
    let fresh = nodes(&w)
        .await
        .register_node(authed(
            reconciler_pb::RegisterNodeRequest {
                node_id: "node-a".into(),
                boot_id: "a-boot-id-0000000".into(),
                endpoint: "node-a.local:7443".into(),
                capacity: 4,
                labels: Default::default(),
                agent_version: "test".into(),
            },
            &renewed,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(fresh.epoch > first, "{} > {first}", fresh.epoch);
    assert_eq!(fresh.node.unwrap().state(), reconciler_pb::NodeState::Ready);
    w.dispatch_once(&w.store).await;
    let placed = w
        .store
        .live_sandbox_of(&run.id)
        .await
        .unwrap()
        .expect("placed");
    assert_eq!(placed.active_node_id.as_deref(), Some("node-a"));
    let refused = heartbeat(&w, "node-a", fresh.epoch).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Code::Unauthenticated,
        "the old one stays revoked"
    );
}
