//! ListWebhooks: the configured endpoints and their deliveries, never their secrets.

use runplane_proto::runstore::v1 as runstore_pb;

use super::service_state::ServiceState;
use crate::error::RunStoreError;

pub(super) async fn list(
    state: &ServiceState,
) -> Result<runstore_pb::ListWebhooksResponse, RunStoreError> {
    let endpoints = state
        .webhooks
        .stats(&state.store)
        .await?
        .into_iter()
        .map(|(endpoint, stats)| runstore_pb::WebhookEndpoint {
            id: endpoint.id.clone(),
            url: endpoint.url.clone(),
            events: endpoint.events.clone(),
            orgs: endpoint.orgs.clone(),
            pending: stats.pending,
            delivered: stats.delivered,
            failed: stats.given_up,
            last_delivered_at: stats.last_delivered_at_us.map(runplane_clock::to_timestamp),
            last_failed_at: stats.last_failed_at_us.map(runplane_clock::to_timestamp),
            last_error: stats.last_error,
        })
        .collect();
    Ok(runstore_pb::ListWebhooksResponse { endpoints })
}
