//! Delivery of the run store's outbox: each failed turn to credential health, with the
//! turn as its key, until credential health answers.

use std::time::Duration;

use prost::Message;
use runplane_proto::credentials::v1 as ch;

use crate::error::RunStoreError;
use crate::grpc::CredentialHealthClient;
use crate::store::Store;

/// How often due rows are looked for.
pub const EVERY: Duration = Duration::from_millis(250);

/// Delivers due rows once; returns how many credential health accepted.
pub async fn deliver(
    store: &Store,
    client: &CredentialHealthClient,
    limit: u64,
) -> Result<u64, RunStoreError> {
    use runplane_db::outbox;
    let db = store.database();
    let mut delivered = 0;
    for row in outbox::due(db, store.now_us(), limit).await? {
        let Ok(request) = ch::ReportTurnFailureRequest::decode(row.payload.as_slice()) else {
            tracing::warn!(key = %row.idempotency_key, "undecodable outbox row; given up");
            outbox::give_up(db, &row.id, store.now_us(), "undecodable payload").await?;
            continue;
        };
        // The delivery continues the trace of the decision that owed it.
        let span =
            tracing::info_span!("outbox.deliver", kind = %row.kind, key = %row.idempotency_key);
        runplane_grpc::trace_context::continue_trace(&span, &row.traceparent);
        let answer = {
            use tracing::Instrument;
            client
                .clone()
                .report_turn_failure(request)
                .instrument(span)
                .await
        };
        match answer {
            Ok(answer) => {
                outbox::mark_delivered(db, &row.id, store.now_us()).await?;
                delivered += 1;
                let answer = answer.into_inner();
                tracing::info!(
                    turn_id = %row.idempotency_key,
                    outcome = ?answer.outcome(),
                    incident_id = answer.incident.as_ref().map(|i| i.id.as_str()).unwrap_or_default(),
                    "turn failure classified"
                );
            }
            Err(status) if outbox::is_permanent(status.code() as i32) => {
                // E.g. a credential no profile names: it can never be classified.
                tracing::warn!(
                    turn_id = %row.idempotency_key,
                    code = ?status.code(),
                    message = status.message(),
                    "credential health refused the turn failure for good; given up"
                );
                outbox::give_up(db, &row.id, store.now_us(), status.message()).await?;
            }
            Err(status) => {
                tracing::debug!(turn_id = %row.idempotency_key, code = ?status.code(), "turn failure not delivered yet");
                outbox::delivery_failed(db, &row, store.now_us(), status.message()).await?;
            }
        }
    }
    Ok(delivered)
}
