//! ReportTurnFailure through the gate (`common`): replays answer the same, bad reports
//! write nothing.

mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;

async fn a_replayed_report_returns_the_first_answer_and_counts_once(gate: Gate) {
    let a = gate.running("replay-a", "lead-1", "cred-a").await;
    let report = credentials_pb::ReportTurnFailureRequest {
        turn_id: format!("{}:turn-7", a.0),
        run_id: a.0.clone(),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        credential_id: "cred-a".into(),
        failure_tail: OUTAGE.into(),
        ..Default::default()
    };
    let mut client = gate.credentials().await;
    let first = client
        .report_turn_failure(report.clone())
        .await
        .unwrap()
        .into_inner();
    gate.clock.advance(Duration::from_secs(1));
    let again = client
        .report_turn_failure(report.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first, again);
    assert_eq!(first.outcome(), credentials_pb::TurnOutcome::BackendError);
    assert_eq!(first.reason, "API Error: No response from API");
    // The same key with another body is refused, and nothing is written.
    let reused = client
        .report_turn_failure(credentials_pb::ReportTurnFailureRequest {
            failure_tail: "something else".into(),
            ..report.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(
        reason(&reused),
        ErrorReason::IdempotencyKeyReused.as_str_name()
    );
    gate.create("replay-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one run, however often reported, is not an incident");
}

async fn bad_reports_are_refused_with_a_reason_and_write_nothing(gate: Gate) {
    let mut client = gate.credentials().await;
    let good = credentials_pb::ReportTurnFailureRequest {
        turn_id: "run-x:turn-0000001".into(),
        run_id: "run-x".into(),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        credential_id: "cred-a".into(),
        failure_tail: OUTAGE.into(),
        ..Default::default()
    };
    let cases: Vec<(
        credentials_pb::ReportTurnFailureRequest,
        tonic::Code,
        ErrorReason,
    )> = vec![
        (
            credentials_pb::ReportTurnFailureRequest {
                turn_id: "short".into(),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                credential_id: String::new(),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                failure_tail: "x".repeat(8193),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                credential_id: "cred-nobody-names".into(),
                ..good.clone()
            },
            tonic::Code::NotFound,
            ErrorReason::CredentialUnknown,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                profile: "haiku".into(),
                ..good.clone()
            },
            tonic::Code::NotFound,
            ErrorReason::ProfileUnknown,
        ),
    ];
    for (request, code, expected) in cases {
        let err = client.report_turn_failure(request).await.unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
        assert_eq!(reason(&err), expected.as_str_name(), "{err:?}");
    }
    let mut anonymous = CredentialHealthServiceClient::new(gate.channel().await);
    let err = anonymous
        .report_turn_failure(good.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // Nothing was counted: the good report is the first the credential sees.
    let first = client.report_turn_failure(good).await.unwrap().into_inner();
    assert!(first.incident.is_none());
    assert!(
        gate.health
            .store()
            .states(&["cred-a".into()])
            .await
            .unwrap()["cred-a"]
            .0
            .evidence
            .len()
            == 1
    );
}

// The suite, on Postgres and on SQLite (as `runplane dev` runs it). What needs
// replicas sharing a database (the notice relay, two replicas racing) runs on Postgres.

/// Two profiles on two credentials.
mod started {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::start =>
        a_replayed_report_returns_the_first_answer_and_counts_once,
        bad_reports_are_refused_with_a_reason_and_write_nothing,
    );
}
