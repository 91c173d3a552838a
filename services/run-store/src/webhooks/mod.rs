//! Lifecycle webhook delivery: every configured endpoint has its own loop, which claims
//! that endpoint's due deliveries (at most `max_in_flight` at once), POSTs each signed as
//! Standard Webhooks sign, and books the outcome. A slow or dead endpoint therefore holds
//! only its own deliveries; runs never wait on any of them (the deliveries were written
//! with the runs' changes, and are sent from here).

mod http;

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use runplane_config::{WebhookConfig, WebhookDeliveryConfig, WebhookTarget, webhook_secret_key};
use tracing::Instrument;

use crate::domain::webhook::{self, Routes};
use crate::error::RunStoreError;
use crate::store::Store;
use crate::store::webhooks::{Attempt, Delivery, EndpointStats};

/// How often an endpoint with nothing due looks again.
const IDLE: Duration = Duration::from_millis(250);

/// How often settled deliveries are pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// One configured endpoint, ready to send to.
pub struct Endpoint {
    pub id: String,
    /// The URL as shown: its query, which may carry a token, left out.
    pub url: String,
    pub events: Vec<String>,
    pub orgs: Vec<String>,
    target: WebhookTarget,
    key: Vec<u8>,
    allow_private: bool,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.id)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// The configured endpoints and how they are delivered to.
#[derive(Debug, Clone, Default)]
pub struct Webhooks {
    endpoints: Vec<Arc<Endpoint>>,
    settings: WebhookDeliveryConfig,
}

impl Webhooks {
    /// From `[[run_store.webhooks]]` (already validated by the config); an `https://`
    /// endpoint whose CAs cannot be read stops the run store at start, naming it.
    pub fn from_config(
        webhooks: &[WebhookConfig],
        settings: &WebhookDeliveryConfig,
    ) -> Result<Self, RunStoreError> {
        let mut endpoints = Vec::new();
        for (i, w) in webhooks.iter().enumerate() {
            let field = |name: &str| format!("run_store.webhooks[{i}].{name}");
            let invalid = |name: &str, reason: String| RunStoreError::InvalidField {
                field: field(name),
                reason,
            };
            let target = WebhookTarget::parse(&w.url).map_err(|r| invalid("url", r))?;
            let key =
                webhook_secret_key(w.secret.expose()).map_err(|r| invalid("secret", r.into()))?;
            let tls = if target.https {
                let ca_file = if w.ca_file.is_empty() {
                    http::SYSTEM_CA_FILE
                } else {
                    w.ca_file.as_str()
                };
                Some(http::tls_connector(ca_file).map_err(|r| invalid("ca_file", r))?)
            } else {
                None
            };
            endpoints.push(Arc::new(Endpoint {
                id: webhook::endpoint_id(&w.url),
                url: w.url.split('?').next().unwrap_or_default().to_owned(),
                events: w.events.clone(),
                orgs: w.orgs.clone(),
                target,
                key,
                allow_private: w.allow_private_targets,
                tls,
            }));
        }
        Ok(Self {
            endpoints,
            settings: settings.clone(),
        })
    }

