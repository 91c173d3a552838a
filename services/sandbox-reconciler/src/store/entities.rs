//! sea-orm entities of the reconciler's tables. Times are microseconds since the epoch.

pub mod sandbox {
    use sea_orm::entity::prelude::*;

    use crate::domain::sandbox::{SandboxPlacement, Substrate};
    pub use crate::domain::status::SandboxStatus;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "sandboxes")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub run_id: String,
        pub org_id: String,
        pub client_request_id: String,
        /// `kubernetes` or `direct`.
        pub substrate: String,
        pub status: SandboxStatus,
        /// The node the sandbox is placed on; NULL when unplaced.
        pub active_node_id: Option<String>,
        /// Bumped before any new execution; later writes compare-and-set on it.
        pub execution_generation: i64,
        /// First exited/lost observation not yet cleared.
        pub loss_observed_at_us: Option<i64>,
        pub idle_timeout_ms: i64,
        pub exit_code: Option<i32>,
        /// What the driver needs to find the sandbox again (a pid for `process`).
        pub driver_handle: String,
        /// The newest node observation applied; older ones are ignored.
        pub observation_seq: i64,
        /// What the node last reported (`started`, `suspended`, `exited`, …). An exit is
        /// only an observation: the loss grace decides what it means for the run.
        pub observed_status: String,
        pub created_at_us: i64,
        pub updated_at_us: i64,
        /// W3C traceparent of the run's trace: the launch, the runner and a FailRun for
        /// this sandbox continue it. Empty when untraced.
        pub traceparent: String,
        /// `none`: its agent has no network (its run's profile says `network = "none"`).
        /// Empty: the deployment's `sandbox_reconciler.network`.
        pub network: String,
        /// The limits its run's profile sets ([`crate::domain::sandbox::encode_limits`]);
        /// empty: the deployment's.
        pub limits: String,
        /// The image its run's profile names for the container driver; empty: the
        /// deployment's `sandbox_reconciler.container.image`.
        pub image: String,
        /// Its run's pause, as the run store last said ([`PAUSED`], [`RESUME_OWED`], 0:
        /// neither): while paused it is held suspended (a node is handed a SUSPEND, a
        /// local one is suspended here) and its wakes wait; once resumed, its restore is
        /// owed until it runs again (which an idle suspend, 0, never asks for).
        pub paused: i64,
        /// The attempt of its run it was made for (1, 2, …; 0 for rows made before
        /// attempts: the first). A sandbox of an attempt its run has moved past is
        /// deleted like one of an ended run.
        pub attempt: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}

    /// [`Model::paused`]: its run is paused.
    pub const PAUSED: i64 = 1;
    /// [`Model::paused`]: its run was resumed and it is not running again yet.
    pub const RESUME_OWED: i64 = 2;

    impl Model {
        /// Whether its run is paused.
        pub fn is_paused(&self) -> bool {
            self.paused == PAUSED
        }

        /// Whether its run was resumed and its restore is still owed.
        pub fn resume_owed(&self) -> bool {
            self.paused == RESUME_OWED
        }

        /// What a node or probe last reported; `None` before anything was.
        pub fn observed(&self) -> Option<SandboxStatus> {
            self.observed_status.parse().ok()
        }

        /// What placement and wakes read of this sandbox.
        pub fn placement(&self) -> SandboxPlacement<'_> {
            SandboxPlacement {
                id: &self.id,
                substrate: Substrate::named(&self.substrate),
                active_node_id: self.active_node_id.as_deref(),
                execution_generation: self.execution_generation,
                observed: self.observed(),
            }
        }
    }

    impl From<&Model> for runplane_sandbox::SandboxSpec {
        fn from(row: &Model) -> Self {
            Self {
                id: row.id.clone(),
                run_id: row.run_id.clone(),
                execution_generation: row.execution_generation,
                driver_handle: row.driver_handle.clone(),
                offline: row.network == crate::domain::sandbox::NO_NETWORK,
                limits: crate::domain::sandbox::decode_limits(&row.limits),
                image: Some(row.image.clone()).filter(|image| !image.is_empty()),
                active_node_id: row.active_node_id.clone(),
                idle_timeout_ms: row.idle_timeout_ms,
            }
        }
    }
}

pub mod route_identity {
    use sea_orm::entity::prelude::*;

    /// The direct substrate's route identity. Read only while `active_node_id` is set.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "route_identities")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub sandbox_id: String,
        pub current_node_id: String,
        pub execution_generation: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}

    impl Model {
        /// This route identity as placement and wakes read it.
        pub fn identity(&self) -> crate::domain::sandbox::RouteIdentity<'_> {
            crate::domain::sandbox::RouteIdentity {
                sandbox_id: &self.sandbox_id,
                execution_generation: self.execution_generation,
                current_node_id: &self.current_node_id,
            }
        }
    }
}

pub mod node {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "nodes")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        /// `host:port` where sessions reach the node.
        pub endpoint: String,
        pub capacity: i32,
        pub last_heartbeat_us: i64,
        /// The agent process that registered; a new one bumps the epoch.
        pub boot_id: String,
        /// Fences calls from a previous boot of the node.
        pub epoch: i64,
        /// Sandbox slots in use, as the node last reported.
        pub used: i32,
        pub registered_at_us: i64,
        /// When the node was fenced (its credentials all revoked), 0 while it is not: a
        /// fenced node gets no placement until it registers again with a new credential.
        pub fenced_at_us: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

impl node::Model {
    /// Fenced: its credentials were all revoked, and it has not registered since.
    pub fn is_fenced(&self) -> bool {
        self.fenced_at_us != 0
    }
}

pub mod wake {
    use sea_orm::entity::prelude::*;

    /// At most one open wake per sandbox (a partial unique index on open rows).
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "wakes")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub sandbox_id: String,
        /// `pending`, `assigned`, `restored` or `failed`.
        pub state: String,
        pub node_id: Option<String>,
        pub attempts: i32,
        pub last_error: String,
        pub reason: String,
        pub requested_at_us: i64,
        /// NULL while the wake is open.
        pub settled_at_us: Option<i64>,
        /// Not handed to a node before this (a failed restore's backoff); NULL: at once.
        pub not_before_us: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod node_credential {
    use sea_orm::entity::prelude::*;

    /// A node agent's own bearer credential: it acts for `node_id` only. The secret is
    /// kept as its SHA-256 (hex), never in clear.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "node_credentials")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub node_id: String,
        /// Lower-case hex of the secret's SHA-256; unique.
        pub token_sha256: String,
        pub created_at_us: i64,
        /// The most capacity the node may register with (0: no ceiling of its own).
        pub max_capacity: i64,
        /// NULL while live.
        pub revoked_at_us: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Calls to other services decided in a transaction here: the shared outbox table.
pub use runplane_db::outbox::entity as outbox;
