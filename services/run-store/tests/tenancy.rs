//! Many orgs on one run store, over real gRPC on Postgres and SQLite: fair share of a
//! credential's slots, priority within an org, runs that cannot start never blocking
//! runs that can, quotas refused with their name and nothing written, and CreateRun's
//! size bounds.

#[macro_use]
mod common;

use common::*;
use runplane_config::{Config, OrgTenancy};
use runplane_grpc::{ErrorReason, error_info};
use runplane_proto::runstore::v1 as runstore_pb;
use tonic::Code;

/// A run store with `[run_store.tenancy]` as these tests set it: beta weighs 3, acme
/// may hold 2 runs active, org `small` may queue 2.
struct Tenancy;

impl Tenancy {
    async fn start(backend: Backend) -> Harness {
        Harness::start_with(backend, configure).await
    }
}

fn configure(config: &mut Config) {
    config.run_store.max_queued_steering_messages = 3;
    config.run_store.max_events_per_run = 12;
    config.run_store.max_event_bytes_per_run = 2048;
    let tenancy = &mut config.run_store.tenancy;
    tenancy.orgs.insert(
        "beta".into(),
        OrgTenancy {
            weight: Some(3),
            ..Default::default()
        },
    );
    tenancy.orgs.insert(
        "capped".into(),
        OrgTenancy {
            max_active_runs: Some(2),
            ..Default::default()
        },
    );
    tenancy.orgs.insert(
        "small".into(),
        OrgTenancy {
            max_queued_runs: Some(2),
            ..Default::default()
        },
    );
}

runplane_testkit::on_both_backends!(
    Tenancy::start =>
    one_run_of_a_second_org_takes_the_next_slot_before_a_queue_of_24,
    starts_follow_the_orgs_weights_across_replicas,
    an_orgs_own_runs_start_by_priority_then_age,
    a_run_on_a_quarantined_credential_never_delays_one_on_a_healthy_one,
    an_org_at_its_active_quota_waits_and_says_so_while_others_start,
    a_create_past_the_queued_quota_is_refused_by_name_and_writes_nothing,
    oversized_or_out_of_range_runs_are_refused_by_name_and_write_nothing,
    runs_with_maximal_arguments_fit_every_claim_and_listing,
    a_shared_credential_out_for_one_org_starts_the_other_orgs_runs,
    a_runs_undelivered_steering_messages_are_bounded_by_name,
    a_runs_stored_events_are_bounded_by_name_and_its_verdict_still_lands,
    a_runs_stored_event_bytes_are_bounded_by_name,
);

fn request(org: &str, credential: &str, id: &str) -> runstore_pb::CreateRunRequest {
    runstore_pb::CreateRunRequest {
        client_request_id: format!("{id:0>16}"),
        org_id: org.into(),
        target: Some(runstore_pb::create_run_request::Target::CredentialId(
            credential.into(),
        )),
        command: "agent".into(),
        ..Default::default()
    }
}

async fn create(h: &Harness, request: runstore_pb::CreateRunRequest) -> runstore_pb::Run {
    h.operator()
        .await
        .create_run(request)
        .await
        .expect("created")
        .into_inner()
        .run
        .unwrap()
}

