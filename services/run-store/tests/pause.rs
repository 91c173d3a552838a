//! PauseRun and ResumeRun as the run store records them, on Postgres and on SQLite: keyed
//! (a replay acts once, even after the other call), refused on an ended run and on bad
//! input with nothing written, owed to the webhooks once per pause and resume, listed by
//! `paused_only`; the deadline counts paused time unless the profile says it does not,
//! and a pause past the profile's `max_pause_seconds` ends the run `paused_too_long`.
//! (The sandbox side is tested over real processes in integration-tests/tests/pause.rs.)

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use runplane_grpc::ErrorReason;
use runplane_proto::runstore::v1 as runstore_pb;

runplane_testkit::on_both_backends!(
    Paused::start =>
    a_pause_is_keyed_replayed_once_and_owed_to_the_webhooks_once_per_pause,
    a_pause_of_an_ended_run_or_with_bad_input_is_refused_and_writes_nothing,
    paused_time_counts_toward_the_deadline_unless_the_profile_says_not,
    a_pause_past_its_profile_limit_ends_the_run_paused_too_long,
);

/// Profiles `held` (paused time does not count toward the deadline) and `brief` (a pause
/// may last 10 s), one webhook endpoint on a closed port (deliveries are owed, never
/// made), on a clock the test moves.
fn configure(config: &mut runplane_config::Config) {
    let profile =
        |name: &str, max_pause: Option<u32>, counts: Option<bool>| runplane_config::ProfileConfig {
            name: name.into(),
            credential_id: "cred-a".into(),
            max_pause_seconds: max_pause,
            deadline_counts_paused_time: counts,
            ..Default::default()
        };
    config.credential_health.profiles = vec![
        profile("held", None, Some(false)),
        profile("brief", Some(10), None),
    ];
    config.run_store.webhooks = vec![runplane_config::WebhookConfig {
        url: "http://127.0.0.1:1/all".into(),
        secret: runplane_config::Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
        events: Vec::new(),
        orgs: Vec::new(),
        allow_private_targets: true,
        ca_file: String::new(),
    }];
}

struct Paused;

impl Paused {
    async fn start(backend: Backend) -> Harness {
        Harness::start_manual(backend, configure).await
    }
}

fn pause(run_id: &str, key: &str) -> runstore_pb::PauseRunRequest {
    runstore_pb::PauseRunRequest {
        run_id: run_id.into(),
        idempotency_key: key.into(),
    }
}

fn resume(run_id: &str, key: &str) -> runstore_pb::ResumeRunRequest {
    runstore_pb::ResumeRunRequest {
        run_id: run_id.into(),
        idempotency_key: key.into(),
    }
}

/// The events owed for `run_id`, oldest first, and how many distinct webhook ids.
async fn owed(h: &Harness, run_id: &str) -> (Vec<String>, usize) {
    let rows = h.store.store().webhook_deliveries(run_id).await.unwrap();
    let ids: std::collections::HashSet<_> = rows.iter().map(|d| d.id.clone()).collect();
    (rows.into_iter().map(|d| d.event_type).collect(), ids.len())
}

/// Whether ListRuns with `paused_only` answers with `run_id`.
async fn listed_paused(h: &Harness, run_id: &str) -> bool {
    h.operator()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            paused_only: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs
        .iter()
        .any(|r| r.id == run_id)
}

/// A running run created through `profile` with a deadline `max` from now.
async fn running_through(h: &Harness, request_id: &str, profile: &str, max: u64) -> String {
    let mut request = create_request(request_id);
    request.target = Some(runstore_pb::create_run_request::Target::Profile(
        profile.into(),
    ));
    request.max_duration = Some(prost_types::Duration {
        seconds: max as i64,
        nanos: 0,
    });
    let run = h
        .operator()
        .await
        .create_run(request)
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = h.issue_key(&run.id, 1).await;
    h.runner(&key)
        .await
        .hello(runstore_pb::HelloRequest {
            run_id: run.id.clone(),
            nonce: "runner-nonce-0000000001".into(),
            runner_version: "test".into(),
        })
        .await
        .expect("hello");
    run.id
}

