//! The one-statement append keeps every promise of the checked one: a key revoked after
//! the run's chain tip was remembered is refused at once, on this replica and on another;
//! a replayed batch is answered, not stored again; a tip that moved under a replica
//! (another replica's append, an acknowledgement's event, a revoke committed while the
//! append waited for the run's lock) never forks the chain.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    a_key_superseded_after_appending_is_refused_at_once,
    a_replayed_batch_is_answered_not_stored_again,
    an_append_after_an_acknowledgements_event_extends_the_chain,
);

/// The run's events are 1..n without gaps and each extends the chain from genesis.
async fn assert_one_chain(h: &Harness, run_id: &str, expected: usize) {
    let events = h
        .store
        .store()
        .events_after(run_id, 0, 10_000)
        .await
        .unwrap();
    assert_eq!(events.len(), expected);
    assert_chain_from_genesis(run_id, &events);
    let run = h.get_run(run_id).await;
    assert_eq!(run.last_sequence, expected as u64);
}

async fn a_key_superseded_after_appending_is_refused_at_once(h: Harness) {
    let (run_id, old_key) = h.running_run("revoke-after-append").await;
    let mut old = h.runner(&old_key).await;
    // Two appends: the replica now knows the run's tip and takes its one-statement path.
    for key in ["revoke-warm-batch-01", "revoke-warm-batch-02"] {
        append(&mut old, &run_id, key, vec![line(key)])
            .await
            .unwrap();
    }
    let new_key = h.issue_key(&run_id, 2).await;
    let err = append(&mut old, &run_id, "revoke-after-batch-1", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::Unauthenticated, ErrorReason::RunKeyRevoked);

    // The new key appends from where the old one stopped; its verdict revokes it too.
    let mut new = h.runner(&new_key).await;
    append(&mut new, &run_id, "revoke-new-batch-001", vec![line("y")])
        .await
        .unwrap();
    new.submit_result(runstore_pb::SubmitResultRequest {
        run_id: run_id.clone(),
        verdict: Some(succeeded()),
        ..Default::default()
    })
    .await
    .unwrap();
    let err = append(&mut new, &run_id, "revoke-new-batch-002", vec![line("z")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    assert_one_chain(&h, &run_id, 3).await;
}

async fn a_replayed_batch_is_answered_not_stored_again(h: Harness) {
    let (run_id, key) = h.running_run("replay-after-append").await;
    let mut runner = h.runner(&key).await;
    let first = append(
        &mut runner,
        &run_id,
        "replay-batch-000001",
        vec![line("a"), line("b")],
    )
    .await
    .unwrap();
    let second = append(&mut runner, &run_id, "replay-batch-000002", vec![line("c")])
        .await
        .unwrap();
    // The latest batch again (the tip it was chained from is the remembered one) and an
    // older one.
    let again = append(&mut runner, &run_id, "replay-batch-000002", vec![line("c")])
        .await
        .unwrap();
    assert_eq!(again, second);
    let again = append(
        &mut runner,
        &run_id,
        "replay-batch-000001",
        vec![line("a"), line("b")],
    )
    .await
    .unwrap();
    assert_eq!(again, first);
    let err = append(&mut runner, &run_id, "replay-batch-000001", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );
    // And a new batch still follows the last one stored.
    let third = append(&mut runner, &run_id, "replay-batch-000003", vec![line("d")])
        .await
        .unwrap();
    assert_eq!(third.first_sequence, 4);
    assert_one_chain(&h, &run_id, 4).await;
}

async fn an_append_after_an_acknowledgements_event_extends_the_chain(h: Harness) {
    let (run_id, key) = h.running_run("ack-then-append").await;
    let mut runner = h.runner(&key).await;
    append(&mut runner, &run_id, "ack-batch-00000001", vec![line("a")])
        .await
        .unwrap();
    let steer = h
        .operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "look again".into(),
            idempotency_key: "ack-then-append-steer".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    // Dropping the steer appends `steer_undeliverable` on the acknowledgement's own path,
    // past the tip the appends remembered.
    runner
        .poll_steering(runstore_pb::PollSteeringRequest {
            run_id: run_id.clone(),
            acks: vec![runstore_pb::SteeringAck {
                message_id: steer.id,
                outcome: runstore_pb::AckOutcome::DroppedUndeliverable as i32,
                attempts: 3,
                error: "agent busy".into(),
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    let next = append(&mut runner, &run_id, "ack-batch-00000002", vec![line("b")])
        .await
        .unwrap();
    assert_eq!(next.first_sequence, 3);
    assert_one_chain(&h, &run_id, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_through_two_replicas_in_turn_keep_one_chain() {
    let a = Harness::start(Backend::postgres().await).await;
    let b = a.replica().await;
    let (run_id, key) = a.running_run("two-replicas-append").await;
    let mut on_a = a.runner(&key).await;
    let mut on_b = b.runner(&key).await;
    // Each replica's remembered tip is one batch behind at every turn.
    for i in 0..6 {
        let runner = if i % 2 == 0 { &mut on_a } else { &mut on_b };
        let appended = append(
            runner,
            &run_id,
            &format!("two-replicas-batch-{i:03}"),
            vec![line(&format!("{i}.0")), line(&format!("{i}.1"))],
        )
        .await
        .unwrap();
        assert_eq!(appended.first_sequence, 2 * i + 1);
    }
    assert_one_chain(&a, &run_id, 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_on_another_replica_is_refused_at_once() {
    let a = Harness::start(Backend::postgres().await).await;
    let b = a.replica().await;
    let (run_id, old_key) = a.running_run("revoke-other-replica").await;
    let mut on_a = a.runner(&old_key).await;
    for key in ["other-warm-batch-001", "other-warm-batch-002"] {
        append(&mut on_a, &run_id, key, vec![line(key)])
            .await
            .unwrap();
    }
    b.issue_key(&run_id, 2).await;
    let err = append(&mut on_a, &run_id, "other-after-batch-01", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::Unauthenticated, ErrorReason::RunKeyRevoked);

    let (run_id, key) = a.running_run("cancel-other-replica").await;
    let mut on_a = a.runner(&key).await;
    for key in ["cancel-warm-batch-01", "cancel-warm-batch-02"] {
        append(&mut on_a, &run_id, key, vec![line(key)])
            .await
            .unwrap();
    }
    b.operator()
        .await
        .cancel_run(runstore_pb::CancelRunRequest {
            run_id: run_id.clone(),
            reason: "operator stop".into(),
            idempotency_key: "cancel-other-replica-key".into(),
        })
        .await
        .unwrap();
    let err = append(&mut on_a, &run_id, "cancel-after-batch-1", vec![line("x")])
        .await
        .unwrap_err();
    assert_reason(&err, Code::FailedPrecondition, ErrorReason::RunTerminal);
    assert_one_chain(&a, &run_id, 2).await;
}

/// A supersede that commits while the append waits for the run's row lock: the append
/// began with the old key live, and must still be refused once the lock is its.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supersede_committed_while_the_append_waits_for_the_run_refuses_it() {
    let h = Harness::start(Backend::postgres().await).await;
    let (run_id, key) = h.running_run("supersede-while-waiting").await;
    let mut runner = h.runner(&key).await;
    for key in ["waiting-warm-batch-1", "waiting-warm-batch-2"] {
        append(&mut runner, &run_id, key, vec![line(key)])
            .await
            .unwrap();
    }
    // What IssueRunKey does to supersede a generation, held open on the run's row.
    let db = h.store.store().database();
    let supersede = db.begin().await.unwrap();
    for sql in [
        "UPDATE run_keys SET revoked_reason = 'superseded', revoked_at_us = 1 \
         WHERE run_id = $1 AND revoked_at_us IS NULL",
        "UPDATE runs SET sandbox_generation = 2 WHERE id = $1",
    ] {
        supersede
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                sql,
                [run_id.clone().into()],
            ))
            .await
            .unwrap();
    }
    let pending = tokio::spawn({
        let run_id = run_id.clone();
        async move {
            append(
                &mut runner,
                &run_id,
                "waiting-batch-000001",
                vec![line("x")],
            )
            .await
        }
    });
    wait_until_blocked_on_a_lock(db).await;
    supersede.commit().await.unwrap();
    let err = pending.await.unwrap().unwrap_err();
    assert_reason(&err, Code::Unauthenticated, ErrorReason::RunKeyRevoked);
    assert_one_chain(&h, &run_id, 2).await;
}

/// Returns once some session of the test database waits for a lock (the append behind
/// the open supersede); fails after a minute.
async fn wait_until_blocked_on_a_lock(db: &sea_orm::DatabaseConnection) {
    let waiting = Statement::from_string(
        DbBackend::Postgres,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    );
    for _ in 0..6000 {
        let row = db.query_one_raw(waiting.clone()).await.unwrap().unwrap();
        if row.try_get_by_index::<i64>(0).unwrap() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the append never waited for the run's lock");
}
