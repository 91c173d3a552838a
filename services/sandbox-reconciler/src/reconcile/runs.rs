//! What the reconciler asks the run store of its sandboxes' runs: which of them are in
//! which state, a bounded question at a time.

use runplane_ids::RunId;
use runplane_proto::limits::MAX_LIST_RUNS_RUN_IDS;
use runplane_proto::runstore::v1 as runstore_pb;

use crate::clients::RunStoreClient;
use crate::error::ReconcilerError;
use crate::store::entities::sandbox;

/// Most run ids in one `ListRuns` question (the run store's limit).
pub(super) const RUN_IDS_PER_QUESTION: u64 = MAX_LIST_RUNS_RUN_IDS as u64;

/// The distinct run ids of `rows` that can name a run (a [`RunId`]): the run store
/// refuses the whole question otherwise, and no run has another id.
pub(super) fn run_ids_of(rows: &[sandbox::Model]) -> Vec<String> {
    let mut run_ids: Vec<String> = rows
        .iter()
        .filter_map(|r| RunId::parse(&r.run_id).ok())
        .map(String::from)
        .collect();
    run_ids.sort();
    run_ids.dedup();
    run_ids
}

/// What else a run must be for [`runs_among`] to answer with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Only {
    /// Nothing else.
    Any,
    /// It has a steering or control message not yet acknowledged.
    WithPendingMessages,
    /// It is paused (PauseRun).
    Paused,
}

/// Which of `run_ids` (at most [`RUN_IDS_PER_QUESTION`]) are in one of `states` (and
/// what `only` says), every page of the answer read. The answer is checked here too (id
/// asked for, state one of those asked for, paused when asked), so a run store that
/// ignored a filter could make the caller act on no run it should not.
pub(super) async fn runs_among(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
    states: &[runstore_pb::RunState],
    only: Only,
) -> Result<std::collections::HashSet<String>, ReconcilerError> {
    Ok(runs_of(run_store, run_ids, states, only)
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect())
}

/// The runs of `run_ids` (at most [`RUN_IDS_PER_QUESTION`]) in one of `states` (any
/// state when empty) and what `only` says, every page of the answer read and checked as
/// [`runs_among`] says.
pub(super) async fn runs_of(
    run_store: &RunStoreClient,
    run_ids: Vec<String>,
    states: &[runstore_pb::RunState],
    only: Only,
) -> Result<Vec<runstore_pb::Run>, ReconcilerError> {
    let asked: std::collections::HashSet<String> = run_ids.iter().cloned().collect();
    let mut found = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = run_store
            .clone()
            .list_runs(runstore_pb::ListRunsRequest {
                run_ids: run_ids.clone(),
                states: states.iter().map(|s| *s as i32).collect(),
                with_pending_messages: only == Only::WithPendingMessages,
                paused_only: only == Only::Paused,
                page_size: RUN_IDS_PER_QUESTION as u32,
                page_token,
                view: runstore_pb::RunView::Basic as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        found.extend(
            page.runs
                .into_iter()
                .filter(|r| states.is_empty() || states.contains(&r.state()))
                .filter(|r| asked.contains(&r.id))
                .filter(|r| only != Only::Paused || r.paused_since.is_some()),
        );
        if page.next_page_token.is_empty() {
            return Ok(found);
        }
        page_token = page.next_page_token;
    }
}
