//! Retention over real gRPC, on Postgres and SQLite, on a manual clock: an ended run is
//! deleted with everything of it but its receipt once its time is up; events can go
//! earlier, and a watcher then gets an `EventsGap`; live runs and runs still within
//! their time are untouched; replicas sweeping at once delete each run once.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use runplane_config::{Config, ProfileConfig};
use runplane_grpc::ErrorReason;
use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::{ConnectionTrait, Statement};
use tonic::Code;

/// Runs kept 60 s after they end, their events 20 s; profile `keep`'s runs an hour.
/// An org token of another org than the runs'.
const GLOBEX_TOKEN: &str = "globex-operator-token-0123456789abcdef012";

fn configure(config: &mut Config) {
    config
        .auth
        .org_tokens
        .insert("globex".into(), runplane_config::Secret::new(GLOBEX_TOKEN));
    config.run_store.ended_run_retention_seconds = 60;
    config.run_store.event_retention_seconds = 20;
    config.credential_health.profiles.push(ProfileConfig {
        name: "keep".into(),
        ended_run_retention_seconds: Some(3600),
        ..ProfileConfig::default()
    });
}

struct Retained;

impl Retained {
    async fn start(backend: Backend) -> Harness {
        Harness::start_manual(backend, configure).await
    }
}

runplane_testkit::on_both_backends!(
    Retained::start =>
    an_ended_run_goes_with_everything_of_it_but_its_receipt,
    events_removed_before_their_run_are_a_gap_to_a_watcher,
    live_runs_and_runs_within_their_time_are_kept,
    replicas_sweeping_at_once_delete_each_run_once,
);

/// A run that ran: a Hello, `lines` events, a steer, then a verdict (so a receipt).
async fn ended_run(h: &Harness, id: &str, lines: usize) -> String {
    let (run_id, key) = h.running_run(id).await;
    let mut runner = h.runner(&key).await;
    let events = (0..lines).map(|i| line(&format!("line {i}"))).collect();
    append(&mut runner, &run_id, &format!("{id:0>16}-batch"), events)
        .await
        .unwrap();
    h.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: run_id.clone(),
            text: "go on".into(),
            idempotency_key: format!("{id:0>16}-steer"),
        })
        .await
        .unwrap();
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    run_id
}

/// `run_id`'s receipt as `token` may read it.
async fn receipt_of(
    h: &Harness,
    token: &str,
    run_id: &str,
) -> Result<runstore_pb::Receipt, tonic::Status> {
    h.operator_with(token)
        .await
        .get_receipt(runstore_pb::GetReceiptRequest {
            run_id: run_id.into(),
        })
        .await
        .map(|r| r.into_inner().receipt.expect("a receipt"))
}

/// Rows of `table` whose `column` is `run_id`.
async fn rows(h: &Harness, table: &str, column: &str, run_id: &str) -> i64 {
    let db = h.store.store().database();
    let backend = db.get_database_backend();
    let placeholder = match backend {
        sea_orm::DbBackend::Postgres => "$1",
        _ => "?",
    };
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            format!("SELECT COUNT(*) AS n FROM {table} WHERE {column} = {placeholder}"),
            [run_id.into()],
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get::<i64>("", "n").unwrap()
}

async fn watch_from_start(
    h: &Harness,
    run_id: &str,
) -> Vec<runstore_pb::watch_run_response::Update> {
    let mut stream = h
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.into(),
            after_sequence: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut updates = Vec::new();
    while let Some(update) = stream.next().await {
        updates.push(update.unwrap().update.unwrap());
    }
    updates
}

