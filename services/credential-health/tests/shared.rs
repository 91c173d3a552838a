//! A credential shared by several orgs, through the gate (`common`): an agent's output is
//! untrusted, so one org's failures cool it off or quarantine it for that org alone; a
//! second org's runs giving the same evidence take it out for every org.

mod common;

use common::*;
use runplane_grpc::ErrorReason;

/// Admitted, or the refusal's reason.
async fn admitted(gate: &Gate, token: &str, org: &str, id: &str) -> Result<(), String> {
    gate.create_as(token, org, id, "lead-1", credential_target("cred-s"))
        .await
        .map(|_| ())
        .map_err(|refused| format!("{} {}", reason(&refused), refused.message()))
}

/// The field report: acme's agent printed the exhausted pattern and exited, and beta's
/// next run on the same credential was refused EXHAUSTED for 30 minutes.
async fn one_orgs_exhausted_runs_do_not_refuse_another_org(gate: Gate) {
    let spent = gate
        .running_in("acme", "spent-acme", "lead-1", "cred-s")
        .await;
    gate.fail(&spent, SPENT).await.unwrap();
    gate.settle().await;

    let refused = admitted(&gate, ACME_TOKEN, "acme", "acme-after").await;
    let refused = refused.expect_err("acme's own evidence holds acme");
    assert!(
        refused.starts_with(ErrorReason::Exhausted.as_str_name())
            && refused.contains("for org acme"),
        "{refused}"
    );
    admitted(&gate, GLOBEX_TOKEN, "globex", "globex-after")
        .await
        .expect("globex is not held by acme's agents");

    let health = gate.credential("cred-s").await;
    assert_eq!(health.quarantined_for_seconds, 0, "{health:?}");
    assert_eq!(health.orgs.len(), 1, "{health:?}");
    assert_eq!(health.orgs[0].org_id, "acme");
    assert!(health.orgs[0].quarantined_for_seconds > 0);

    let notices = notices_only(&gate.notices_as(ACME_TOKEN, "", "lead-1", "").await.unwrap());
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert_eq!(notices[0].affected_orgs, ["acme"]);
}

async fn one_orgs_outage_cools_the_credential_off_for_that_org_alone(gate: Gate) {
    let a = gate
        .running_in("acme", "outage-a", "lead-1", "cred-s")
        .await;
    let b = gate
        .running_in("acme", "outage-b", "lead-1", "cred-s")
        .await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    let refused = admitted(&gate, ACME_TOKEN, "acme", "acme-cooling")
        .await
        .expect_err("acme cools off");
    assert!(
        refused.starts_with(ErrorReason::CoolingOff.as_str_name()),
        "{refused}"
    );
    admitted(&gate, GLOBEX_TOKEN, "globex", "globex-fine")
        .await
        .expect("globex is not cooled off by acme's runs");
    let health = gate.credential("cred-s").await;
    assert_eq!(health.cooling_off_for_seconds, 0, "{health:?}");
    assert!(health.orgs[0].cooling_off_for_seconds > 0, "{health:?}");
}

async fn a_second_orgs_evidence_takes_the_credential_out_for_every_org(gate: Gate) {
    let acme = gate.running_in("acme", "spent-1", "lead-1", "cred-s").await;
    let globex = gate
        .running_in("globex", "spent-2", "lead-1", "cred-s")
        .await;
    gate.fail(&acme, SPENT).await.unwrap();
    gate.settle().await;
    gate.fail(&globex, SPENT).await.unwrap();
    gate.settle().await;
    let health = gate.credential("cred-s").await;
    assert!(health.quarantined_for_seconds > 0, "{health:?}");
    // An org whose runs reported nothing is held too: two orgs agree it is spent.
    let refused = admitted(&gate, TOKEN, "initech", "initech-after")
        .await
        .expect_err("out for every org");
    assert!(
        refused.starts_with(ErrorReason::Exhausted.as_str_name()) && !refused.contains("for org"),
        "{refused}"
    );
    let globex_notices = notices_only(
        &gate
            .notices_as(GLOBEX_TOKEN, "", "lead-1", "")
            .await
            .unwrap(),
    );
    assert_eq!(globex_notices.len(), 1, "{globex_notices:?}");
    assert!(
        globex_notices[0].affected_orgs.is_empty(),
        "{globex_notices:?}"
    );
}

mod with_two_orgs {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_orgs =>
        one_orgs_exhausted_runs_do_not_refuse_another_org,
        one_orgs_outage_cools_the_credential_off_for_that_org_alone,
        a_second_orgs_evidence_takes_the_credential_out_for_every_org,
    );
}
