//! Admission through the gate (`common`): org-owned credentials and placement in a pool.

mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::runstore::v1 as runstore_pb;

async fn an_org_token_cannot_use_another_orgs_credential(gate: Gate) {
    // Named directly, or through a profile whose every credential is acme's.
    for (i, target) in [credential_target("cred-a"), profile_target("opus")]
        .into_iter()
        .enumerate()
    {
        let refused = gate
            .create_as(
                GLOBEX_TOKEN,
                "globex",
                &format!("not-ours-{i}"),
                "lead-1",
                target,
            )
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert_eq!(
            reason(&refused),
            ErrorReason::CredentialNotOwned.as_str_name()
        );
        assert_eq!(metadata(&refused, "org_id"), "globex");
    }
    // Refused before anything was stored: globex has no runs.
    let listed = gate
        .runs_as(GLOBEX_TOKEN)
        .await
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert!(listed.is_empty(), "{listed:?}");
    // A pool spanning both orgs places globex only on its own credential, even when
    // acme's has more free slots.
    for i in 0..3 {
        let run = gate
            .create_as(
                GLOBEX_TOKEN,
                "globex",
                &format!("pool-{i}"),
                "lead-1",
                profile_target("sonnet"),
            )
            .await
            .unwrap();
        assert_eq!(run.credential_id, "cred-g");
        gate.start_run(&run.id).await;
    }
    // A shared credential and the org's own are usable.
    gate.create_as(
        GLOBEX_TOKEN,
        "globex",
        "shared-1",
        "lead-1",
        credential_target("cred-s"),
    )
    .await
    .unwrap();
    gate.create_as(
        ACME_TOKEN,
        "acme",
        "own-1",
        "lead-1",
        credential_target("cred-a"),
    )
    .await
    .unwrap();
    // The operator token creating a run for globex is held to globex's credentials too.
    let refused = gate
        .create_as(
            TOKEN,
            "globex",
            "operator-1",
            "lead-1",
            credential_target("cred-a"),
        )
        .await
        .unwrap_err();
    assert_eq!(
        reason(&refused),
        ErrorReason::CredentialNotOwned.as_str_name()
    );
}

async fn a_profile_is_placed_on_a_healthy_credential_and_refused_only_when_none_is(gate: Gate) {
    let a = gate.running("pool-a", "lead-1", "cred-a").await;
    let b = gate.running("pool-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    for i in 0..3 {
        let run = gate
            .create(
                &format!("pool-next-{i}"),
                "lead-1",
                profile_target("sonnet"),
            )
            .await
            .unwrap();
        assert_eq!(run.credential_id, "cred-b", "cooling-off cred-a is skipped");
        assert_eq!(run.profile, "sonnet");
    }
    let c = gate.running("pool-c", "lead-1", "cred-b").await;
    let d = gate.running("pool-d", "lead-1", "cred-b").await;
    gate.clock.advance(Duration::from_secs(10));
    gate.fail(&c, OUTAGE).await.unwrap();
    gate.fail(&d, OUTAGE).await.unwrap();
    gate.settle().await;
    let refused = gate
        .create("pool-none", "lead-1", profile_target("sonnet"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());
    // cred-a frees first: 50 s left against cred-b's 60.
    assert_eq!(metadata(&refused, "credential_id"), "cred-a");
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "50");

    let unknown = gate
        .create("pool-unknown", "lead-1", profile_target("haiku"))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    assert_eq!(reason(&unknown), ErrorReason::ProfileUnknown.as_str_name());
}

// The suite, on Postgres and on SQLite (as `runplane dev` runs it). What needs
// replicas sharing a database (the notice relay, two replicas racing) runs on Postgres.

/// Profiles owned by two orgs.
mod with_two_orgs {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_orgs =>
        an_org_token_cannot_use_another_orgs_credential,
    );
}

/// Two profiles of one name on two credentials.
mod with_two_pools {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_pools =>
        a_profile_is_placed_on_a_healthy_credential_and_refused_only_when_none_is,
    );
}