async fn a_pause_is_keyed_replayed_once_and_owed_to_the_webhooks_once_per_pause(h: Harness) {
    let (run_id, _) = h.running_run("pause-keyed").await;
    let mut op = h.operator().await;
    assert!(!listed_paused(&h, &run_id).await);

    let first = op
        .pause_run(pause(&run_id, "pause-keyed-0000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let since = first.paused_since.expect("paused");
    assert_eq!(first.state(), runstore_pb::RunState::Running);
    assert!(listed_paused(&h, &run_id).await);
    assert_eq!(h.get_run(&run_id).await.paused_since, Some(since));

    // The same key again, and another pause: nothing changes.
    h.advance(Duration::from_secs(1));
    let replay = op
        .pause_run(pause(&run_id, "pause-keyed-0000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(replay.paused_since, Some(since));
    let again = op
        .pause_run(pause(&run_id, "pause-keyed-0000002"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(again.paused_since, Some(since));

    let resumed = op
        .resume_run(resume(&run_id, "resume-keyed-000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(resumed.paused_since, None);
    assert!(!listed_paused(&h, &run_id).await);

    // A retried pause whose first attempt won acts once: it does not pause again.
    let retried = op
        .pause_run(pause(&run_id, "pause-keyed-0000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(retried.paused_since, None);
    // Resuming a run that is not paused changes nothing; a new pause is a new pause.
    op.resume_run(resume(&run_id, "resume-keyed-000002"))
        .await
        .unwrap();
    h.advance(Duration::from_secs(1));
    op.pause_run(pause(&run_id, "pause-keyed-0000003"))
        .await
        .unwrap();
    let (events, ids) = owed(&h, &run_id).await;
    assert_eq!(
        events,
        ["run.started", "run.paused", "run.resumed", "run.paused"]
    );
    assert_eq!(ids, 4, "each pause has its own webhook id");
}

async fn a_pause_of_an_ended_run_or_with_bad_input_is_refused_and_writes_nothing(h: Harness) {
    let (run_id, key) = h.running_run("pause-refused").await;
    let mut op = h.operator().await;
    let bad_key = op.pause_run(pause(&run_id, "short")).await.unwrap_err();
    assert_reason(
        &bad_key,
        tonic::Code::InvalidArgument,
        ErrorReason::InvalidField,
    );
    assert!(bad_key.message().contains("idempotency_key"), "{bad_key:?}");
    let bad_id = op
        .pause_run(pause("not-a-run", "pause-refused-00001"))
        .await
        .unwrap_err();
    assert_eq!(bad_id.code(), tonic::Code::InvalidArgument);
    assert!(bad_id.message().contains("run_id"), "{bad_id:?}");
    assert_eq!(h.get_run(&run_id).await.paused_since, None);

    let mut runner = h.runner(&key).await;
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    for refused in [
        op.pause_run(pause(&run_id, "pause-refused-00002"))
            .await
            .map(|_| ()),
        op.resume_run(resume(&run_id, "pause-refused-00003"))
            .await
            .map(|_| ()),
    ] {
        let status = refused.unwrap_err();
        assert_reason(
            &status,
            tonic::Code::FailedPrecondition,
            ErrorReason::RunTerminal,
        );
    }
    let (events, _) = owed(&h, &run_id).await;
    assert_eq!(events, ["run.started", "run.succeeded"]);
}

async fn paused_time_counts_toward_the_deadline_unless_the_profile_says_not(h: Harness) {
    let counted = running_through(&h, "pause-counted", "brief", 60).await;
    let held = running_through(&h, "pause-held", "held", 60).await;
    let mut op = h.operator().await;
    op.pause_run(pause(&counted, "pause-counted-00001"))
        .await
        .unwrap();
    op.pause_run(pause(&held, "pause-held-00000001"))
        .await
        .unwrap();
    let deadline = h.get_run(&held).await.deadline.unwrap();

    // Past both deadlines: the counted one ends, the held one waits.
    h.advance(Duration::from_secs(61));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 1);
    let ended = h.get_run(&counted).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Failed);
    assert_eq!(ended.verdict.unwrap().reason, "deadline_exceeded");
    assert_eq!(
        h.get_run(&held).await.state(),
        runstore_pb::RunState::Running
    );

    // Resumed after 100 s paused: its deadline moved on by those 100 s.
    h.advance(Duration::from_secs(39));
    let resumed = op
        .resume_run(resume(&held, "resume-held-0000001"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(
        resumed.deadline.unwrap().seconds,
        deadline.seconds + 100,
        "the deadline moved on by the pause"
    );
    h.advance(Duration::from_secs(59));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 0);
    h.advance(Duration::from_secs(2));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 1);
    let ended = h.get_run(&held).await;
    assert_eq!(ended.verdict.unwrap().reason, "deadline_exceeded");
}

async fn a_pause_past_its_profile_limit_ends_the_run_paused_too_long(h: Harness) {
    let brief = running_through(&h, "pause-brief", "brief", 3600).await;
    let (default, _) = h.running_run("pause-default").await;
    let mut op = h.operator().await;
    op.pause_run(pause(&brief, "pause-brief-0000001"))
        .await
        .unwrap();
    op.pause_run(pause(&default, "pause-default-00001"))
        .await
        .unwrap();
    h.advance(Duration::from_secs(9));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 0);
    h.advance(Duration::from_secs(2));
    // Several replicas sweeping at once end it once.
    let sweeps = futures::future::join_all((0..3).map(|_| h.store.sweep_deadlines())).await;
    assert_eq!(sweeps.into_iter().map(Result::unwrap).sum::<u64>(), 1);
    let ended = h.get_run(&brief).await;
    assert_eq!(ended.state(), runstore_pb::RunState::Failed);
    let verdict = ended.verdict.unwrap();
    assert_eq!(verdict.reason, "paused_too_long");
    assert_eq!(ended.paused_since, None, "an ended run is not shown paused");
    let (events, _) = owed(&h, &brief).await;
    assert_eq!(events, ["run.started", "run.paused", "run.failed"]);

    // Without a profile of its own, a pause may last a day.
    h.advance(Duration::from_secs(24 * 3600 - 12));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 0);
    h.advance(Duration::from_secs(2));
    assert_eq!(h.store.sweep_deadlines().await.unwrap(), 1);
    let ended = h.get_run(&default).await;
    assert_eq!(ended.verdict.unwrap().reason, "paused_too_long");
}
