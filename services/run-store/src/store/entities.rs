//! sea-orm entities of the run store's tables.
//!
//! Times are stored as microseconds since the Unix epoch (`*_at_us`): one integer type on
//! both backends, exact equality for compare-and-set, no time-zone conversions.

pub mod run {
    use sea_orm::entity::prelude::*;

    pub use crate::domain::state::RunState;
    pub use crate::domain::verdict::{Verdict, VerdictOutcome};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "runs")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub org_id: String,
        pub lead_id: String,
        pub client_request_id: String,
        /// SHA-256 (hex) of the CreateRun body, to refuse a reused id with another body.
        pub request_digest: String,
        pub state: RunState,
        pub credential_id: String,
        pub profile: String,
        pub command: String,
        /// JSON array of strings.
        pub args: String,
        /// JSON object of string to string.
        pub labels: String,
        pub sandbox_generation: i64,
        pub last_sequence: i64,
        pub chain_head: Vec<u8>,
        /// Per-run counter of steering messages, so their order is the enqueue order.
        pub steering_sequence: i64,
        pub verdict_outcome: Option<VerdictOutcome>,
        pub verdict_reason: Option<String>,
        pub verdict_exit_code: Option<i32>,
        pub verdict_signal: Option<i32>,
        pub verdict_message: Option<String>,
        pub failure_tail: Option<String>,
        /// JSON of the durable backend-error outcome, when the run died on one.
        pub backend_error: Option<String>,
        /// W3C traceparent of the creating call (see `Run.traceparent`).
        pub traceparent: String,
        /// The sandbox of the highest issued key ('' before any): FailRun's guard.
        pub sandbox_id: String,
        /// When the run fails with deadline_exceeded unless it ended first; NULL for none.
        pub deadline_at_us: Option<i64>,
        /// Why a queued run has not started ('' when not waiting).
        pub waiting_reason: String,
        /// Its priority among its org's queued runs on its credential (0–9, higher first).
        pub priority: i32,
        /// Its events up to this sequence were deleted by retention (0: none).
        pub events_pruned_through: i64,
        /// Bytes of event text, data and names stored for it (see `max_event_bytes_per_run`).
        pub event_bytes: i64,
        /// Since when its agent has been seen parked, waiting for input (0: working, or
        /// not known), as of the newest observation (`waiting_generation`, `waiting_seq`).
        pub waiting_since_us: i64,
        pub waiting_generation: i64,
        pub waiting_seq: i64,
        /// Since when it has been paused (PauseRun); 0: not paused.
        pub paused_at_us: i64,
        /// When its pause ends it `paused_too_long` (the pause plus its profile's
        /// `max_pause_seconds`); 0 while it is not paused.
        pub pause_ends_at_us: i64,
        /// 1 when its profile says paused time does not count toward its deadline: while
        /// paused the deadline sweep leaves it alone, and ResumeRun moves the deadline on
        /// by the pause's length.
        pub pause_holds_deadline: i64,
        /// How many of its attempts ended and were followed by another: it is on attempt
        /// `retries + 1`.
        pub retries: i64,
        /// When a run waiting to retry may start its next attempt (its backoff); 0 when
        /// it is not waiting.
        pub retry_at_us: i64,
        pub created_at_us: i64,
        pub started_at_us: Option<i64>,
        pub ended_at_us: Option<i64>,
        pub updated_at_us: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}

    impl Model {
        /// The verdict recorded on this run; `None` before it has one.
        pub fn verdict(&self) -> Option<Verdict> {
            Some(Verdict {
                outcome: self.verdict_outcome?,
                reason: self.verdict_reason.clone().unwrap_or_default(),
                exit_code: self.verdict_exit_code,
                signal: self.verdict_signal,
                message: self.verdict_message.clone().unwrap_or_default(),
            })
        }
    }
}

pub mod run_key {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "run_keys")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub key_id: String,
        pub run_id: String,
        pub org_id: String,
        /// SHA-256 (hex) of the secret; the secret itself is never stored.
        #[sea_orm(unique)]
        pub key_hash: String,
        pub sandbox_id: String,
        pub sandbox_generation: i64,
        pub idempotency_key: String,
        pub created_at_us: i64,
        /// `superseded` (a newer generation or a re-issue) or `terminal` (the run ended).
        pub revoked_reason: Option<String>,
        pub revoked_at_us: Option<i64>,
        pub hello_nonce: Option<String>,
        pub hello_at_us: Option<i64>,
        /// The attempt it was issued for (0 before attempts were recorded: the first).
        pub attempt: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod event {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "events")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub sequence: i64,
        pub kind: i32,
        pub text: String,
        /// Canonical JSON of the event's structured data, or empty.
        pub data: String,
        pub is_check: bool,
        pub name: String,
        pub observed_at_us: Option<i64>,
        pub recorded_at_us: i64,
        pub digest: Vec<u8>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod event_batch {
    use sea_orm::entity::prelude::*;

    /// One row per appended batch: the dedupe record that makes AppendEvents replay-safe.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "event_batches")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub batch_key: String,
        /// SHA-256 (hex) of the batch's events, to refuse a reused key with other events.
        pub batch_digest: String,
        pub first_sequence: i64,
        pub last_sequence: i64,
        pub chain_head: Vec<u8>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod steering_message {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "steering_messages")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: String,
        pub run_id: String,
        pub org_id: String,
        pub sequence: i64,
        pub kind: i32,
        /// The payload message, protobuf-encoded.
        pub payload: Vec<u8>,
        pub idempotency_key: String,
        pub enqueued_at_us: i64,
        /// Set by the acknowledgement, never by a poll.
        pub acked_at_us: Option<i64>,
        /// `applied` or `dropped_undeliverable`.
        pub ack_outcome: Option<String>,
        pub ack_attempts: Option<i32>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod receipt {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "receipts")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        pub signed_payload: Vec<u8>,
        pub signature: Vec<u8>,
        pub key_id: String,
        pub sealed_at_us: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod keyed_answer {
    use sea_orm::entity::prelude::*;

    /// The stored answer of a keyed call whose effect is not itself a row to find again
    /// (FailRun, MarkBackendError): a replay with the same key gets these bytes back.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "keyed_answers")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub method: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub idempotency_key: String,
        /// SHA-256 (hex) of the request, to refuse a reused key with another request.
        pub request_digest: String,
        pub answer: Vec<u8>,
        pub created_at_us: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod org_share {
    use sea_orm::entity::prelude::*;

    /// An org's pass on a credential: how far its starts there have taken it, in units
    /// of a start over its weight. The row whose org is empty holds the credential's
    /// virtual time, the pass of its latest start (see `store::slots`).
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "org_shares")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub credential_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub org_id: String,
        pub pass: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod run_label {
    use sea_orm::entity::prelude::*;

    /// One label of a run, a row per key, so a label selector reads the `(key, value)`
    /// index instead of every run's labels (`runs.labels` keeps the map as given).
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "run_labels")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub key: String,
        pub value: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod run_attempt {
    use sea_orm::entity::prelude::*;

    /// One attempt of a run: the sandbox its key was issued for, and how it ended.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "run_attempts")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub number: i64,
        pub sandbox_id: String,
        pub node_id: String,
        pub started_at_us: i64,
        /// 0 while it runs.
        pub ended_at_us: i64,
        pub end_reason: String,
        pub end_message: String,
        /// A verdict its runner sent after it had ended, refused and kept here.
        pub superseded_verdict: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