async fn claim(h: &Harness, slots: &[(&str, u32, &str)]) -> Vec<runstore_pb::Run> {
    h.operator()
        .await
        .claim_slots(runstore_pb::ClaimSlotsRequest {
            credentials: slots
                .iter()
                .map(|(c, capacity, unavailable)| runstore_pb::CredentialSlots {
                    credential_id: c.to_string(),
                    capacity: *capacity,
                    unavailable: unavailable.to_string(),
                    unavailable_orgs: Vec::new(),
                })
                .collect(),
            unlimited: false,
            max_runs: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .claimed
}

/// Ends `run` (a cancel), freeing its slot.
async fn end(h: &Harness, run: &runstore_pb::Run) {
    h.operator()
        .await
        .cancel_run(cancel(&run.id, "", &format!("end-{}", run.id)))
        .await
        .unwrap();
}

async fn listed(h: &Harness, org: &str) -> Vec<runstore_pb::Run> {
    h.operator()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            org_id: org.into(),
            page_size: 500,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs
}

/// The field says: capacity 2, acme queued 24 runs, then beta created one; beta's run
/// waited behind acme's whole queue. It now takes the next slot that frees.
async fn one_run_of_a_second_org_takes_the_next_slot_before_a_queue_of_24(h: Harness) {
    for i in 0..24 {
        create(&h, request("acme", "shared", &format!("acme-{i}"))).await;
    }
    let first = claim(&h, &[("shared", 2, "")]).await;
    assert_eq!(first.len(), 2);
    let gamma = create(&h, request("gamma", "shared", "gamma-one")).await;
    // Both slots busy: gamma's run waits, saying why.
    assert!(claim(&h, &[("shared", 2, "")]).await.is_empty());
    assert_eq!(
        h.get_run(&gamma.id).await.waiting_reason,
        "credential shared is full: 2 of 2 slots busy"
    );
    end(&h, &first[0]).await;
    let next = claim(&h, &[("shared", 2, "")]).await;
    assert_eq!(
        next.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [gamma.id.as_str()],
        "the freed slot goes to the org with one run, not to the 23 before it"
    );
}

/// beta weighs 3 and acme 1: while both wait on one credential, beta starts three runs
/// for each of acme's, whichever of two run-store replicas claims.
async fn starts_follow_the_orgs_weights_across_replicas(h: Harness) {
    let replica = h.replica().await;
    for i in 0..20 {
        create(&h, request("acme", "shared", &format!("w-acme-{i}"))).await;
        create(&h, request("beta", "shared", &format!("w-beta-{i}"))).await;
    }
    let mut starts = std::collections::HashMap::<String, u32>::new();
    for round in 0..16 {
        let claimer = if round % 2 == 0 { &h } else { &replica };
        let claimed = claim(claimer, &[("shared", 1, "")]).await;
        assert_eq!(claimed.len(), 1, "round {round}");
        *starts.entry(claimed[0].org_id.clone()).or_default() += 1;
        end(&h, &claimed[0]).await;
    }
    assert_eq!(starts["beta"], 12, "{starts:?}");
    assert_eq!(starts["acme"], 4, "{starts:?}");
}

async fn an_orgs_own_runs_start_by_priority_then_age(h: Harness) {
    let low = create(&h, request("acme", "c1", "prio-low")).await;
    let high = create(
        &h,
        runstore_pb::CreateRunRequest {
            priority: Some(7),
            ..request("acme", "c1", "prio-high")
        },
    )
    .await;
    let later_low = create(&h, request("acme", "c1", "prio-later-low")).await;
    assert_eq!((low.priority, high.priority), (0, 7));
    let order: Vec<String> = [
        claim(&h, &[("c1", 1, "")]).await,
        claim(&h, &[("c1", 2, "")]).await,
        claim(&h, &[("c1", 3, "")]).await,
    ]
    .into_iter()
    .flatten()
    .map(|r| r.id)
    .collect();
    assert_eq!(order, [high.id, low.id, later_low.id]);
}

/// ClaimSlots looked at the oldest 100–400 queued runs only: 450 runs stuck on a
/// quarantined credential hid a run on a healthy one behind them.
async fn a_run_on_a_quarantined_credential_never_delays_one_on_a_healthy_one(h: Harness) {
    for i in 0..450 {
        create(&h, request("acme", "spent", &format!("stuck-{i}"))).await;
    }
    let healthy = create(&h, request("acme", "healthy", "healthy-one")).await;
    let claimed = claim(
        &h,
        &[
            ("spent", 4, "quarantined for 1800 s (exhausted)"),
            ("healthy", 4, ""),
        ],
    )
    .await;
    assert_eq!(
        claimed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [healthy.id.as_str()]
    );
    let stuck = listed(&h, "acme").await;
    let reasons: std::collections::HashSet<&str> = stuck
        .iter()
        .filter(|r| r.credential_id == "spent")
        .map(|r| r.waiting_reason.as_str())
        .collect();
    assert_eq!(
        reasons,
        ["credential spent is quarantined for 1800 s (exhausted)"].into()
    );
}

async fn an_org_at_its_active_quota_waits_and_says_so_while_others_start(h: Harness) {
    for i in 0..4 {
        create(&h, request("capped", "wide", &format!("capped-{i}"))).await;
    }
    let other = create(&h, request("acme", "wide", "uncapped")).await;
    let claimed = claim(&h, &[("wide", 10, "")]).await;
    let capped: Vec<_> = claimed.iter().filter(|r| r.org_id == "capped").collect();
    assert_eq!(capped.len(), 2, "capped holds at most 2 active");
    assert!(claimed.iter().any(|r| r.id == other.id));
    let waiting: Vec<_> = listed(&h, "capped")
        .await
        .into_iter()
        .filter(|r| r.state() == runstore_pb::RunState::Queued)
        .collect();
    assert_eq!(waiting.len(), 2);
    for run in &waiting {
        assert_eq!(
            run.waiting_reason,
            "org capped is at its quota of 2 active runs"
        );
    }
    // One of its runs ends: one more of its own starts.
    end(&h, capped[0]).await;
    assert_eq!(claim(&h, &[("wide", 10, "")]).await.len(), 1);
}

async fn a_create_past_the_queued_quota_is_refused_by_name_and_writes_nothing(h: Harness) {
    let first = create(&h, request("small", "c1", "small-1")).await;
    create(&h, request("small", "c1", "small-2")).await;
    let refused = h
        .operator()
        .await
        .create_run(request("small", "c1", "small-3"))
        .await
        .expect_err("past the quota");
    assert_reason(
        &refused,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
    let info = error_info(&refused).unwrap();
    assert_eq!(info.metadata["quota"], "run_store.tenancy.max_queued_runs");
    assert_eq!(info.metadata["limit"], "2");
    assert_eq!(info.metadata["org_id"], "small");
    assert!(
        refused.message().contains("org small has 2 runs queued"),
        "{}",
        refused.message()
    );
    assert_eq!(listed(&h, "small").await.len(), 2, "nothing was written");
    // A replay of an accepted create still answers with its run.
    assert_eq!(
        create(&h, request("small", "c1", "small-1")).await.id,
        first.id
    );
    // Another org is not held by small's quota.
    create(&h, request("acme", "c1", "acme-not-held")).await;
    // Once one of small's runs starts, small may queue another.
    assert_eq!(claim(&h, &[("c1", 1, "")]).await.len(), 1);
    create(&h, request("small", "c1", "small-3")).await;
}

async fn oversized_or_out_of_range_runs_are_refused_by_name_and_write_nothing(h: Harness) {
    let mut op = h.operator().await;
    let too_many_bytes = runstore_pb::CreateRunRequest {
        args: vec!["x".repeat(4096); 33],
        ..request("acme", "c1", "bytes-bound")
    };
    let refused = op.create_run(too_many_bytes).await.unwrap_err();
    assert_reason(&refused, Code::InvalidArgument, ErrorReason::InvalidField);
    assert_eq!(error_info(&refused).unwrap().metadata["field"], "args");
    assert!(
        refused
            .message()
            .contains("at most 131072 bytes in all, not 135168"),
        "{}",
        refused.message()
    );
    for priority in [-1, 10] {
        let refused = op
            .create_run(runstore_pb::CreateRunRequest {
                priority: Some(priority),
                ..request("acme", "c1", &format!("priority-{priority}"))
            })
            .await
            .unwrap_err();
        assert_reason(&refused, Code::InvalidArgument, ErrorReason::InvalidField);
        assert_eq!(error_info(&refused).unwrap().metadata["field"], "priority");
    }
    assert!(listed(&h, "acme").await.is_empty());
}

/// One org's runs with about 1 MiB of arguments each pushed ListRuns and ClaimSlots past
/// the 4 MiB a client decodes, and dispatch stopped for every org. Now a run's arguments
/// are at most 128 KiB, a claim answers without them, and a listing pages by bytes.
async fn runs_with_maximal_arguments_fit_every_claim_and_listing(h: Harness) {
    let maximal = vec!["a".repeat(4096); 32];
    for i in 0..40 {
        create(
            &h,
            runstore_pb::CreateRunRequest {
                args: maximal.clone(),
                ..request("acme", "c1", &format!("maximal-{i}"))
            },
        )
        .await;
    }
    // 40 runs of 128 KiB: 5 MiB of arguments, past what a client decodes in one message.
    let claimed = claim(&h, &[("c1", 100, "")]).await;
    assert_eq!(claimed.len(), 40);
    assert!(
        claimed
            .iter()
            .all(|r| r.args.is_empty() && r.command.is_empty())
    );
    let mut op = h.operator().await;
    let mut pages = 0;
    let mut seen = 0;
    let mut page_token = String::new();
    loop {
        let page = op
            .list_runs(runstore_pb::ListRunsRequest {
                org_id: "acme".into(),
                page_size: 500,
                page_token,
                ..Default::default()
            })
            .await
            .expect("every page decodes")
            .into_inner();
        pages += 1;
        assert!(page.runs.iter().all(|r| r.args == maximal));
        seen += page.runs.len();
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(seen, 40);
    assert!(pages >= 3, "2 MiB pages: {pages}");
    let basic = op
        .list_runs(runstore_pb::ListRunsRequest {
            org_id: "acme".into(),
            page_size: 500,
            view: runstore_pb::RunView::Basic as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(basic.runs.len(), 40);
    assert!(basic.next_page_token.is_empty());
    assert!(basic.runs.iter().all(|r| r.args.is_empty()));
}

/// Credential health says a shared credential is out for acme alone (acme's agents
/// reported it spent): acme's runs wait, saying so, and another org's start.
async fn a_shared_credential_out_for_one_org_starts_the_other_orgs_runs(h: Harness) {
    let acme = create(&h, request("acme", "shared", "out-acme")).await;
    let gamma = create(&h, request("gamma", "shared", "in-gamma")).await;
    let claimed = h
        .operator()
        .await
        .claim_slots(runstore_pb::ClaimSlotsRequest {
            credentials: vec![runstore_pb::CredentialSlots {
                credential_id: "shared".into(),
                capacity: 4,
                unavailable: String::new(),
                unavailable_orgs: vec![runstore_pb::UnavailableOrg {
                    org_id: "acme".into(),
                    reason: "quarantined for 1800 s (exhausted) for org acme".into(),
                }],
            }],
            unlimited: false,
            max_runs: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .claimed;
    assert_eq!(
        claimed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        [gamma.id.as_str()]
    );
    assert_eq!(
        h.get_run(&acme.id).await.waiting_reason,
        "credential shared is quarantined for 1800 s (exhausted) for org acme"
    );
}

/// Steers nobody takes (a wedged runner, a flood) no longer pile up without end: past
/// `max_queued_steering_messages` (3 here) a steer or interrupt is refused by name, and
/// nothing is written; once the runner takes some, room returns.
async fn a_runs_undelivered_steering_messages_are_bounded_by_name(h: Harness) {
    let (run_id, key) = h.running_run("steered-run").await;
    let steer = |i: usize| runstore_pb::SteerRequest {
        run_id: run_id.clone(),
        text: format!("line {i}"),
        idempotency_key: format!("steer-bound-{i:04}-key"),
    };
    let mut op = h.operator().await;
    let mut first = None;
    for i in 0..3 {
        let sent = op
            .steer(steer(i))
            .await
            .unwrap()
            .into_inner()
            .message
            .unwrap();
        first.get_or_insert(sent);
    }
    let refused = op.steer(steer(3)).await.unwrap_err();
    assert_reason(
        &refused,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
    let info = error_info(&refused).unwrap();
    assert_eq!(
        info.metadata["quota"],
        "run_store.max_queued_steering_messages"
    );
    assert_eq!(info.metadata["run_id"], run_id);
    assert_eq!(info.metadata["limit"], "3");
    let interrupt = op
        .interrupt(runstore_pb::InterruptRequest {
            run_id: run_id.clone(),
            reason: "enough".into(),
            idempotency_key: "interrupt-bound-0001".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(
        &interrupt,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
    // A replay of an accepted steer still answers with its message.
    let replayed = op
        .steer(steer(0))
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    assert_eq!(
        Some(replayed.id.clone()),
        first.as_ref().map(|m| m.id.clone())
    );
    // The runner takes one: there is room for one more.
    let mut runner = h.runner(&key).await;
    poll(&mut runner, &run_id, vec![]).await.unwrap();
    poll(&mut runner, &run_id, vec![applied(&replayed.id)])
        .await
        .unwrap();
    op.steer(steer(3)).await.expect("room again");
    let refused_again = op.steer(steer(4)).await.unwrap_err();
    assert_reason(
        &refused_again,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
}

/// A runner's appends past `max_events_per_run` (12 here) are refused by name and write
/// nothing, on the one-statement path and the checked one alike; a replay of an accepted
/// batch still answers; the verdict's final batch, with the marker that counts what was
/// refused, is stored all the same.
async fn a_runs_stored_events_are_bounded_by_name_and_its_verdict_still_lands(h: Harness) {
    let (run_id, key) = h.running_run("chatty-run").await;
    let mut runner = h.runner(&key).await;
    let lines = |from: usize, n: usize| {
        (from..from + n)
            .map(|i| line(&format!("line {i}")))
            .collect()
    };
    let first = append(&mut runner, &run_id, "events-bound-0001", lines(0, 10))
        .await
        .unwrap();
    let refused = append(&mut runner, &run_id, "events-bound-0002", lines(10, 3))
        .await
        .unwrap_err();
    assert_reason(
        &refused,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
    let info = error_info(&refused).unwrap();
    assert_eq!(info.metadata["quota"], "run_store.max_events_per_run");
    assert_eq!(info.metadata["run_id"], run_id);
    assert_eq!(info.metadata["limit"], "12");
    assert!(
        refused.message().contains("nothing was written"),
        "{refused:?}"
    );
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 10);
    // Up to the bound still fits; a replay answers as it did.
    append(&mut runner, &run_id, "events-bound-0003", lines(10, 2))
        .await
        .unwrap();
    let replayed = append(&mut runner, &run_id, "events-bound-0001", lines(0, 10))
        .await
        .unwrap();
    assert_eq!(replayed.last_sequence, first.last_sequence);
    let full = append(&mut runner, &run_id, "events-bound-0004", lines(12, 1))
        .await
        .unwrap_err();
    assert_reason(&full, Code::ResourceExhausted, ErrorReason::QuotaExceeded);
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 12);
    // The verdict and its marker land past the bound: the run ends once, saying so.
    let marker = runstore_pb::EventInput {
        kind: runstore_pb::EventKind::EventsLost as i32,
        name: "events_lost".into(),
        text: "4 events were not stored: the run reached its quota run_store.max_events_per_run"
            .into(),
        ..Default::default()
    };
    let ended = runner
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: run_id.clone(),
            verdict: Some(succeeded()),
            final_batch_key: "events-bound-final".into(),
            final_events: vec![marker],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ended.run.unwrap().state(), runstore_pb::RunState::Succeeded);
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 13);
}

/// Past `max_event_bytes_per_run` (2048 bytes of text, data and names here) a runner's
/// append is refused by name and writes nothing; smaller ones that fit still land.
async fn a_runs_stored_event_bytes_are_bounded_by_name(h: Harness) {
    let (run_id, key) = h.running_run("wordy-run").await;
    let mut runner = h.runner(&key).await;
    let big = |c: char| line(&c.to_string().repeat(900));
    append(
        &mut runner,
        &run_id,
        "bytes-bound-0001",
        vec![big('a'), big('b')],
    )
    .await
    .unwrap();
    let refused = append(&mut runner, &run_id, "bytes-bound-0002", vec![big('c')])
        .await
        .unwrap_err();
    assert_reason(
        &refused,
        Code::ResourceExhausted,
        ErrorReason::QuotaExceeded,
    );
    let info = error_info(&refused).unwrap();
    assert_eq!(info.metadata["quota"], "run_store.max_event_bytes_per_run");
    assert_eq!(info.metadata["limit"], "2048");
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 2);
    append(
        &mut runner,
        &run_id,
        "bytes-bound-0003",
        vec![line("short")],
    )
    .await
    .unwrap();
    assert_eq!(h.store.store().count_events(&run_id).await.unwrap(), 3);
}
