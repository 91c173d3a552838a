//! Runs over real gRPC, on Postgres and on SQLite: creating and listing them, claiming
//! their slots, watching them, and who may see them.

#[macro_use]
mod common;

use std::collections::HashSet;

use common::*;
use futures::StreamExt;
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_run_store::domain::verdict::Verdict;
use tonic::Code;

runplane_testkit::on_both_backends!(
    Harness::start =>
    create_run_is_keyed_by_client_request_id,
    org_tokens_are_confined_to_their_org,
    watch_run_streams_events_and_ends_after_the_verdict,
    a_watch_of_a_finished_run_sends_its_events_then_ends_on_its_terminal_state,
    list_runs_filters_and_pages,
    list_runs_by_ids,
    pending_messages_are_listed_and_wake_the_reconciler_as_ends_do,
    claim_slots_fills_a_credential_to_its_capacity_oldest_first,
    concurrent_claims_never_overfill_a_credential,
    numbers_past_their_columns_are_invalid_argument_and_change_nothing,
    a_replayed_verdict_wakes_the_watchers_its_first_attempt_did_not,
    a_watch_open_at_shutdown_ends_unavailable_saying_shutting_down,
    waiting_for_input_follows_the_newest_observation_and_wakes_watchers,
);

fn slots(credential: &str, capacity: u32, unavailable: &str) -> runstore_pb::CredentialSlots {
    runstore_pb::CredentialSlots {
        credential_id: credential.into(),
        capacity,
        unavailable: unavailable.into(),
        unavailable_orgs: Vec::new(),
    }
}

