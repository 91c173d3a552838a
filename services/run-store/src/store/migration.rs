//! The run store's schema, created by sea-orm-migration at start.

use sea_orm_migration::prelude::*;

/// Applies the run store's migrations, oldest first, at every start.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(CreateRunStore),
            Box::new(CreateOutbox),
            // The trace a run's life continues (`runs.traceparent`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0003_run_traceparent",
                table: "runs",
                column: "traceparent",
            }),
            // The sandbox FailRun's guard names (`runs.sandbox_id`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0004_run_sandbox_id",
                table: "runs",
                column: "sandbox_id",
            }),
            Box::new(AddDeadline),
            // Why a queued run waits (`runs.waiting_reason`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0006_run_waiting_reason",
                table: "runs",
                column: "waiting_reason",
            }),
            Box::new(AddFairShare),
            Box::new(AddRetention),
            // A run's stored event bytes (`runs.event_bytes`: text, data and names), which
            // `run_store.max_event_bytes_per_run` bounds.
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0009_event_bytes",
                table: "runs",
                column: "event_bytes",
            }),
            Box::new(AddQueuedIndex),
            Box::new(AddRunLabels),
            Box::new(AddWebhookDeliveries),
            // Whether a run's agent waits for input, as the newest observation said
            // (`Store::report_waiting`).
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0013_waiting_since",
                table: "runs",
                column: "waiting_since_us",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0014_waiting_generation",
                table: "runs",
                column: "waiting_generation",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0015_waiting_seq",
                table: "runs",
                column: "waiting_seq",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0016_paused_at",
                table: "runs",
                column: "paused_at_us",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0017_pause_holds_deadline",
                table: "runs",
                column: "pause_holds_deadline",
            }),
            Box::new(AddPauseEnd),
            // Attempts: how many of a run's attempts were retried (`runs.retries`), when
            // its next may start (`runs.retry_at_us`), the attempt a key is for, and one
            // row per attempt (`run_attempts`).
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0019_run_retries",
                table: "runs",
                column: "retries",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0020_run_retry_at",
                table: "runs",
                column: "retry_at_us",
            }),
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0021_key_attempt",
                table: "run_keys",
                column: "attempt",
            }),
            Box::new(AddRunAttempts),
        ]
    }
}

/// A run's deadline (`runs.deadline_at_us`, NULL for none), indexed so the deadline
/// sweep's one query per round reads only the runs that are due.
struct AddDeadline;

impl MigrationName for AddDeadline {
    fn name(&self) -> &str {
        "m0005_run_deadline"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddDeadline {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .add_column(int64_null("deadline_at_us"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index("runs_deadline", "runs", &["deadline_at_us"], false))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .drop_column(Alias::new("deadline_at_us"))
                    .to_owned(),
            )
            .await
    }
}

/// When a paused run's pause ends it `paused_too_long` (`runs.pause_ends_at_us`, 0 while
/// it is not paused), indexed so the deadline sweep reads only the pauses that are due.
struct AddPauseEnd;

impl MigrationName for AddPauseEnd {
    fn name(&self) -> &str {
        "m0018_pause_ends_at"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddPauseEnd {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .add_column(int64("pause_ends_at_us").default(0).to_owned())
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "runs_pause_ends",
                "runs",
                &["pause_ends_at_us"],
                false,
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .drop_column(Alias::new("pause_ends_at_us"))
                    .to_owned(),
            )
            .await
    }
}

/// Fair share: a run's priority (`runs.priority`), an index that reads the queue by
/// state, credential and org (the claim's grouped counts and each org's next runs), the
/// same for the active runs an org holds, and each org's pass on each credential
/// (`org_shares`; see `store::slots`).
struct AddFairShare;

impl MigrationName for AddFairShare {
    fn name(&self) -> &str {
        "m0007_fair_share"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddFairShare {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .add_column(int32("priority").default(0).to_owned())
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "runs_queue",
                "runs",
                &[
                    "state",
                    "credential_id",
                    "org_id",
                    "priority",
                    "created_at_us",
                ],
                false,
            ))
            .await?;
        manager
            .create_index(index("runs_state_org", "runs", &["state", "org_id"], false))
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("org_shares"))
                    .col(text("credential_id"))
                    .col(text("org_id"))
                    .col(int64("pass"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("credential_id"))
                            .col(Alias::new("org_id")),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("org_shares")).to_owned())
            .await
    }
}

/// Retention: how far an ended run's events were deleted (`runs.events_pruned_through`,
/// 0 for none), and an index that finds ended runs by when they ended.
struct AddRetention;

impl MigrationName for AddRetention {
    fn name(&self) -> &str {
        "m0008_retention"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddRetention {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .add_column(int64("events_pruned_through").default(0).to_owned())
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index("runs_ended", "runs", &["ended_at_us"], false))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("runs"))
                    .drop_column(Alias::new("events_pruned_through"))
                    .to_owned(),
            )
            .await
    }
}

