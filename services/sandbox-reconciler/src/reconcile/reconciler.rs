//! The reconciler: what every step of a round works with, and the tick's numbers.

use std::sync::Arc;
use std::time::Duration;

use runplane_sandbox::Driver;

use crate::store::Store;

/// The tick's numbers.
#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// How long a loss must last before the run is failed (default 90 s).
    pub loss_grace: Duration,
    /// Probes in flight at once.
    pub probe_concurrency: usize,
    /// Rows read per batch.
    pub batch: u64,
    /// Idle time after which a node agent suspends a sandbox; zero for never.
    pub idle_timeout: Duration,
    /// Whether queued runs get sandboxes.
    pub dispatch: bool,
    /// Whether a run may get a local sandbox when no node agent is ready.
    pub local_sandboxes: bool,
    /// What each profile's sandboxes get that differs from the deployment's.
    pub profiles: crate::domain::placement::ProfileSandboxes,
    /// How long deleted sandboxes, settled wakes and delivered outbox rows are kept.
    pub retention: Duration,
}

impl Default for ReconcileSettings {
    fn default() -> Self {
        Self {
            loss_grace: Duration::from_secs(90),
            probe_concurrency: 32,
            batch: 500,
            idle_timeout: Duration::ZERO,
            dispatch: true,
            local_sandboxes: true,
            profiles: Default::default(),
            retention: Duration::from_secs(86_400),
        }
    }
}

/// What one tick did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TickReport {
    pub probed: u64,
    pub stamped: u64,
    pub cleared: u64,
    /// Losses this tick confirmed (it won the compare-and-set and queued the FailRun).
    pub confirmed: u64,
    /// Writes whose compare-and-set found the row changed since it was read.
    pub lost_races: u64,
    /// When the first loss still waiting out its grace is due (store microseconds);
    /// `None`: none waits. The loop runs a round then, not up to a tick later.
    pub next_loss_due_us: Option<i64>,
}

#[derive(Clone)]
pub struct Reconciler {
    pub(super) store: Store,
    pub(super) driver: Arc<dyn Driver>,
    pub(super) settings: ReconcileSettings,
    /// Credential health, for the fleet's capacity; `None` where none runs.
    pub(super) fleet: Option<crate::clients::FleetClient>,
    /// The stream recovery coordinator, to park and unpark the streams of the local
    /// sandboxes it suspends for a pause; `None`: nothing to park.
    pub(super) recovery: Option<crate::clients::RecoveryClient>,
    /// When this replica last pruned (`Store::prune`), in store microseconds.
    pub(super) pruned_at_us: Arc<std::sync::atomic::AtomicI64>,
    /// What this replica last told the run store of each local sandbox's agent waiting
    /// for input: (generation, waiting).
    pub(super) waiting: Arc<std::sync::Mutex<std::collections::HashMap<String, (i64, bool)>>>,
    /// When the first run waiting out its retry backoff may be placed, as this replica's
    /// last dispatch saw (store microseconds; 0: none waits).
    pub(super) retry_due_us: Arc<std::sync::atomic::AtomicI64>,
    /// When the first loss waiting out its grace is due, as this replica's last tick saw
    /// (store microseconds; 0: none waits).
    pub(super) loss_due_us: Arc<std::sync::atomic::AtomicI64>,
}

impl Reconciler {
    pub fn new(store: Store, driver: Arc<dyn Driver>, settings: ReconcileSettings) -> Self {
        Self {
            store,
            driver,
            settings,
            fleet: None,
            recovery: None,
            pruned_at_us: Arc::default(),
            waiting: Arc::default(),
            retry_due_us: Arc::default(),
            loss_due_us: Arc::default(),
        }
    }

    /// Dispatch fills credentials only up to the capacity credential health reports.
    pub fn with_fleet(mut self, fleet: Option<crate::clients::FleetClient>) -> Self {
        self.fleet = fleet;
        self
    }

    /// Streams of the local sandboxes a pause suspends are parked at this coordinator.
    pub fn with_recovery(mut self, recovery: Option<crate::clients::RecoveryClient>) -> Self {
        self.recovery = recovery;
        self
    }
}