    /// The routes the store owes events by: each endpoint's id and filters.
    pub fn routes(&self) -> Routes {
        Routes(
            self.endpoints
                .iter()
                .map(|e| crate::domain::webhook::Route {
                    endpoint_id: e.id.clone(),
                    events: e.events.iter().cloned().collect(),
                    orgs: e.orgs.iter().cloned().collect(),
                })
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    pub fn endpoints(&self) -> &[Arc<Endpoint>] {
        &self.endpoints
    }

    /// Every endpoint's loop, and the pruning of settled deliveries, until cancelled.
    pub async fn run(&self, store: &Store) {
        let loops = self.endpoints.iter().map(|endpoint| async move {
            loop {
                match self.deliver_once(store, endpoint).await {
                    Ok(0) => tokio::time::sleep(IDLE).await,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(endpoint = %endpoint.id, error = %e, "webhook delivery round failed; retrying");
                        tokio::time::sleep(IDLE).await;
                    }
                }
            }
        });
        let prune = async {
            let keep: Vec<&str> = self.endpoints.iter().map(|e| e.id.as_str()).collect();
            let window_us = i64::from(self.settings.give_up_after_seconds) * 1_000_000;
            loop {
                tokio::time::sleep(PRUNE_EVERY).await;
                let before = store.now_us() - window_us;
                while let Ok(n) = store.prune_webhooks(&keep, before, 500).await {
                    if n < 500 {
                        break;
                    }
                }
            }
        };
        tokio::join!(join_all(loops), prune);
    }

    /// Claims `endpoint`'s due deliveries (at most `max_in_flight`), sends them at once
    /// and books each outcome; returns how many were attempted.
    pub async fn deliver_once(
        &self,
        store: &Store,
        endpoint: &Endpoint,
    ) -> Result<u64, RunStoreError> {
        let timeout = Duration::from_millis(self.settings.timeout_ms.into());
        // A claim outlives any attempt of this replica three times over; a replica that
        // died mid-attempt has its deliveries due again after it.
        let claim_for_us = 3 * timeout.as_micros() as i64;
        let rows = store
            .claim_webhooks(
                &endpoint.id,
                self.settings.max_in_flight.into(),
                claim_for_us,
            )
            .await?;
        let attempted = rows.len() as u64;
        let booked = join_all(rows.into_iter().map(|row| async move {
            let attempt = self.attempt(endpoint, &row, timeout, store.now_us()).await;
            let retry_after = webhook::backoff(
                row.attempts,
                Duration::from_secs(self.settings.max_backoff_seconds.into()),
            );
            let give_up_at =
                row.created_at_us + i64::from(self.settings.give_up_after_seconds) * 1_000_000;
            store
                .book_webhook(&row, &attempt, retry_after.as_micros() as i64, give_up_at)
                .await
        }))
        .await;
        for result in booked {
            result?;
        }
        Ok(attempted)
    }

    async fn attempt(
        &self,
        endpoint: &Endpoint,
        row: &Delivery,
        timeout: Duration,
        now_us: i64,
    ) -> Attempt {
        let span = tracing::info_span!(
            "webhook.deliver",
            endpoint = %endpoint.id,
            webhook_id = %row.id,
            event = %row.event_type,
            run_id = %row.run_id,
            attempt = row.attempts + 1,
        );
        async {
            // Unix seconds of the attempt, which receivers compare with their own clock.
            let timestamp = now_us.div_euclid(1_000_000);
            let headers = [
                ("webhook-id", row.id.clone()),
                ("webhook-timestamp", timestamp.to_string()),
                (
                    "webhook-signature",
                    webhook::signature(&endpoint.key, &row.id, timestamp, &row.body),
                ),
            ];
            let answer = http::send(http::Post {
                target: &endpoint.target,
                tls: endpoint.tls.as_ref(),
                allow_private: endpoint.allow_private,
                headers: &headers,
                body: &row.body,
                timeout,
            })
            .await;
            match answer {
                http::Answer::Status(status) if (200..300).contains(&status) => {
                    tracing::debug!(status, "webhook delivered");
                    Attempt::Delivered { status }
                }
                http::Answer::Status(status) => {
                    tracing::warn!(status, url = %endpoint.url, "webhook refused; it is retried");
                    Attempt::Failed {
                        status: Some(status),
                        error: format!("the endpoint answered {status}"),
                    }
                }
                http::Answer::Error(error) => {
                    tracing::warn!(error = %error, url = %endpoint.url, "webhook not delivered; it is retried");
                    Attempt::Failed { status: None, error }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// What `runplane webhooks` shows of each endpoint.
    pub async fn stats(
        &self,
        store: &Store,
    ) -> Result<Vec<(Arc<Endpoint>, EndpointStats)>, RunStoreError> {
        let mut out = Vec::new();
        for endpoint in &self.endpoints {
            out.push((endpoint.clone(), store.webhook_stats(&endpoint.id).await?));
        }
        Ok(out)
    }
}