/// The queue alone, in the order its runs start within an org: a partial index over the
/// QUEUED runs only, so a claim's grouped counts read no started or ended run, and each
/// granted org's next runs are the first entries of its range (`store::slots`).
struct AddQueuedIndex;

impl MigrationName for AddQueuedIndex {
    fn name(&self) -> &str {
        "m0010_queued_index"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddQueuedIndex {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(
                "CREATE INDEX IF NOT EXISTS runs_queued ON runs \
                 (credential_id, org_id, priority DESC, created_at_us, id) \
                 WHERE state = 'queued'",
            )
            .await
            .map(drop)
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared("DROP INDEX IF EXISTS runs_queued")
            .await
            .map(drop)
    }
}

/// A run's labels a row each (`run_labels`), indexed by key and value for selectors;
/// the runs that have labels already get theirs copied from `runs.labels`.
struct AddRunLabels;

impl MigrationName for AddRunLabels {
    fn name(&self) -> &str {
        "m0011_run_labels"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddRunLabels {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("run_labels"))
                    .col(text("run_id"))
                    .col(text("key"))
                    .col(text("value"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("run_id"))
                            .col(Alias::new("key")),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "run_labels_key_value",
                "run_labels",
                &["key", "value", "run_id"],
                false,
            ))
            .await?;
        // Runs created before this migration: their labels from `runs.labels`.
        let db = manager.get_connection();
        let sql = match db.get_database_backend() {
            sea_orm::DbBackend::Postgres => {
                "INSERT INTO run_labels (run_id, key, value) \
                 SELECT r.id, l.key, l.value FROM runs r, json_each_text(r.labels::json) l \
                 WHERE r.labels <> '{}' ON CONFLICT DO NOTHING"
            }
            _ => {
                "INSERT OR IGNORE INTO run_labels (run_id, key, value) \
                 SELECT r.id, l.key, l.value FROM runs r, json_each(r.labels) l \
                 WHERE r.labels <> '{}'"
            }
        };
        db.execute_unprepared(sql).await.map(drop)
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("run_labels")).to_owned())
            .await
    }
}

/// Lifecycle webhook deliveries, one row per endpoint and event, written in the
/// transaction of the run's change and delivered by `crate::webhooks` until the endpoint
/// answers 2xx or the delivery is given up. Due rows are read per endpoint.
struct AddWebhookDeliveries;

impl MigrationName for AddWebhookDeliveries {
    fn name(&self) -> &str {
        "m0012_webhook_deliveries"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddWebhookDeliveries {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("webhook_deliveries"))
                    .if_not_exists()
                    .col(text("id").primary_key())
                    .col(text("endpoint_id"))
                    .col(text("run_id"))
                    .col(text("org_id"))
                    .col(text("event_type"))
                    .col(text("body"))
                    .col(int64("created_at_us"))
                    .col(int64("next_attempt_at_us"))
                    .col(int32("attempts"))
                    .col(int32_null("last_status"))
                    .col(text("last_error"))
                    .col(int64_null("last_attempt_at_us"))
                    .col(int64_null("delivered_at_us"))
                    .col(int64_null("given_up_at_us"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "webhook_deliveries_due",
                "webhook_deliveries",
                &["endpoint_id", "delivered_at_us", "next_attempt_at_us"],
                false,
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(Alias::new("webhook_deliveries"))
                    .to_owned(),
            )
            .await
    }
}

/// The outbox of turn failures owed to credential health.
struct CreateOutbox;

// Named by hand: the derive names a migration after its file, and the first one in this
// file already holds that name.
impl MigrationName for CreateOutbox {
    fn name(&self) -> &str {
        "m0002_outbox"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateOutbox {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(runplane_db::outbox::create_table())
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("outbox")).to_owned())
            .await
    }
}

#[derive(DeriveMigrationName)]
struct CreateRunStore;

fn text(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .text()
        .not_null()
        .to_owned()
}

fn text_null(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name)).text().null().to_owned()
}

fn int64(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .big_integer()
        .not_null()
        .to_owned()
}

fn int64_null(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .big_integer()
        .null()
        .to_owned()
}

fn int32(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .integer()
        .not_null()
        .to_owned()
}

fn int32_null(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name)).integer().null().to_owned()
}

fn bytes(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
        .blob()
        .not_null()
        .to_owned()
}

