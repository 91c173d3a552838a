//! Credential health's persistence: Postgres (or SQLite for `runplane dev`).
//!
//! What we persist and why, by file:
//! - `credentials.rs`: each credential's outage-policy state, changed only by
//!   compare-and-set on `version`, so replicas sharing the database agree;
//! - `incidents.rs`: every outage incident, open or closed;
//! - `turn_failures.rs`: each reported turn, classified once, with the answer a replay
//!   gets; recording one is the transaction that also changes the credential's state and
//!   writes the incident, notices and outbox row that follow from it;
//! - `notices.rs` (`notices` and `counters`): lead notices in commit order, per (org,
//!   lead) (see `entities::notice`);
//! - `outbox.rs`: the MarkBackendError calls owed to the run store.

mod credentials;
pub mod entities;
pub mod incidents;
mod migration;
pub mod notices;
pub mod outbox;
pub mod turn_failures;

use runplane_clock::SharedClock;
use runplane_proto::credentials::v1 as credentials_pb;
use sea_orm::DatabaseConnection;

pub use migration::Migrator;

use crate::domain::policy::PolicyConfig;
use crate::error::CredentialHealthError;

type Result<T> = std::result::Result<T, CredentialHealthError>;

/// A classified turn failure to record.
#[derive(Debug, Clone)]
pub struct Report {
    pub turn_id: String,
    pub run_id: String,
    /// The run's org; its lead is told as a lead of this org.
    pub org_id: String,
    pub lead_id: String,
    pub credential_id: String,
    pub request_digest: String,
    pub outcome: credentials_pb::TurnOutcome,
    pub reason: String,
    /// Capacity of the credential (sum over its profiles), for the answer's health.
    pub capacity: u32,
    pub profiles: Vec<String>,
    /// The credential is shared by several orgs: the report penalises its org only,
    /// until another org's runs are penalised too ([`state_key`]).
    pub shared: bool,
}

/// The key of the policy state a failure of `org_id`'s run on `credential_id` moves: the
/// credential's own, or on a shared credential the org's share of it,
/// `<credential>@<org>` (names hold no `@`).
pub fn state_key(credential_id: &str, org_id: Option<&str>) -> String {
    match org_id {
        Some(org) => format!("{credential_id}@{org}"),
        None => credential_id.to_owned(),
    }
}

/// What a report changed, beyond its answer.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// Notices created (their leads' watchers should wake).
    pub notices: usize,
    /// The [`notices::notice_key`] of each lead that got one.
    pub notified_leads: Vec<String>,
    /// An outbox row for the run store was written.
    pub outbox: bool,
    /// This report opened an incident (a cool-off started).
    pub opened_incident: bool,
    /// This report quarantined the credential (it was not before).
    pub quarantined: bool,
}

#[derive(Debug, Clone)]
pub struct Store {
    db: DatabaseConnection,
    clock: SharedClock,
    policy: PolicyConfig,
}

impl Store {
    pub fn new(db: DatabaseConnection, clock: SharedClock, policy: PolicyConfig) -> Self {
        Self { db, clock, policy }
    }

    pub fn db(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn policy(&self) -> &PolicyConfig {
        &self.policy
    }

    /// Wall-clock milliseconds from the injected clock (see `policy` for why wall time).
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Wall-clock microseconds, for the outbox table every service shares.
    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }
}

/// Ids as the JSON array a text column keeps.
fn json(v: &[String]) -> String {
    serde_json::to_string(v).expect("serialisable")
}
