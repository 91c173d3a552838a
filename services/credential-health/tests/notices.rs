//! Lead notices through the gate (`common`): per (org, lead), from a cursor, live, and
//! across replicas.

mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_grpc::client::Bearer;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_testkit::Backend;

/// A lead watching its notices on one replica is woken by a notice another replica
/// created (NOTIFY), well before the 30 s re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_reaches_a_watcher_on_another_replica_at_once() {
    let gate = Gate::start(Backend::postgres().await).await;
    let replica = gate.health_replica().await;
    let channel = tonic::transport::Endpoint::from_shared(replica)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut watch = CredentialHealthServiceClient::with_interceptor(channel, Bearer::new(TOKEN))
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-1".into(),
            org_id: "acme".into(),
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let a = gate.running("replica-outage-a", "lead-1", "cred-a").await;
    let b = gate.running("replica-outage-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.clock.advance(Duration::from_secs(20));
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    let notice = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let item = watch
                .message()
                .await
                .unwrap()
                .expect("the watch stays open");
            if let Some(credentials_pb::watch_notices_response::Item::Notice(n)) = item.item {
                return n;
            }
        }
    })
    .await
    .expect("the other replica's notice woke this watcher within 10 s");
    assert_eq!(notice.credential_id, "cred-a");
}

async fn notices_of_two_orgs_with_the_same_lead_id_do_not_mix(gate: Gate) {
    // acme's lead-1 opens an incident on the shared credential, for acme only; then
    // globex's lead-1 opens one too, and the credential is out for every org. Each lead
    // is its own, told once of its own runs.
    let a = gate.running_in("acme", "mix-a", "lead-1", "cred-s").await;
    let b = gate.running_in("acme", "mix-b", "lead-1", "cred-s").await;
    let g1 = gate
        .running_in("globex", "mix-g1", "lead-1", "cred-s")
        .await;
    let g2 = gate
        .running_in("globex", "mix-g2", "lead-1", "cred-s")
        .await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    gate.fail(&g1, OUTAGE).await.unwrap();
    gate.fail(&g2, OUTAGE).await.unwrap();
    gate.settle().await;

    let acme = notices_only(&gate.notices_as(ACME_TOKEN, "", "lead-1", "").await.unwrap());
    assert_eq!(acme.len(), 1, "{acme:?}");
    assert_eq!(acme[0].org_id, "acme");
    assert_eq!(acme[0].affected_orgs, ["acme"]);
    assert!(
        acme[0].message.contains("for org acme only"),
        "{}",
        acme[0].message
    );
    let mut affected = acme[0].affected_run_ids.clone();
    affected.sort();
    let mut expected = vec![a.0.clone(), b.0.clone()];
    expected.sort();
    assert_eq!(affected, expected);

    let globex = notices_only(
        &gate
            .notices_as(GLOBEX_TOKEN, "", "lead-1", "")
            .await
            .unwrap(),
    );
    assert_eq!(globex.len(), 1, "{globex:?}");
    assert_eq!(globex[0].org_id, "globex");
    let mut affected = globex[0].affected_run_ids.clone();
    affected.sort();
    let mut expected = vec![g1.0.clone(), g2.0.clone()];
    expected.sort();
    assert_eq!(affected, expected);
    // Two orgs' runs gave the evidence: the credential is out for every org.
    assert!(globex[0].affected_orgs.is_empty(), "{globex:?}");
    assert!(gate.credential("cred-s").await.cooling_off_for_seconds > 0);

    // The operator names the org; an org token cannot name another.
    let by_operator = notices_only(
        &gate
            .notices_as(TOKEN, "globex", "lead-1", "")
            .await
            .unwrap(),
    );
    assert_eq!(by_operator, globex);
    let denied = gate
        .notices_as(ACME_TOKEN, "globex", "lead-1", "")
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    let unnamed = gate.notices_as(TOKEN, "", "lead-1", "").await.unwrap_err();
    assert_eq!(unnamed.code(), tonic::Code::InvalidArgument, "{unnamed:?}");
    // An org token is no service token: it cannot read the fleet (or report failures).
    let fleet = gate
        .credentials_as(ACME_TOKEN)
        .await
        .get_fleet(credentials_pb::GetFleetRequest::default())
        .await
        .unwrap_err();
    assert_eq!(fleet.code(), tonic::Code::PermissionDenied, "{fleet:?}");
}

