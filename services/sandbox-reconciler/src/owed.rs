//! What this reconciler owes the run store when a sandbox ends under a run, as outbox
//! rows: the FailRun of a lost sandbox (the loss grace ran out, or its node was fenced)
//! and of a runner that exited without a verdict. A leaf, so the tick (`reconcile`) and
//! the node fence (`store`) write one and the same request.

use prost::Message;
use runplane_proto::runstore::v1 as runstore_pb;

use crate::store::entities::{outbox, sandbox};

/// Why an attempt ends when its sandbox, or the sandbox's node, is lost.
pub const REASON_SANDBOX_LOST: &str = "sandbox_lost";

/// Why a run ends when its runner exited without a verdict.
pub const REASON_RUNNER_EXITED: &str = "runner_exited";

/// The FailRun `sandbox_lost` owed for `row`, saying `message`. Keyed by the sandbox and
/// its generation, so however its loss was established (the grace, a fence) the run
/// store sees one request per execution.
pub fn sandbox_lost(row: &sandbox::Model, message: String, now_us: i64) -> outbox::Model {
    fail_run(
        row,
        REASON_SANDBOX_LOST,
        message,
        format!("sandbox-lost:{}:{}", row.id, row.execution_generation),
        now_us,
    )
}

/// The FailRun owed for `row` whose runner exited with `code` (recorded by its driver).
/// A runner that submitted its verdict before it exited left its run terminal, and the
/// run store answers this one with that verdict, changing nothing.
pub fn runner_exited(row: &sandbox::Model, code: Option<i32>, now_us: i64) -> outbox::Model {
    let status = code.map_or("exited".to_owned(), |c| match c {
        // The shell's convention: 128 + the signal that killed it.
        129..=192 => format!("was killed by signal {}", c - 128),
        c => format!("exited with status {c}"),
    });
    fail_run(
        row,
        REASON_RUNNER_EXITED,
        format!(
            "the runner of sandbox {} {status} without a verdict",
            row.id
        ),
        format!("runner-exited:{}:{}", row.id, row.execution_generation),
        now_us,
    )
}

fn fail_run(
    row: &sandbox::Model,
    reason: &str,
    message: String,
    idempotency_key: String,
    now_us: i64,
) -> outbox::Model {
    let request = runstore_pb::FailRunRequest {
        run_id: row.run_id.clone(),
        reason: reason.into(),
        message,
        idempotency_key,
        // Only the sandbox and execution this reconciler watched: a run that moved on (to
        // a newer generation, or to a replacement sandbox, which starts at generation 1
        // again) is left alone.
        if_sandbox_generation: Some(row.execution_generation as u64),
        if_sandbox_id: row.id.clone(),
    };
    let mut owed = runplane_db::outbox::row(
        "run_store.fail_run",
        request.idempotency_key.clone(),
        request.encode_to_vec(),
        now_us,
    );
    // The run's trace, so the loss and the run's end read as one story.
    owed.traceparent = row.traceparent.clone();
    owed
}
