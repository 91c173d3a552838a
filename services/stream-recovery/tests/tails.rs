//! Following tails: woken by the store, not polling the run store; planning for a run
//! that has no controller yet without spending anything; asleep through a parked run.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Backend, World, frames, on_every_backend, plan};
use runplane_grpc::client::Bearer;
use runplane_proto::recovery::v1 as recovery_pb;
use runplane_proto::recovery::v1::stream_recovery_service_client::StreamRecoveryServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;

/// A following tail, read in the background; `next` waits for its next item.
struct Follower {
    items: tokio::sync::mpsc::UnboundedReceiver<recovery_pb::tail_response::Item>,
}

impl Follower {
    async fn open(w: &World, run_id: &str) -> Self {
        let mut stream = w
            .operator()
            .await
            .tail(recovery_pb::TailRequest {
                run_id: run_id.to_owned(),
                from_sequence: 0,
                follow: true,
                heartbeat_interval: None,
            })
            .await
            .unwrap()
            .into_inner();
        let (tx, items) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(item)) = stream.message().await {
                // Heartbeats say only that the tail is alive; these tests read what it says.
                if let Some(item) = item.item
                    && !matches!(item, recovery_pb::tail_response::Item::Heartbeat(_))
                    && tx.send(item).is_err()
                {
                    return;
                }
            }
        });
        Self { items }
    }

    async fn next(&mut self) -> recovery_pb::tail_response::Item {
        self.within(Duration::from_secs(10)).await
    }

    async fn within(&mut self, bound: Duration) -> recovery_pb::tail_response::Item {
        tokio::time::timeout(bound, self.items.recv())
            .await
            .unwrap_or_else(|_| panic!("the tail sent nothing within {bound:?}"))
            .expect("the tail is open")
    }

    fn decision(item: &recovery_pb::tail_response::Item) -> Option<recovery_pb::RecoveryDecision> {
        match item {
            recovery_pb::tail_response::Item::Recovery(r) => Some(r.decision()),
            _ => None,
        }
    }
}

async fn a_queued_run_is_never_taken_over_and_later_runs_normally(backend: Backend) {
    let w = World::on(false, backend).await;
    let run_id = w.queued_run().await;
    let mut tail = Follower::open(&w, &run_id).await;
    assert!(matches!(
        tail.next().await,
        recovery_pb::tail_response::Item::CaughtUp(_)
    ));
    // The tail plans as soon as it caught up, and says there is no controller to replace.
    assert_eq!(
        Follower::decision(&tail.next().await),
        Some(recovery_pb::RecoveryDecision::NoControllerYet)
    );
    // Three simulated minutes of watchers planning every few seconds, as in the field.
    for _ in 0..45 {
        w.clock.advance(Duration::from_secs(4));
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            answer.decision(),
            recovery_pb::RecoveryDecision::NoControllerYet
        );
    }
    let spent = w.budget(&run_id).await;
    assert_eq!(spent.budget.unwrap().attempts, 0, "nothing was spent");
    assert_eq!(spent.lease.unwrap().state(), recovery_pb::LeaseState::Free);
    assert_eq!(
        w.run_state(&run_id).await.state(),
        runstore_pb::RunState::Queued
    );
    assert!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );

    // The run starts; until its runner acquires, a plan still finds no controller.
    let key = w.start(&run_id).await;
    w.clock.advance(Duration::from_secs(61));
    let before_acquire = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        before_acquire.decision(),
        recovery_pb::RecoveryDecision::NoControllerYet
    );
    // Its runner is the first controller: it acquires directly and streams.
    let token = w.acquire(&run_id, &key).await;
    w.runner(&key)
        .await
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: token,
            frames: frames(1..=3),
            resync: false,
        })
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match tail.next().await {
            recovery_pb::tail_response::Item::Frame(f) => seen.push(f.sequence),
            recovery_pb::tail_response::Item::Recovery(r) => {
                assert_eq!(
                    r.decision(),
                    recovery_pb::RecoveryDecision::NoControllerYet,
                    "the tail never claims"
                )
            }
            other => panic!("unexpected tail item {other:?}"),
        }
    }
    assert_eq!(seen, [1, 2, 3], "the same tail keeps serving frames");
    let held = w
        .operator()
        .await
        .plan_recovery(plan(&run_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(held.decision(), recovery_pb::RecoveryDecision::LeaseHeld);
    assert_eq!(w.budget(&run_id).await.budget.unwrap().attempts, 0);
    assert!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );
}

