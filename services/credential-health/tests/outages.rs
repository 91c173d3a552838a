//! Outages through the gate (`common`): incidents, cool-off, exhaustion, and the durable
//! outcome each failed run ends with.

mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::runstore::v1 as runstore_pb;

async fn two_runs_failing_on_one_credential_refuse_the_next_run_mark_both_and_tell_the_lead_once(
    gate: Gate,
) {
    let a = gate.running("outage-a", "lead-1", "cred-a").await;
    let b = gate.running("outage-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.clock.advance(Duration::from_secs(20));
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;

    gate.clock.advance(Duration::from_secs(18));
    let refused = gate
        .create("outage-c", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "42");
    assert_eq!(metadata(&refused, "quarantined_for_seconds"), "0");
    assert!(
        refused
            .message()
            .contains("cooling off after repeated backend errors, 42 s left"),
        "{}",
        refused.message()
    );
    // The refused request stored nothing: the roster still holds two runs.
    let roster = gate
        .runs()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            lead_id: "lead-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(roster.len(), 2);
    for run in &roster {
        assert_eq!(run.state(), runstore_pb::RunState::BackendError, "{run:?}");
        assert_eq!(run.failure_reason, "API Error: No response from API");
        let outcome = run.backend_error.as_ref().unwrap();
        assert_eq!(outcome.kind(), runstore_pb::BackendErrorKind::Error);
        assert_eq!(outcome.credential_id, "cred-a");
    }
    // A replay of a request admitted before the outage gets its run back, not a refusal.
    let replayed = gate
        .create("outage-a", "lead-1", credential_target("cred-a"))
        .await
        .expect("a replay is not asked again");
    assert_eq!(replayed.id, a.0);
    // Another credential is unaffected.
    gate.create("other-cred", "lead-1", credential_target("cred-b"))
        .await
        .unwrap();

    let health = gate.credential("cred-a").await;
    assert_eq!(
        (
            health.free,
            health.cooling_off_for_seconds,
            health.quarantined_for_seconds
        ),
        (0, 42, 0)
    );
    let incident = health.open_incident.unwrap();
    assert_eq!(incident.opening_run_ids.len(), 2);

    let notices = notices_only(&gate.notices("lead-1", "").await);
    assert_eq!(notices.len(), 1, "{notices:?}");
    let notice = &notices[0];
    assert_eq!(notice.kind(), credentials_pb::NoticeKind::IncidentOpened);
    assert_eq!(notice.credential_id, "cred-a");
    assert_eq!(notice.incident_id, incident.id);
    let mut affected = notice.affected_run_ids.clone();
    affected.sort();
    let mut expected = vec![a.0.clone(), b.0.clone()];
    expected.sort();
    assert_eq!(affected, expected);
    assert_eq!(notice.cooling_off_for_seconds, 60);
}

async fn one_failure_changes_nothing_but_the_runs_own_outcome(gate: Gate) {
    let a = gate.running("single-a", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.settle().await;

    assert_eq!(
        gate.get(&a.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    gate.create("single-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one failure does not cool anything off");
    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 0);
    assert!(health.open_incident.is_none());
    assert!(gate.notices("lead-1", "").await.is_empty());
}

async fn the_same_run_failing_repeatedly_is_not_an_incident(gate: Gate) {
    let a = gate.running("repeat-a", "lead-1", "cred-a").await;
    // Three failed turns of one run reach credential health before its outcome is
    // recorded: one target, however often it fails.
    gate.turn_failed(&a, "turn-1", OUTAGE).await;
    gate.clock.advance(Duration::from_secs(5));
    gate.turn_failed(&a, "turn-2", OUTAGE).await;
    gate.clock.advance(Duration::from_secs(5));
    gate.turn_failed(&a, "turn-3", OUTAGE).await;
    gate.settle().await;

    assert_eq!(
        gate.get(&a.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 0, "{health:?}");
    assert!(health.open_incident.is_none());
    assert!(gate.notices("lead-1", "").await.is_empty());
    gate.create("repeat-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one run failing repeatedly does not cool its credential off");
}

async fn after_the_cool_off_one_fresh_error_does_not_reopen_and_two_do(gate: Gate) {
    let a = gate.running("cool-a", "lead-1", "cred-a").await;
    let b = gate.running("cool-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    assert!(
        gate.create("cool-during", "lead-1", credential_target("cred-a"))
            .await
            .is_err()
    );

    gate.clock.advance(Duration::from_secs(60));
    let c = gate.running("cool-c", "lead-1", "cred-a").await;
    gate.fail(&c, OUTAGE).await.unwrap();
    gate.settle().await;
    assert_eq!(
        gate.get(&c.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    gate.create("cool-after-one", "lead-1", credential_target("cred-a"))
        .await
        .expect("the expired incident's evidence is gone: one fresh error is not an outage");

    let d = gate.running("cool-d", "lead-1", "cred-a").await;
    gate.clock.advance(Duration::from_secs(10));
    gate.fail(&d, OUTAGE).await.unwrap();
    gate.settle().await;
    let refused = gate
        .create("cool-after-two", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());

    let incidents = gate
        .credentials()
        .await
        .list_incidents(credentials_pb::ListIncidentsRequest {
            credential_id: "cred-a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .incidents;
    assert_eq!(incidents.len(), 2, "{incidents:?}");
    assert_eq!(incidents[0].state(), credentials_pb::IncidentState::Open);
    assert_eq!(incidents[1].state(), credentials_pb::IncidentState::Closed);
    // The lead heard of each incident once.
    assert_eq!(notices_only(&gate.notices("lead-1", "").await).len(), 2);
}

async fn errors_during_the_cool_off_neither_extend_it_nor_open_another_incident(gate: Gate) {
    let runs = [
        gate.running("during-a", "lead-1", "cred-a").await,
        gate.running("during-b", "lead-1", "cred-a").await,
        gate.running("during-c", "lead-1", "cred-a").await,
        gate.running("during-d", "lead-2", "cred-a").await,
    ];
    gate.fail(&runs[0], OUTAGE).await.unwrap();
    gate.fail(&runs[1], OUTAGE).await.unwrap();
    gate.settle().await;
    gate.clock.advance(Duration::from_secs(30));
    gate.fail(&runs[2], OUTAGE).await.unwrap();
    gate.fail(&runs[3], OUTAGE).await.unwrap();
    gate.settle().await;

    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 30, "not extended");
    let incident = health.open_incident.unwrap();
    assert_eq!(incident.failures_during_cool_off, 2);
    let incidents = gate
        .credentials()
        .await
        .list_incidents(credentials_pb::ListIncidentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .incidents;
    assert_eq!(incidents.len(), 1);
    // Every run carries its backend_error; the one that opened the incident and the
    // absorbed ones name it (the first was recorded before the incident existed, and
    // the incident lists it among its opening runs).
    for (i, run) in runs.iter().enumerate() {
        let run = gate.get(&run.0).await;
        assert_eq!(run.state(), runstore_pb::RunState::BackendError);
        let named = run.backend_error.unwrap().incident_id;
        assert_eq!(
            named,
            if i == 0 {
                String::new()
            } else {
                incident.id.clone()
            }
        );
    }
    assert!(incident.opening_run_ids.contains(&runs[0].0));
    // lead-1 was told once; lead-2, whose run failed during the cool-off, once too.
    assert_eq!(notices_only(&gate.notices("lead-1", "").await).len(), 1);
    let lead2 = notices_only(&gate.notices("lead-2", "").await);
    assert_eq!(lead2.len(), 1);
    assert_eq!(lead2[0].affected_run_ids, vec![runs[3].0.clone()]);
}

async fn exhaustion_and_cool_off_together_report_both_and_refuse_as_exhausted(gate: Gate) {
    let a = gate.running("both-a", "lead-1", "cred-a").await;
    let b = gate.running("both-b", "lead-1", "cred-a").await;
    let c = gate.running("both-c", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.fail(&c, SPENT).await.unwrap();
    gate.settle().await;

    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 60);
    assert_eq!(health.quarantined_for_seconds, 1800);
    assert_eq!(health.free, 0);
    let refused = gate
        .create("both-next", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&refused), ErrorReason::Exhausted.as_str_name());
    assert_eq!(metadata(&refused, "quarantined_for_seconds"), "1800");
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "60");
    assert!(
        refused.message().contains("exhausted"),
        "{}",
        refused.message()
    );
    let c = gate.get(&c.0).await;
    assert_eq!(
        c.backend_error.unwrap().kind(),
        runstore_pb::BackendErrorKind::Exhausted
    );

    // After the cool-off, exhaustion alone still refuses; cool-off is not reported.
    gate.clock.advance(Duration::from_secs(61));
    let health = gate.credential("cred-a").await;
    assert_eq!(
        (
            health.cooling_off_for_seconds,
            health.quarantined_for_seconds
        ),
        (0, 1739)
    );
    let refused = gate
        .create("both-later", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::Exhausted.as_str_name());
}

async fn a_run_that_finished_and_then_is_classified_ends_backend_error_either_way(gate: Gate) {
    // Done first: the run's failed result is recorded, then classified.
    let done_first = gate.running("race-done", "lead-1", "cred-a").await;
    let run = gate.fail(&done_first, OUTAGE).await.unwrap();
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    gate.settle().await;
    let run = gate.get(&done_first.0).await;
    assert_eq!(run.state(), runstore_pb::RunState::BackendError);
    assert_eq!(
        run.verdict.unwrap().outcome(),
        runstore_pb::VerdictOutcome::Failed
    );

    // Classified first: a failed turn's outcome lands while the run is running; the
    // runner's later verdict (even a success) cannot turn it back into done.
    let marked_first = gate.running("race-marked", "lead-1", "cred-a").await;
    gate.turn_failed(&marked_first, "race-turn", OUTAGE).await;
    gate.settle().await;
    assert_eq!(
        gate.get(&marked_first.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    let late = gate
        .submit(&marked_first, succeeded(), "")
        .await
        .unwrap_err();
    assert_eq!(reason(&late), ErrorReason::RunTerminal.as_str_name());
    assert_eq!(
        gate.get(&marked_first.0).await.state(),
        runstore_pb::RunState::BackendError
    );

    // Truly at once: the outcome's delivery and the runner's verdict race on the run's
    // lock; whichever wins, the run ends backend_error.
    for i in 0..6 {
        // Past the window: each round's failure is the only evidence, so no incident
        // refuses the next round's run.
        gate.clock.advance(Duration::from_secs(61));
        let run = gate
            .running(&format!("race-both-{i}"), "lead-2", "cred-b")
            .await;
        gate.turn_failed(&run, &format!("race-both-turn-{i}"), OUTAGE)
            .await;
        gate.run_store.deliver_outbox().await.unwrap();
        let verdict = if i % 2 == 0 { succeeded() } else { failed() };
        let (_, submitted) = tokio::join!(
            gate.health.deliver_outbox(100),
            gate.submit(&run, verdict, if i % 2 == 0 { "" } else { OUTAGE })
        );
        let _ = submitted; // either recorded or refused as terminal
        gate.settle().await;
        let after = gate.get(&run.0).await;
        assert_eq!(
            after.state(),
            runstore_pb::RunState::BackendError,
            "round {i}: {after:?}"
        );
        assert_eq!(after.failure_reason, "API Error: No response from API");
    }
}

// The suite, on Postgres and on SQLite (as `runplane dev` runs it). What needs
// replicas sharing a database (the notice relay, two replicas racing) runs on Postgres.

/// Two profiles on two credentials.
mod started {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::start =>
        two_runs_failing_on_one_credential_refuse_the_next_run_mark_both_and_tell_the_lead_once,
        one_failure_changes_nothing_but_the_runs_own_outcome,
        the_same_run_failing_repeatedly_is_not_an_incident,
        after_the_cool_off_one_fresh_error_does_not_reopen_and_two_do,
        errors_during_the_cool_off_neither_extend_it_nor_open_another_incident,
        exhaustion_and_cool_off_together_report_both_and_refuse_as_exhausted,
        a_run_that_finished_and_then_is_classified_ends_backend_error_either_way,
    );
}
