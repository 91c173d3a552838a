//! The outbox rows credential health owes the run store.

use prost::Message;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::runstore::v1 as runstore_pb;
use sea_orm::DatabaseTransaction;

use super::{Report, Result, Store};

/// `credential_health → run_store.mark_backend_error`.
pub const OUTBOX_MARK_BACKEND_ERROR: &str = "run_store.mark_backend_error";

impl Store {
    /// Owes the run store the durable outcome of this run (keyed by the turn).
    pub(super) async fn owe_mark_backend_error(
        &self,
        txn: &DatabaseTransaction,
        report: &Report,
        incident_id: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        let request = runstore_pb::MarkBackendErrorRequest {
            run_id: report.run_id.clone(),
            idempotency_key: report.turn_id.clone(),
            kind: if report.outcome == credentials_pb::TurnOutcome::BackendExhausted {
                runstore_pb::BackendErrorKind::Exhausted
            } else {
                runstore_pb::BackendErrorKind::Error
            } as i32,
            reason: report.reason.clone(),
            credential_id: report.credential_id.clone(),
            incident_id: incident_id.unwrap_or_default().to_owned(),
            turn_id: report.turn_id.clone(),
        };
        let mut row = runplane_db::outbox::row(
            OUTBOX_MARK_BACKEND_ERROR,
            report.turn_id.clone(),
            request.encode_to_vec(),
            now * 1000,
        );
        row.traceparent = runplane_grpc::trace_context::current_traceparent().unwrap_or_default();
        Ok(runplane_db::outbox::enqueue(txn, row).await?)
    }
}
