//! The configs tests and benches start services with: the default config with the
//! tokens they authenticate with, and a run store on a test database.
//!
//! Each returns a plain [`Config`]; a test sets what else it is about on it.

use runplane_config::{Config, Secret};

use crate::SERVICE_TOKEN;

/// The default config, with `operator_token` for operators and [`SERVICE_TOKEN`] for the
/// services calling each other.
pub fn with_operator(operator_token: &str) -> Config {
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(operator_token);
    config.auth.service_token = Secret::new(SERVICE_TOKEN);
    config
}

/// [`with_operator`] with a run store on `database_url` signing receipts with the hex
/// `receipt_seed`, creating runs without asking credential health (tests of a run store
/// are not about admission: a run goes to the credential it names).
pub fn run_store_signing_with(
    operator_token: &str,
    database_url: &str,
    receipt_seed: &str,
) -> Config {
    let mut config = with_operator(operator_token);
    config.run_store.database_url = database_url.to_owned();
    config.run_store.receipt_signing_key = Secret::new(receipt_seed);
    config.run_store.admission = false;
    config
}

/// [`run_store_signing_with`] a fresh receipt key.
#[cfg(feature = "run-store")]
pub fn run_store(operator_token: &str, database_url: &str) -> Config {
    run_store_signing_with(operator_token, database_url, &fresh_receipt_seed())
}

/// A new receipt signing key, as `run_store.receipt_signing_key` takes it (hex).
#[cfg(feature = "run-store")]
pub fn fresh_receipt_seed() -> String {
    runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex()
}