fn index(
    name: &'static str,
    table: &'static str,
    columns: &[&'static str],
    unique: bool,
) -> IndexCreateStatement {
    let mut index = Index::create();
    index.name(name).table(Alias::new(table));
    for c in columns {
        index.col(Alias::new(*c));
    }
    if unique {
        index.unique();
    }
    index.to_owned()
}

#[async_trait::async_trait]
impl MigrationTrait for CreateRunStore {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("runs"))
                    .col(text("id").primary_key())
                    .col(text("org_id"))
                    .col(text("lead_id"))
                    .col(text("client_request_id"))
                    .col(text("request_digest"))
                    .col(text("state"))
                    .col(text("credential_id"))
                    .col(text("profile"))
                    .col(text("command"))
                    .col(text("args"))
                    .col(text("labels"))
                    .col(int64("sandbox_generation"))
                    .col(int64("last_sequence"))
                    .col(bytes("chain_head"))
                    .col(int64("steering_sequence"))
                    .col(text_null("verdict_outcome"))
                    .col(text_null("verdict_reason"))
                    .col(int32_null("verdict_exit_code"))
                    .col(int32_null("verdict_signal"))
                    .col(text_null("verdict_message"))
                    .col(text_null("failure_tail"))
                    .col(text_null("backend_error"))
                    .col(int64("created_at_us"))
                    .col(int64_null("started_at_us"))
                    .col(int64_null("ended_at_us"))
                    .col(int64("updated_at_us"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "runs_org_client_request",
                "runs",
                &["org_id", "client_request_id"],
                true,
            ))
            .await?;
        manager
            .create_index(index(
                "runs_org_created",
                "runs",
                &["org_id", "created_at_us", "id"],
                false,
            ))
            .await?;
        manager
            .create_index(index(
                "runs_created",
                "runs",
                &["created_at_us", "id"],
                false,
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("run_keys"))
                    .col(text("key_id").primary_key())
                    .col(text("run_id"))
                    .col(text("org_id"))
                    .col(text("key_hash"))
                    .col(text("sandbox_id"))
                    .col(int64("sandbox_generation"))
                    .col(text("idempotency_key"))
                    .col(int64("created_at_us"))
                    .col(text_null("revoked_reason"))
                    .col(int64_null("revoked_at_us"))
                    .col(text_null("hello_nonce"))
                    .col(int64_null("hello_at_us"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index("run_keys_hash", "run_keys", &["key_hash"], true))
            .await?;
        manager
            .create_index(index(
                "run_keys_run_idempotency",
                "run_keys",
                &["run_id", "idempotency_key"],
                true,
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("events"))
                    .col(text("run_id"))
                    .col(int64("sequence"))
                    .col(int32("kind"))
                    .col(text("text"))
                    .col(text("data"))
                    .col(ColumnDef::new(Alias::new("is_check")).boolean().not_null())
                    .col(text("name"))
                    .col(int64_null("observed_at_us"))
                    .col(int64("recorded_at_us"))
                    .col(bytes("digest"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("run_id"))
                            .col(Alias::new("sequence")),
                    )
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("event_batches"))
                    .col(text("run_id"))
                    .col(text("batch_key"))
                    .col(text("batch_digest"))
                    .col(int64("first_sequence"))
                    .col(int64("last_sequence"))
                    .col(bytes("chain_head"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("run_id"))
                            .col(Alias::new("batch_key")),
                    )
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("steering_messages"))
                    .col(text("id").primary_key())
                    .col(text("run_id"))
                    .col(text("org_id"))
                    .col(int64("sequence"))
                    .col(int32("kind"))
                    .col(bytes("payload"))
                    .col(text("idempotency_key"))
                    .col(int64("enqueued_at_us"))
                    .col(int64_null("acked_at_us"))
                    .col(text_null("ack_outcome"))
                    .col(int32_null("ack_attempts"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "steering_run_idempotency",
                "steering_messages",
                &["run_id", "idempotency_key"],
                true,
            ))
            .await?;
        manager
            .create_index(index(
                "steering_run_sequence",
                "steering_messages",
                &["run_id", "sequence"],
                true,
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("receipts"))
                    .col(text("run_id").primary_key())
                    .col(bytes("signed_payload"))
                    .col(bytes("signature"))
                    .col(text("key_id"))
                    .col(int64("sealed_at_us"))
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Alias::new("keyed_answers"))
                    .col(text("run_id"))
                    .col(text("method"))
                    .col(text("idempotency_key"))
                    .col(text("request_digest"))
                    .col(bytes("answer"))
                    .col(int64("created_at_us"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("run_id"))
                            .col(Alias::new("method"))
                            .col(Alias::new("idempotency_key")),
                    )
                    .to_owned(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            "keyed_answers",
            "receipts",
            "steering_messages",
            "event_batches",
            "events",
            "run_keys",
            "runs",
        ] {
            manager
                .drop_table(Table::drop().table(Alias::new(table)).to_owned())
                .await?;
        }
        Ok(())
    }
}

/// One row per attempt of a run (`run_attempts`), keyed by run and number.
struct AddRunAttempts;

impl MigrationName for AddRunAttempts {
    fn name(&self) -> &str {
        "m0022_run_attempts"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddRunAttempts {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("run_attempts"))
                    .col(text("run_id"))
                    .col(int64("number"))
                    .col(text("sandbox_id"))
                    .col(text("node_id"))
                    .col(int64("started_at_us"))
                    .col(int64("ended_at_us"))
                    .col(text("end_reason"))
                    .col(text("end_message"))
                    .col(text("superseded_verdict"))
                    .primary_key(
                        Index::create()
                            .col(Alias::new("run_id"))
                            .col(Alias::new("number")),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("run_attempts")).to_owned())
            .await
    }
}