async fn a_parked_run_sleeps_through_any_number_of_leases(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let token = w.acquire(&run_id, &key).await;
    let mut runner = w.runner(&key).await;
    let append = |range| recovery_pb::AppendFramesRequest {
        run_id: run_id.clone(),
        controller_token: token.clone(),
        frames: frames(range),
        resync: false,
    };
    runner.append_frames(append(1..=3)).await.unwrap();
    let mut tail = Follower::open(&w, &run_id).await;

    // The node agent parks the stream, then suspends the sandbox: the runner renews
    // nothing from here on.
    let parked = w
        .operator()
        .await
        .park_stream(recovery_pb::ParkStreamRequest {
            run_id: run_id.clone(),
            sandbox_id: "sbx".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(parked.parked);
    // Six leases' worth of suspension, tailed and planned all along.
    for _ in 0..6 {
        w.clock.advance(Duration::from_secs(31));
        let answer = w
            .operator()
            .await
            .plan_recovery(plan(&run_id))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.decision(), recovery_pb::RecoveryDecision::LeaseHeld);
        // Room for the following tail to plan too.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let swept = w
        .operator()
        .await
        .sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        swept
            .results
            .iter()
            .all(|r| r.action() == recovery_pb::OrphanAction::Skipped),
        "the sweep leaves a parked run alone"
    );
    let state = w.budget(&run_id).await;
    assert_eq!(
        state.lease.unwrap().state(),
        recovery_pb::LeaseState::Parked
    );
    assert_eq!(state.budget.unwrap().attempts, 0);
    assert!(
        w.messages(&run_id, runstore_pb::SteeringKind::ResumeStream)
            .await
            .is_empty()
    );

    // The restore hands the lease back; the same runner goes on with the same token.
    let unparked = w
        .operator()
        .await
        .unpark_stream(recovery_pb::UnparkStreamRequest {
            run_id: run_id.clone(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(unparked.unparked);
    runner.append_frames(append(4..=6)).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 6 {
        match tail.next().await {
            recovery_pb::tail_response::Item::Frame(f) => seen.push(f.sequence),
            recovery_pb::tail_response::Item::CaughtUp(_) => {}
            other => panic!("a parked run's tail got {other:?}"),
        }
    }
    assert_eq!(seen, [1, 2, 3, 4, 5, 6], "every frame once, no replay_gap");
    assert_eq!(
        w.budget(&run_id).await.lease.unwrap().state(),
        recovery_pb::LeaseState::Held
    );
}

/// A following tail waits on the coordinator's store: it does not poll the run store
/// while nothing happens, and a frame appended through another coordinator replica
/// reaches it at once (not at its 30 s re-check).
async fn a_tail_is_woken_by_frames_and_does_not_poll(backend: Backend) {
    let w = World::on(false, backend).await;
    let (run_id, key) = w.running_run().await;
    let token = w.acquire(&run_id, &key).await;
    let mut tail = Follower::open(&w, &run_id).await;
    assert!(matches!(
        tail.next().await,
        recovery_pb::tail_response::Item::CaughtUp(_)
    ));
    let appender = match w.replica().await {
        Some(replica) => StreamRecoveryServiceClient::with_interceptor(
            World::channel(&replica).await,
            Bearer::new(key.clone()),
        ),
        None => w.runner(&key).await,
    };
    let append = |range| {
        let (mut appender, run_id, token) = (appender.clone(), run_id.clone(), token.clone());
        async move {
            appender
                .append_frames(recovery_pb::AppendFramesRequest {
                    run_id,
                    controller_token: token,
                    frames: frames(range),
                    resync: false,
                })
                .await
                .unwrap();
        }
    };
    // Well under every timer of the tail (heartbeat 5 s, the lease's lapse, re-check
    // 30 s): only a wake-up from the store delivers a frame this soon.
    let woken = Duration::from_secs(2);
    append(1..=2).await;
    for sequence in 1..=2 {
        match tail.within(woken).await {
            recovery_pb::tail_response::Item::Frame(f) => assert_eq!(f.sequence, sequence),
            other => panic!("expected frame {sequence}, got {other:?}"),
        }
    }
    // Idle for a while: the tail follows the run's state through one WatchRun.
    let reads = w.get_runs.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    append(3..=3).await;
    match tail.within(woken).await {
        recovery_pb::tail_response::Item::Frame(f) => assert_eq!(f.sequence, 3),
        other => panic!("expected frame 3, got {other:?}"),
    }
    assert_eq!(
        w.get_runs.load(Ordering::SeqCst) - reads,
        0,
        "an idle tail read the run from the run store"
    );
}

on_every_backend! {
    a_tail_is_woken_by_frames_and_does_not_poll: a_tail_waits_on_redis_not_the_run_store, a_tail_waits_on_the_cluster_not_the_run_store, a_tail_waits_in_memory_not_on_the_run_store;
    a_queued_run_is_never_taken_over_and_later_runs_normally: tails_and_plans_of_a_queued_run_spend_nothing_on_redis, tails_and_plans_of_a_queued_run_spend_nothing_on_a_cluster, tails_and_plans_of_a_queued_run_spend_nothing_in_memory;
    a_parked_run_sleeps_through_any_number_of_leases: a_suspended_run_tailed_past_five_leases_is_never_taken_over_on_redis, a_suspended_run_tailed_past_five_leases_is_never_taken_over_on_a_cluster, a_suspended_run_tailed_past_five_leases_is_never_taken_over_in_memory;
}