async fn claim(h: &Harness, credentials: Vec<runstore_pb::CredentialSlots>) -> Vec<String> {
    h.operator()
        .await
        .claim_slots(runstore_pb::ClaimSlotsRequest {
            credentials,
            unlimited: false,
            max_runs: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .claimed
        .into_iter()
        .map(|r| {
            assert_eq!(r.state(), runstore_pb::RunState::Starting);
            r.id
        })
        .collect()
}

async fn claim_slots_fills_a_credential_to_its_capacity_oldest_first(h: Harness) {
    let first = h.create_run("slots-first").await;
    let second = h.create_run("slots-second").await;
    let third = h.create_run("slots-third").await;
    let cred_a = || vec![slots("cred-a", 2, "")];
    assert_eq!(
        claim(&h, cred_a()).await,
        [first.id.clone(), second.id.clone()]
    );
    let waiting = h.get_run(&third.id).await;
    assert_eq!(waiting.state(), runstore_pb::RunState::Queued);
    assert_eq!(
        waiting.waiting_reason,
        "credential cred-a is full: 2 of 2 slots busy"
    );
    let counts = h
        .operator()
        .await
        .count_active_runs(runstore_pb::CountActiveRunsRequest {
            credential_ids: vec!["cred-a".into()],
            profiles: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(counts.active_by_credential["cred-a"], 2);
    assert_eq!(counts.queued_by_credential["cred-a"], 1);
    // Claiming again changes nothing while both slots are busy.
    assert!(claim(&h, cred_a()).await.is_empty());
    // A cooling-off credential takes nothing and says why.
    assert!(
        claim(&h, vec![slots("cred-a", 5, "cooling off for 42 s")])
            .await
            .is_empty()
    );
    assert_eq!(
        h.get_run(&third.id).await.waiting_reason,
        "credential cred-a is cooling off for 42 s"
    );
    assert!(claim(&h, vec![]).await.is_empty());
    assert_eq!(
        h.get_run(&third.id).await.waiting_reason,
        "credential cred-a is not in the fleet"
    );
    // One of the two ends: its slot goes to the waiting run.
    h.operator()
        .await
        .cancel_run(cancel(&first.id, "", "cancel-frees-a-slot-1"))
        .await
        .unwrap();
    assert_eq!(claim(&h, cred_a()).await, [third.id.as_str()]);
    assert_eq!(h.get_run(&third.id).await.waiting_reason, "");
}

async fn concurrent_claims_never_overfill_a_credential(h: Harness) {
    for i in 0..10 {
        h.create_run(&format!("slots-race-{i}")).await;
    }
    let claims =
        futures::future::join_all((0..4).map(|_| claim(&h, vec![slots("cred-a", 3, "")]))).await;
    let claimed: Vec<String> = claims.into_iter().flatten().collect();
    assert_eq!(claimed.len(), 3, "{claimed:?}");
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), 3);
}

async fn list_runs_by_ids(h: Harness) {
    let a = h.create_run("by-id-a").await;
    let b = h.create_run("by-id-b").await;
    let _c = h.create_run("by-id-c").await;
    let mut op = h.operator().await;
    let listed = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec![a.id.clone(), b.id.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut ids: Vec<_> = listed.runs.into_iter().map(|r| r.id).collect();
    ids.sort();
    let mut want = vec![a.id, b.id];
    want.sort();
    assert_eq!(ids, want);
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec!["nope".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            run_ids: vec![h.create_run("by-id-d").await.id; 501],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
}

/// A WaitForRuns long poll, answered in the background.
async fn wait_for_runs(h: &Harness) -> tokio::task::JoinHandle<bool> {
    let mut op = h.operator().await;
    tokio::spawn(async move {
        op.wait_for_runs(runstore_pb::WaitForRunsRequest {
            wait: Some(prost_types::Duration {
                seconds: 20,
                nanos: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .woken
    })
}

/// What the reconciler relies on to wake a parked run: a queued message wakes
/// WaitForRuns, and ListRuns names the runs whose messages are not yet acknowledged; a
/// run ending wakes WaitForRuns too (its sandboxes are destroyed at once).
async fn pending_messages_are_listed_and_wake_the_reconciler_as_ends_do(h: Harness) {
    let (steered, key) = h.running_run("pending-steered").await;
    let (quiet, _) = h.running_run("pending-quiet").await;
    let queued = h.create_run("pending-queued").await;
    let ids = vec![steered.clone(), quiet.clone(), queued.id.clone()];
    let pending = async |h: &Harness| {
        let mut listed: Vec<String> = h
            .operator()
            .await
            .list_runs(runstore_pb::ListRunsRequest {
                run_ids: ids.clone(),
                with_pending_messages: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .runs
            .into_iter()
            .map(|r| r.id)
            .collect();
        listed.sort();
        listed
    };
    assert!(pending(&h).await.is_empty());

    let waiting = wait_for_runs(&h).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "WaitForRuns answered with nothing to say"
    );
    h.operator()
        .await
        .steer(runstore_pb::SteerRequest {
            run_id: steered.clone(),
            text: "are you there".into(),
            idempotency_key: "pending-steer-0001".into(),
        })
        .await
        .unwrap();
    assert!(
        waiting.await.unwrap(),
        "a queued message wakes the reconciler"
    );
    assert_eq!(pending(&h).await, std::slice::from_ref(&steered));

    // Served is not acknowledged: still pending until the runner says it landed.
    let mut runner = h.runner(&key).await;
    let served = poll(&mut runner, &steered, vec![]).await.unwrap();
    assert_eq!(pending(&h).await, std::slice::from_ref(&steered));
    poll(&mut runner, &steered, vec![applied(&served.messages[0].id)])
        .await
        .unwrap();
    assert!(pending(&h).await.is_empty());

    let waiting = wait_for_runs(&h).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    h.operator()
        .await
        .cancel_run(runstore_pb::CancelRunRequest {
            run_id: quiet.clone(),
            reason: String::new(),
            idempotency_key: "pending-cancel-0001".into(),
        })
        .await
        .unwrap();
    assert!(waiting.await.unwrap(), "a run's end wakes the reconciler");
}

async fn create_run_is_keyed_by_client_request_id(h: Harness) {
    let mut op = h.operator().await;
    h.cut_next("CreateRun", 1);
    assert!(op.create_run(create_request("keyed-create")).await.is_err());
    let first = op
        .create_run(create_request("keyed-create"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let again = op
        .create_run(create_request("keyed-create"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(first.id, again.id);

    let mut different = create_request("keyed-create");
    different.command = "other-agent".into();
    let err = op.create_run(different).await.unwrap_err();
    assert_reason(
        &err,
        Code::InvalidArgument,
        ErrorReason::IdempotencyKeyReused,
    );

    let mut bad = create_request("bad-create");
    bad.target = None;
    let err = op.create_run(bad).await.unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::InvalidField);
    assert_eq!(error_info(&err).unwrap().metadata["field"], "target");
    let listed = op
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.runs.len(), 1, "the refused request wrote nothing");
}

/// `[auth]` with the operator and org tokens replaced by their SHA-256 digests.
fn only_digests(config: &mut runplane_config::Config) {
    let hex = |token: &str| {
        runplane_grpc::auth::sha256(token)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    config.auth.operator_token = Default::default();
    config.auth.operator_token_sha256 = hex(SERVICE_TOKEN);
    config.auth.org_tokens.clear();
    config
        .auth
        .org_token_sha256
        .insert("acme".into(), hex(ACME_TOKEN));
}

/// A server that holds only the digests of the operator and org tokens admits the
/// tokens themselves as before: operators everywhere, an org token in its org alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_holding_only_token_digests_admits_the_tokens() {
    let h = Harness::start_with(runplane_testkit::Backend::sqlite().await, only_digests).await;
    org_tokens_are_confined_to_their_org(h).await;
}

async fn org_tokens_are_confined_to_their_org(h: Harness) {
    let mut service = h.operator().await;
    let mut globex = create_request("globex-run");
    globex.org_id = "globex".into();
    let globex_run = service
        .create_run(globex.clone())
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();

    let mut acme = h.operator_with(ACME_TOKEN).await;
    let err = acme.create_run(globex).await.unwrap_err();
    assert_reason(&err, Code::PermissionDenied, ErrorReason::PermissionDenied);
    let err = acme
        .get_run(runstore_pb::GetRunRequest {
            run_id: globex_run.id.clone(),
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::NotFound, ErrorReason::RunNotFound);
    let acme_run = acme
        .create_run(create_request("acme-run"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let listed = acme
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed
            .runs
            .iter()
            .map(|r| r.id.as_str())
            .collect::<Vec<_>>(),
        [acme_run.id.as_str()]
    );
    let err = acme
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: acme_run.id,
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: "org-token-issue-key".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::PermissionDenied, ErrorReason::PermissionDenied);

    let mut nobody = h.operator_with("not-a-token-at-all-0123456789abcdef").await;
    let err = nobody
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
}

async fn watch_run_streams_events_and_ends_after_the_verdict(h: Harness) {
    let (run_id, key) = h.running_run("watch").await;
    let mut runner = h.runner(&key).await;
    append(
        &mut runner,
        &run_id,
        "batch-watch-000001",
        vec![line("a"), line("b")],
    )
    .await
    .unwrap();
    let stream = watch_from(&h, &run_id, 1).await;
    let writer = tokio::spawn(async move {
        append(&mut runner, &run_id, "batch-watch-000002", vec![line("c")])
            .await
            .unwrap();
        submit(&mut runner, &run_id, succeeded()).await.unwrap();
    });
    let seen = watched(stream).await;
    writer.await.unwrap();
    assert_eq!(
        seen.first().map(String::as_str),
        Some("run:RUN_STATE_RUNNING")
    );
    assert_eq!(
        seen.last().map(String::as_str),
        Some("run:RUN_STATE_SUCCEEDED")
    );
    let events: Vec<_> = seen
        .iter()
        .filter(|s| s.starts_with("event:"))
        .cloned()
        .collect();
    assert_eq!(events, ["event:2:b", "event:3:c"]);
}

/// The verdict committed with events still unsent to a watcher (the race the live
/// watch above can lose: the run read terminal while its last events were not yet
/// streamed), made certain by watching the finished run from before those events: they
/// come first, and the stream ends on the terminal snapshot, as WatchRun promises.
async fn a_watch_of_a_finished_run_sends_its_events_then_ends_on_its_terminal_state(h: Harness) {
    let (run_id, key) = h.running_run("watch-finished").await;
    let mut runner = h.runner(&key).await;
    append(
        &mut runner,
        &run_id,
        "batch-finished-0001",
        vec![line("a"), line("b"), line("c")],
    )
    .await
    .unwrap();
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    let stream = watch_from(&h, &run_id, 1).await;
    let seen = watched(stream).await;
    assert_eq!(
        seen,
        [
            "run:RUN_STATE_SUCCEEDED",
            "event:2:b",
            "event:3:c",
            "run:RUN_STATE_SUCCEEDED"
        ]
    );
}

/// A WatchRun of `run_id`'s states and events after `after_sequence`.
async fn watch_from(
    h: &Harness,
    run_id: &str,
    after_sequence: u64,
) -> tonic::Streaming<runstore_pb::WatchRunResponse> {
    h.operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.to_owned(),
            after_sequence,
            states_only: false,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner()
}

/// Everything `stream` sends until it ends, heartbeats aside: `run:STATE`,
/// `event:SEQ:TEXT` and `gap:FROM`.
async fn watched(mut stream: tonic::Streaming<runstore_pb::WatchRunResponse>) -> Vec<String> {
    use runstore_pb::watch_run_response::Update;
    let mut seen = Vec::new();
    while let Some(item) = stream.next().await {
        match item.unwrap().update.unwrap() {
            Update::Run(run) => seen.push(format!("run:{}", run.state().as_str_name())),
            Update::Event(e) => seen.push(format!("event:{}:{}", e.sequence, e.text)),
            Update::Gap(g) => seen.push(format!("gap:{}", g.from_sequence)),
            Update::Heartbeat(_) => {}
        }
    }
    seen
}

/// A states-only WatchRun of `run_id`, and its first message (the run's snapshot).
async fn watch_states(
    h: &Harness,
    run_id: &str,
) -> (
    tonic::Streaming<runstore_pb::WatchRunResponse>,
    runstore_pb::WatchRunResponse,
) {
    let mut stream = h
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.to_owned(),
            after_sequence: 0,
            states_only: true,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    (stream, first)
}

/// ReportWaitingForInput keeps the newest observation by (generation, seq): a replay or
/// an older report changes nothing, a new generation wins, a change wakes the run's
/// watchers, and only the service token may report.
async fn waiting_for_input_follows_the_newest_observation_and_wakes_watchers(h: Harness) {
    let (run_id, key) = h.running_run("waiting").await;
    let service = || async { h.operator_with(runplane_testkit::SERVICE_TOKEN).await };
    let report =
        |generation: u64, seq: u64, waiting: bool| runstore_pb::ReportWaitingForInputRequest {
            run_id: run_id.clone(),
            execution_generation: generation,
            observation_seq: seq,
            waiting,
        };
    let applied = |r: runstore_pb::ReportWaitingForInputRequest| async {
        service()
            .await
            .report_waiting_for_input(r)
            .await
            .unwrap()
            .into_inner()
            .applied
    };
    let since = || async { h.get_run(&run_id).await.waiting_for_input_since };
    assert_eq!(since().await, None, "a working run waits for nothing");

    let (mut stream, first) = watch_states(&h, &run_id).await;
    assert!(matches!(
        first.update,
        Some(runstore_pb::watch_run_response::Update::Run(ref r)) if r.waiting_for_input_since.is_none()
    ));

    assert!(applied(report(1, 5, true)).await);
    let parked_at = since().await.expect("waiting");
    let next = tokio::time::timeout(std::time::Duration::from_secs(10), stream.next())
        .await
        .expect("the watcher is woken by the change")
        .unwrap()
        .unwrap();
    match next.update {
        Some(runstore_pb::watch_run_response::Update::Run(r)) => {
            assert_eq!(r.waiting_for_input_since, Some(parked_at))
        }
        other => panic!("a snapshot, not {other:?}"),
    }
    // Still parked: the first time stays.
    assert!(applied(report(1, 6, true)).await);
    assert_eq!(since().await, Some(parked_at));
    // A replay and an older report change nothing.
    assert!(!applied(report(1, 6, false)).await);
    assert!(!applied(report(1, 2, false)).await);
    assert_eq!(since().await, Some(parked_at));
    // Newer: working again.
    assert!(applied(report(1, 7, false)).await);
    assert_eq!(since().await, None);
    // A new execution's first observation wins over the old one's counter.
    assert!(applied(report(2, 1, true)).await);
    assert!(since().await.is_some());

    // Operators may not report.
    let refused = h
        .operator()
        .await
        .report_waiting_for_input(report(3, 1, false))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");

    // An ended run is left alone, and shows no wait.
    let mut runner = h.runner(&key).await;
    submit(&mut runner, &run_id, succeeded()).await.unwrap();
    assert!(!applied(report(3, 1, true)).await);
    assert_eq!(since().await, None);
}

/// A watch open when the run store begins its shutdown ends UNAVAILABLE with an
/// ErrorInfo (SHUTTING_DOWN, the run) that tells clients to resume elsewhere, like every
/// other refusal.
async fn a_watch_open_at_shutdown_ends_unavailable_saying_shutting_down(h: Harness) {
    let (run_id, _key) = h.running_run("watch-shutdown").await;
    let (mut stream, first) = watch_states(&h, &run_id).await;
    assert!(matches!(
        first.update,
        Some(runstore_pb::watch_run_response::Update::Run(_))
    ));
    h.store.begin_shutdown();
    let status = loop {
        match tokio::time::timeout(std::time::Duration::from_secs(60), stream.next())
            .await
            .expect("the watch ends within the re-check")
        {
            Some(Ok(_)) => continue,
            Some(Err(status)) => break status,
            None => panic!("the watch ended without a status"),
        }
    };
    assert_reason(&status, Code::Unavailable, ErrorReason::ShuttingDown);
    assert_eq!(error_info(&status).unwrap().metadata["run_id"], run_id);
}

/// A SubmitResult whose first attempt committed and was dropped before it woke anyone
/// (a client deadline mid-call: the commit completes, the handler does not) is replayed
/// by the runner. The replay wakes the run's watchers, which would otherwise wait for the
/// 30 s re-check.
async fn a_replayed_verdict_wakes_the_watchers_its_first_attempt_did_not(h: Harness) {
    use runstore_pb::watch_run_response::Update;
    let (run_id, key) = h.running_run("replayed-wake").await;
    let mut stream = h
        .operator()
        .await
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: 0,
            states_only: true,
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
    // The RUNNING snapshot: the watch has read and waits for a change.
    match stream.next().await.unwrap().unwrap().update.unwrap() {
        Update::Run(run) => assert_eq!(run.state(), runstore_pb::RunState::Running),
        other => panic!("{other:?}"),
    }
    // The first attempt: committed, nobody woken.
    let verdict = Verdict::try_from(&succeeded()).unwrap();
    let first = h
        .store
        .store()
        .submit_result(&run_id, &verdict, "", None, &h.signer)
        .await
        .unwrap();
    assert!(first.made_terminal);
    let mut runner = h.runner(&key).await;
    let replay = submit(&mut runner, &run_id, succeeded()).await.unwrap();
    assert!(replay.already_recorded);
    let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            match stream.next().await.unwrap().unwrap().update.unwrap() {
                Update::Run(run) => break run.state(),
                _ => continue,
            }
        }
    })
    .await
    .expect("the replay did not wake the watcher");
    assert_eq!(ended, runstore_pb::RunState::Succeeded);
}

async fn list_runs_filters_and_pages(h: Harness) {
    let mut op = h.operator().await;
    for i in 0..5 {
        let mut req = create_request(&format!("list-{i}"));
        if i % 2 == 0 {
            req.target = Some(runstore_pb::create_run_request::Target::Profile(
                "fast".into(),
            ));
        }
        op.create_run(req).await.unwrap();
    }
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let page = op
            .list_runs(runstore_pb::ListRunsRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(page.runs.into_iter().map(|r| r.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(ids.len(), 5);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 5);

    let fast = op
        .list_runs(runstore_pb::ListRunsRequest {
            profile: "fast".into(),
            states: vec![runstore_pb::RunState::Queued as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fast.runs.len(), 3);

    let first_page = op
        .list_runs(runstore_pb::ListRunsRequest {
            page_size: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let err = op
        .list_runs(runstore_pb::ListRunsRequest {
            page_size: 2,
            profile: "fast".into(),
            page_token: first_page.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&err, Code::InvalidArgument, ErrorReason::CursorInvalid);
}

async fn numbers_past_their_columns_are_invalid_argument_and_change_nothing(h: Harness) {
    let (run_id, _) = h.running_run("numbers-past-i64").await;
    let mut op = h.operator().await;
    let field = |e: &tonic::Status| {
        assert_reason(e, Code::InvalidArgument, ErrorReason::InvalidField);
        error_info(e).unwrap().metadata["field"].clone()
    };
    let past = i64::MAX as u64 + 1;
    // A wrapped after_sequence would be negative: every event again, not a refusal.
    let watched = match op
        .watch_run(runstore_pb::WatchRunRequest {
            run_id: run_id.clone(),
            after_sequence: past,
            states_only: false,
            heartbeat_interval: None,
        })
        .await
    {
        Err(e) => e,
        Ok(stream) => match stream.into_inner().next().await {
            Some(Err(e)) => e,
            other => panic!("watched past i64::MAX: {other:?}"),
        },
    };
    assert_eq!(field(&watched), "after_sequence");
    let e = op
        .fail_run(runstore_pb::FailRunRequest {
            run_id: run_id.clone(),
            reason: "sandbox_lost".into(),
            message: String::new(),
            idempotency_key: "fail-past-i64-max-01".into(),
            if_sandbox_generation: Some(u64::MAX),
            if_sandbox_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(field(&e), "if_sandbox_generation");
    let e = op
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run_id.clone(),
            sandbox_id: "sbx-past".into(),
            sandbox_generation: past,
            idempotency_key: "issue-past-i64-max-1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(field(&e), "sandbox_generation");
    assert_eq!(
        h.get_run(&run_id).await.state(),
        runstore_pb::RunState::Running
    );
}
