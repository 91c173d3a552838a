//! Delivery of the run store's outbox: each failed turn to credential health, with the
//! turn as its key, until credential health answers.

use std::time::Duration;

use prost::Message;
use runplane_db::outbox::{self, Delivery};
use runplane_grpc::trace_context::outbox_span;
use runplane_proto::credentials::v1 as credentials_pb;
use tracing::Instrument;

use crate::clients::CredentialHealthClient;
use crate::error::RunStoreError;
use crate::store::Store;

/// How often due rows are looked for.
pub const EVERY: Duration = Duration::from_millis(250);

/// Delivers due rows once, each claimed first (see `runplane_db::outbox`) so another
/// replica's round does not send it too; returns how many credential health accepted.
pub async fn deliver(
    store: &Store,
    client: &CredentialHealthClient,
    limit: u64,
) -> Result<u64, RunStoreError> {
    let delivered = outbox::deliver_due(store.database(), || store.now_us(), limit, |row| {
        let mut client = client.clone();
        async move {
            let Ok(request) = credentials_pb::ReportTurnFailureRequest::decode(row.payload.as_slice()) else {
                return Delivery::Refused("undecodable payload".into());
            };
            let span = outbox_span(&row.kind, &row.idempotency_key, &row.traceparent);
            match client.report_turn_failure(request).instrument(span).await {
                Ok(answer) => {
                    let answer = answer.into_inner();
                    tracing::info!(
                        turn_id = %row.idempotency_key,
                        outcome = ?answer.outcome(),
                        incident_id = answer.incident.as_ref().map(|i| i.id.as_str()).unwrap_or_default(),
                        "turn failure classified"
                    );
                    Delivery::Delivered
                }
                // E.g. a credential no profile names: it can never be classified.
                Err(status) => Delivery::from_failure(status.code() as i32, status.message()),
            }
        }
    })
    .await?;
    Ok(delivered)
}
