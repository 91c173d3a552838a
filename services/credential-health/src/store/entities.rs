//! Credential health's tables.

pub mod credential {
    use sea_orm::entity::prelude::*;

    /// The outage policy's state of one credential, shared by every replica and changed
    /// only by compare-and-set on `version`.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "credentials")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub credential_id: String,
        pub version: i64,
        /// JSON array of the evidence held (`policy::Evidence`).
        pub evidence: String,
        pub cool_off_until_ms: i64,
        pub open_incident_id: Option<String>,
        pub quarantine_until_ms: i64,
        pub last_seen_ms: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod incident {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "incidents")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub credential_id: String,
        /// `open` or `closed`; an open row whose cool-off passed is reported closed.
        pub state: String,
        /// JSON array of run ids.
        pub opening_run_ids: String,
        pub failures_during_cool_off: i32,
        /// JSON array of the leads told, each `<org_id>/<lead_id>`.
        pub notified_lead_ids: String,
        pub opened_at_ms: i64,
        pub cool_off_ends_at_ms: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod turn_failure {
    use sea_orm::entity::prelude::*;

    /// One reported turn, classified once; a replay gets `answer` back.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "turn_failures")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub turn_id: String,
        pub run_id: String,
        pub credential_id: String,
        pub request_digest: String,
        /// `backend_error`, `backend_exhausted` or `other`.
        pub outcome: String,
        pub incident_id: Option<String>,
        /// The ReportTurnFailureResponse, protobuf-encoded.
        pub answer: Vec<u8>,
        pub created_at_ms: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod notice {
    use sea_orm::entity::prelude::*;

    /// A notice for a lead of an org. A lead is (org, lead id): the same lead id in two
    /// orgs is two leads. `seq` counts the lead's notices, allocated from the lead's
    /// `counters` row inside the creating transaction, so a lead's notices commit in
    /// `seq` order and a watcher following `seq > cursor` never skips one that commits
    /// late; notices to different leads do not wait on each other.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "notices")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub org_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub lead_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub seq: i64,
        pub id: String,
        /// `incident_opened` or `credential_quarantined`.
        pub kind: String,
        pub credential_id: String,
        pub incident_id: String,
        /// JSON array of run ids.
        pub affected_run_ids: String,
        pub message: String,
        pub cooling_off_for_seconds: i32,
        pub quarantined_for_seconds: i32,
        pub created_at_ms: i64,
        /// Retention removed its body; kept so a watcher behind it is told of the gap.
        pub pruned: bool,
        /// JSON array of the orgs the penalty is for; empty (or '') for every org.
        pub affected_orgs: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod counter {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "counters")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub name: String,
        pub value: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
