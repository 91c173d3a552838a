//! runplane's metrics: one place names every instrument, so dashboards
//! (`deploy/compose/grafana/dashboards`) and code cannot drift apart.
//!
//! Instruments come from the global meter `runplane`, exported over OTLP when
//! [`crate::init`] found an endpoint, no-ops otherwise. Attributes are low-cardinality by
//! design (a state, a reason, a method): ids belong on spans, not on metrics.

use std::sync::OnceLock;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};

fn meter() -> Meter {
    opentelemetry::global::meter("runplane")
}

macro_rules! counter {
    ($(#[$doc:meta])* $fn:ident, $name:literal, $description:literal) => {
        $(#[$doc])*
        pub fn $fn() -> &'static Counter<u64> {
            static INSTRUMENT: OnceLock<Counter<u64>> = OnceLock::new();
            INSTRUMENT.get_or_init(|| meter().u64_counter($name).with_description($description).build())
        }
    };
}

macro_rules! seconds {
    ($(#[$doc:meta])* $fn:ident, $name:literal, $description:literal) => {
        $(#[$doc])*
        pub fn $fn() -> &'static Histogram<f64> {
            static INSTRUMENT: OnceLock<Histogram<f64>> = OnceLock::new();
            INSTRUMENT.get_or_init(|| {
                meter()
                    .f64_histogram($name)
                    .with_unit("s")
                    .with_description($description)
                    .build()
            })
        }
    };
}

counter!(
    /// Runs created (not replays of a create).
    runs_created, "runplane.runs.created", "Runs created");
counter!(
    /// Runs that became terminal, by `state`.
    runs_finished, "runplane.runs.finished", "Runs that reached a terminal state, by state");
counter!(
    /// Attempts of runs that ended and were followed by another, by `reason` (what ended
    /// them: runner_exited, sandbox_lost, …).
    runs_attempts, "runplane.runs.attempts", "Run attempts that ended and were retried, by reason");
counter!(
    /// Events appended (replays of a batch not counted).
    events_appended, "runplane.events.appended", "Run events appended");
counter!(
    /// Steering acknowledgements, by `outcome` (applied, dropped).
    steering_acks, "runplane.steering.acks", "Steering acknowledgements, by outcome");
counter!(
    /// Transport retries, by `method` and `classification`.
    transport_retries, "runplane.transport.retries", "Retries by the runner transport, by classification");
seconds!(
    /// Outage budget a call spent before it succeeded or gave up, by `method`.
    outage_budget_spent, "runplane.transport.outage_budget_spent", "Outage budget spent by a call that retried");
seconds!(
    /// Duration of one reconcile tick.
    reconcile_tick_duration, "runplane.reconcile.tick.duration", "Duration of a reconcile tick");
counter!(
    /// Sandboxes newly stamped lost by a tick.
    reconcile_loss_stamps, "runplane.reconcile.loss_stamps", "Sandboxes stamped lost");
counter!(
    /// Stream-recovery claims, by `result` (claimed, lease_held, wait, exhausted).
    recovery_claims, "runplane.recovery.claims", "Stream recovery claims, by result");
counter!(
    /// Runs whose stream recovery budget ran out.
    recovery_exhaustions, "runplane.recovery.exhaustions", "Runs ended by an exhausted recovery budget");
counter!(
    /// Runs the orphan sweep settled, by `action` (keys_deleted, run_ended, takeover_planned).
    recovery_sweep_settled, "runplane.recovery.sweep.settled", "Runs settled by the orphan sweep, by action");
counter!(
    /// Outage incidents opened (each starts a cool-off).
    credential_incidents, "runplane.credentials.incidents", "Backend outage incidents opened (cool-offs started)");
counter!(
    /// Credentials newly quarantined as exhausted.
    credential_quarantines, "runplane.credentials.quarantines", "Credentials quarantined as exhausted");
counter!(
    /// Admission refusals, by `reason` (COOLING_OFF, EXHAUSTED).
    admission_refusals, "runplane.admission.refusals", "Runs refused by admission, by reason");

/// One attribute, for the call sites' brevity.
pub fn attr(key: &'static str, value: impl Into<opentelemetry::Value>) -> KeyValue {
    KeyValue::new(key, value)
}

/// Every instrument name, for checks that dashboards only use what exists.
pub const NAMES: &[&str] = &[
    "runplane.runs.created",
    "runplane.runs.finished",
    "runplane.runs.attempts",
    "runplane.events.appended",
    "runplane.steering.acks",
    "runplane.transport.retries",
    "runplane.transport.outage_budget_spent",
    "runplane.reconcile.tick.duration",
    "runplane.reconcile.loss_stamps",
    "runplane.recovery.claims",
    "runplane.recovery.exhaustions",
    "runplane.credentials.incidents",
    "runplane.credentials.quarantines",
    "runplane.admission.refusals",
];