async fn notices_resume_from_a_cursor_and_follow_live(gate: Gate) {
    let mut watch = gate
        .credentials()
        .await
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-9".into(),
            after_cursor: String::new(),
            org_id: "acme".into(),
            // The longest interval: this test reads the notice as the first item.
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let a = gate.running("watch-a", "lead-9", "cred-a").await;
    let b = gate.running("watch-b", "lead-9", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    let live = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the live watcher is woken")
        .unwrap()
        .unwrap();
    let credentials_pb::watch_notices_response::Item::Notice(first) = live.item.unwrap() else {
        panic!("a notice")
    };
    assert_eq!(first.kind(), credentials_pb::NoticeKind::IncidentOpened);

    gate.clock.advance(Duration::from_secs(1));
    let c = gate.running("watch-c", "lead-9", "cred-b").await;
    gate.fail(&c, SPENT).await.unwrap();
    gate.settle().await;
    let resumed = notices_only(&gate.notices("lead-9", &first.cursor).await);
    assert_eq!(resumed.len(), 1, "only what came after the cursor");
    assert_eq!(
        resumed[0].kind(),
        credentials_pb::NoticeKind::CredentialQuarantined
    );
    assert_eq!(resumed[0].credential_id, "cred-b");
    assert_eq!(resumed[0].quarantined_for_seconds, 1800);

    let bad = gate
        .credentials()
        .await
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-9".into(),
            after_cursor: "999999".into(),
            org_id: "acme".into(),
            heartbeat_interval: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&bad), ErrorReason::CursorInvalid.as_str_name());

    // Retention prunes the first notice: a watcher from the start hears of the gap.
    gate.health
        .store()
        .prune_notices({
            let at = first.created_at.as_ref().unwrap();
            at.seconds * 1000 + i64::from(at.nanos) / 1_000_000 + 1
        })
        .await
        .unwrap();
    let items = gate.notices("lead-9", "").await;
    assert!(
        matches!(
            items[0],
            credentials_pb::watch_notices_response::Item::Gap(credentials_pb::NoticesGap {
                missed: 1
            })
        ),
        "{items:?}"
    );
    assert_eq!(notices_only(&items).len(), 1);
    // A retention later the pruned notice's row goes too: still one gap, said the same.
    let deleted = gate
        .health
        .store()
        .delete_pruned(
            runplane_clock::Clock::now(&gate.clock).timestamp_millis() + 1,
            100,
        )
        .await
        .unwrap();
    // The notice and the delivered MarkBackendError outbox rows.
    assert!(deleted > 1, "{deleted}");
    use sea_orm::{EntityTrait, PaginatorTrait};
    let rows = runplane_credential_health::store::entities::notice::Entity::find()
        .count(gate.health.store().db())
        .await
        .unwrap();
    assert_eq!(
        rows, 1,
        "the pruned notice's row is gone, the later one stays"
    );
    let items = gate.notices("lead-9", "").await;
    assert!(
        matches!(
            items[0],
            credentials_pb::watch_notices_response::Item::Gap(credentials_pb::NoticesGap {
                missed: 1
            })
        ),
        "{items:?}"
    );
    assert_eq!(notices_only(&items).len(), 1);
}

// The suite, on Postgres and on SQLite (as `runplane dev` runs it). What needs
// replicas sharing a database (the notice relay, two replicas racing) runs on Postgres.

/// Two profiles on two credentials.
mod started {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::start =>
        notices_resume_from_a_cursor_and_follow_live,
    );
}

/// Profiles owned by two orgs.
mod with_two_orgs {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_orgs =>
        notices_of_two_orgs_with_the_same_lead_id_do_not_mix,
    );
}