async fn an_ended_run_goes_with_everything_of_it_but_its_receipt(h: Harness) {
    let run_id = ended_run(&h, "gone-run", 5).await;
    let events = h.get_run(&run_id).await.last_sequence;
    let receipt = receipt_of(&h, SERVICE_TOKEN, &run_id).await.unwrap();
    // Within its time nothing goes.
    h.advance(Duration::from_secs(19));
    assert_eq!(h.store.sweep_retention().await.unwrap().runs, 0);
    assert_eq!(rows(&h, "events", "run_id", &run_id).await as u64, events);
    h.advance(Duration::from_secs(42));
    let swept = h.store.sweep_retention().await.unwrap();
    assert_eq!((swept.runs, swept.events), (1, events), "{swept:?}");
    for (table, column) in [
        ("runs", "id"),
        ("events", "run_id"),
        ("event_batches", "run_id"),
        ("steering_messages", "run_id"),
        ("run_keys", "run_id"),
        ("keyed_answers", "run_id"),
    ] {
        assert_eq!(rows(&h, table, column, &run_id).await, 0, "{table}");
    }
    let gone = h
        .operator()
        .await
        .get_run(runstore_pb::GetRunRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap_err();
    assert_reason(&gone, Code::NotFound, ErrorReason::RunNotFound);
    // The receipt stays, the audit record, for its own org only.
    assert_eq!(
        receipt_of(&h, SERVICE_TOKEN, &run_id).await.unwrap(),
        receipt
    );
    let own_org = receipt_of(&h, ACME_TOKEN, &run_id).await;
    assert_eq!(own_org.unwrap(), receipt, "acme's own receipt");
    let other_org = receipt_of(&h, GLOBEX_TOKEN, &run_id).await.unwrap_err();
    assert_reason(&other_org, Code::NotFound, ErrorReason::RunNotFound);
    // A second pass finds nothing more.
    assert_eq!(
        h.store.sweep_retention().await.unwrap(),
        runplane_run_store::store::Swept::default()
    );
}

async fn events_removed_before_their_run_are_a_gap_to_a_watcher(h: Harness) {
    let run_id = ended_run(&h, "gap-run", 4).await;
    let run = h.get_run(&run_id).await;
    h.advance(Duration::from_secs(21));
    let swept = h.store.sweep_retention().await.unwrap();
    assert_eq!(
        (swept.events, swept.runs),
        (run.last_sequence, 0),
        "{swept:?}"
    );
    assert_eq!(run.state(), runstore_pb::RunState::Succeeded);
    use runstore_pb::watch_run_response::Update;
    let updates = watch_from_start(&h, &run_id).await;
    let gaps: Vec<_> = updates
        .iter()
        .filter_map(|u| match u {
            Update::Gap(gap) => Some((gap.from_sequence, gap.to_sequence)),
            _ => None,
        })
        .collect();
    assert_eq!(gaps, [(1, run.last_sequence)], "{updates:?}");
    assert!(!updates.iter().any(|u| matches!(u, Update::Event(_))));
    // The receipt still verifies what the run was.
    let receipt = receipt_of(&h, SERVICE_TOKEN, &run_id).await.unwrap();
    assert_eq!(receipt.body.unwrap().event_count, run.last_sequence);
}

async fn live_runs_and_runs_within_their_time_are_kept(h: Harness) {
    let (live, key) = h.running_run("live-run").await;
    append(
        &mut h.runner(&key).await,
        &live,
        "live-run-batch-0001",
        vec![line("still here")],
    )
    .await
    .unwrap();
    let kept = h
        .operator()
        .await
        .create_run(runstore_pb::CreateRunRequest {
            target: Some(runstore_pb::create_run_request::Target::Profile(
                "keep".into(),
            )),
            ..create_request("kept-profile-run")
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    h.operator()
        .await
        .cancel_run(cancel(&kept.id, "", "cancel-kept-profile-run"))
        .await
        .unwrap();
    let queued = h.create_run("queued-run").await;
    h.advance(Duration::from_secs(600));
    let swept = h.store.sweep_retention().await.unwrap();
    assert_eq!(swept.runs, 0, "{swept:?}");
    assert_eq!(rows(&h, "events", "run_id", &live).await, 1);
    for id in [&live, &kept.id, &queued.id] {
        h.get_run(id).await;
    }
    // Past its profile's own hour, the kept run goes too.
    h.advance(Duration::from_secs(3600));
    assert_eq!(h.store.sweep_retention().await.unwrap().runs, 1);
    assert_eq!(rows(&h, "runs", "id", &kept.id).await, 0);
}

async fn replicas_sweeping_at_once_delete_each_run_once(h: Harness) {
    let replica = h.replica().await;
    let mut ended = Vec::new();
    for i in 0..6 {
        ended.push(ended_run(&h, &format!("swept-{i}"), 3).await);
    }
    h.advance(Duration::from_secs(61));
    let (a, b) = tokio::join!(h.store.sweep_retention(), replica.store.sweep_retention());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.runs + b.runs, 6, "{a:?} {b:?}");
    for run_id in &ended {
        assert_eq!(rows(&h, "runs", "id", run_id).await, 0);
        assert_eq!(rows(&h, "events", "run_id", run_id).await, 0);
    }
}
