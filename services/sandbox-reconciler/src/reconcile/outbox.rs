//! Delivery of the FailRun calls the tick owes the run store, from the transactional
//! outbox.

use prost::Message;
use runplane_proto::runstore::v1 as runstore_pb;
use tracing::Instrument;

use crate::clients::RunStoreClient;
use crate::error::ReconcilerError;
use crate::store::Store;

/// Delivers due outbox rows; each stays until the callee answers.
pub async fn deliver_outbox(
    store: &Store,
    client: &RunStoreClient,
    limit: u64,
) -> Result<u64, ReconcilerError> {
    use runplane_db::outbox::{Delivery, deliver_due};
    let delivered = deliver_due(store.database(), || store.now_us(), limit, |row| {
        let mut client = client.clone();
        async move {
            let Ok(request) = runstore_pb::FailRunRequest::decode(row.payload.as_slice()) else {
                return Delivery::Refused("undecodable payload".into());
            };
            // The delivery continues the trace of the decision that owed it.
            let span = runplane_grpc::trace_context::outbox_span(
                &row.kind,
                &row.idempotency_key,
                &row.traceparent,
            );
            match client.fail_run(request).instrument(span).await {
                Ok(answer) => {
                    tracing::info!(key = %row.idempotency_key, outcome = ?answer.into_inner().outcome(), "fail run delivered");
                    Delivery::Delivered
                }
                Err(status) => Delivery::from_failure(status.code() as i32, status.message()),
            }
        }
    })
    .await?;
    Ok(delivered)
}
