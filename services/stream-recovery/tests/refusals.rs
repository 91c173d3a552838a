//! Requests the coordinator refuses before anything is read or written: out-of-range
//! lease TTLs and frame sequences, unknown and malformed run ids.

mod common;

use common::{Backend, World, frames, on_every_backend, plan};
use runplane_proto::recovery::v1 as recovery_pb;
use tonic::Code;

/// A lease TTL of a far-off number of seconds is refused like any TTL out of range; it
/// must not overflow the conversion to milliseconds (a panic in a checked build, a
/// wrapped value that passes the range check in a release one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ttl_past_its_range_is_refused_not_overflowed() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    for seconds in [i64::MAX, i64::MAX / 1000 + 1, -1] {
        let refused = runner
            .acquire_lease(recovery_pb::AcquireLeaseRequest {
                run_id: run_id.clone(),
                controller_id: "runner-ttl-check".into(),
                ttl: Some(prost_types::Duration { seconds, nanos: 0 }),
            })
            .await
            .expect_err("an out-of-range ttl was accepted");
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{seconds}: {refused:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_sequences_past_their_bound_are_refused_not_overflowed() {
    let w = World::new(false).await;
    let (run_id, key) = w.running_run().await;
    let mut runner = w.runner(&key).await;
    let token = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.clone(),
            controller_id: "runner-overflow-check".into(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    for sequences in [vec![u64::MAX, 0], vec![u64::MAX], vec![(1 << 53) + 1]] {
        let refused = runner
            .append_frames(recovery_pb::AppendFramesRequest {
                run_id: run_id.clone(),
                controller_token: token.clone(),
                frames: sequences
                    .iter()
                    .map(|&sequence| recovery_pb::FrameInput {
                        sequence,
                        data: b"x".to_vec(),
                    })
                    .collect(),
                resync: false,
            })
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::InvalidArgument,
            "{sequences:?}: {refused:?}"
        );
    }
    // Nothing was appended: the stream still starts at 1.
    let appended = runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.clone(),
            controller_token: token,
            frames: frames(1..=1),
            resync: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(appended.next_sequence, 2);
}

async fn bad_run_ids_are_refused_and_leave_no_state(backend: Backend) {
    let w = World::on(false, backend).await;
    let unknown = "01a22b9d-7bd7-76e7-a072-4dd6efe3ec58";
    for (run_id, code) in [
        (unknown, Code::NotFound),
        ("not-a-run", Code::InvalidArgument),
        (
            "01A22B9D-7BD7-76E7-A072-4DD6EFE3EC58",
            Code::InvalidArgument,
        ),
    ] {
        let mut op = w.operator().await;
        let plan = op.plan_recovery(plan(run_id)).await.unwrap_err();
        assert_eq!(plan.code(), code, "plan of {run_id}: {plan:?}");
        let tail = op
            .tail(recovery_pb::TailRequest {
                run_id: run_id.into(),
                from_sequence: 0,
                follow: true,
                heartbeat_interval: None,
            })
            .await;
        let tail = match tail {
            Err(status) => status,
            Ok(stream) => stream.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(tail.code(), code, "tail of {run_id}: {tail:?}");
        // A budget read of an unknown run answers an empty budget; a malformed id is
        // refused. Neither writes anything.
        let budget = op
            .get_recovery_budget(recovery_pb::GetRecoveryBudgetRequest {
                run_id: run_id.into(),
            })
            .await;
        if code == Code::InvalidArgument {
            assert_eq!(budget.unwrap_err().code(), code);
        } else {
            assert_eq!(budget.unwrap().into_inner().budget.unwrap().attempts, 0);
        }
    }
    let swept = w
        .operator()
        .await
        .sweep_orphans(recovery_pb::SweepOrphansRequest {
            cursor: String::new(),
            limit: 10,
            dry_run: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(swept.results.is_empty(), "no state: {:?}", swept.results);
    if backend != Backend::Memory {
        let keys = w._redis.keys().await;
        assert!(keys.is_empty(), "no keys: {keys:?}");
    }
}

on_every_backend! {
    bad_run_ids_are_refused_and_leave_no_state: unknown_and_malformed_runs_are_refused_with_no_keys_on_redis, unknown_and_malformed_runs_are_refused_with_no_keys_on_a_cluster, unknown_and_malformed_runs_are_refused_with_no_state_in_memory;
    an_orgs_buffered_bytes_are_bounded_by_name: an_orgs_buffered_bytes_are_bounded_on_redis, an_orgs_buffered_bytes_are_bounded_on_a_cluster, an_orgs_buffered_bytes_are_bounded_in_memory;
}

/// A lease and `n` frames of 32 KiB from `first` for run `run_id` as its runner.
async fn append_32k(
    w: &World,
    run_id: &str,
    key: &str,
    first: u64,
    n: u64,
) -> Result<recovery_pb::AppendFramesResponse, tonic::Status> {
    let mut runner = w.runner(key).await;
    let token = runner
        .acquire_lease(recovery_pb::AcquireLeaseRequest {
            run_id: run_id.to_owned(),
            controller_id: format!("runner-{run_id}"),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner()
        .controller_token;
    runner
        .append_frames(recovery_pb::AppendFramesRequest {
            run_id: run_id.to_owned(),
            controller_token: token,
            frames: (first..first + n)
                .map(|sequence| recovery_pb::FrameInput {
                    sequence,
                    data: vec![b'x'; 32 << 10],
                })
                .collect(),
            resync: false,
        })
        .await
        .map(tonic::Response::into_inner)
}

/// `stream_recovery.max_org_buffered_bytes` (1 MiB here) bounds what all of one org's
/// live streams hold: a second stream of acme's that would pass it is refused by name and
/// stores nothing, while another org's stream is not touched.
async fn an_orgs_buffered_bytes_are_bounded_by_name(backend: Backend) {
    let w = World::configured(backend, |config| {
        config.stream_recovery.max_org_buffered_bytes = 1 << 20;
    })
    .await;
    let (first, first_key) = w.running_run_of("acme").await;
    // 24 frames of 32 KiB: 768 KiB of acme's 1 MiB.
    append_32k(&w, &first, &first_key, 1, 24).await.unwrap();
    let (second, second_key) = w.running_run_of("acme").await;
    let refused = append_32k(&w, &second, &second_key, 1, 9)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let info = runplane_grpc::error_info(&refused).unwrap();
    assert_eq!(info.reason, "BUDGET_EXCEEDED");
    assert_eq!(info.metadata["budget_scope"], "org_buffer");
    assert_eq!(
        info.metadata["quota"],
        "stream_recovery.max_org_buffered_bytes"
    );
    // Nothing of the refused batch was stored; what fits still does.
    let fits = append_32k(&w, &second, &second_key, 1, 8).await.unwrap();
    assert_eq!(fits.next_sequence, 9);
    // Another org's streams have room of their own.
    let (beta, beta_key) = w.running_run_of("beta").await;
    append_32k(&w, &beta, &beta_key, 1, 24).await.unwrap();
}
