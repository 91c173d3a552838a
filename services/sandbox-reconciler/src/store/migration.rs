//! The reconciler's schema.

use sea_orm_migration::prelude::*;

/// Applies the reconciler's migrations, oldest first, at every start.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(CreateReconciler),
            // The trace a sandbox's work continues (`sandboxes.traceparent`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0002_sandbox_traceparent",
                table: "sandboxes",
                column: "traceparent",
            }),
            // Node agents' own credentials (`node_credentials`).
            Box::new(CreateNodeCredentials),
            // A failed restore's backoff (`wakes.not_before_us`).
            Box::new(AddWakeNotBefore),
            // `none` for a sandbox whose run's profile takes the network away
            // (`sandboxes.network`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0005_sandbox_network",
                table: "sandboxes",
                column: "network",
            }),
            // A profile's own limits for its sandboxes (`sandboxes.limits`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0006_sandbox_limits",
                table: "sandboxes",
                column: "limits",
            }),
            // A profile's own image for its container sandboxes (`sandboxes.image`).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0007_sandbox_image",
                table: "sandboxes",
                column: "image",
            }),
            // The capacity an operator allows a node's credential to register with
            // (`node_credentials.max_capacity`, 0: the protocol's 10000).
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0008_node_credential_max_capacity",
                table: "node_credentials",
                column: "max_capacity",
            }),
            // Whether the sandbox's run is paused (`sandboxes.paused`, 1: yes), as the run
            // store last said: its sandbox is held suspended and no wake is assigned.
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0009_sandbox_paused",
                table: "sandboxes",
                column: "paused",
            }),
            // The attempt of its run a sandbox was made for (`sandboxes.attempt`; 0 for
            // rows from before attempts: the first).
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0010_sandbox_attempt",
                table: "sandboxes",
                column: "attempt",
            }),
            // When a node was fenced by the revocation of its credentials
            // (`nodes.fenced_at_us`, 0: not fenced).
            Box::new(runplane_db::migrations::AddBigIntColumn {
                name: "m0011_node_fenced_at",
                table: "nodes",
                column: "fenced_at_us",
            }),
        ]
    }
}

#[derive(DeriveMigrationName)]
struct CreateReconciler;

fn col(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
}

#[async_trait::async_trait]
impl MigrationTrait for CreateReconciler {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("sandboxes"))
                    .col(col("id").text().not_null().primary_key())
                    .col(col("run_id").text().not_null())
                    .col(col("org_id").text().not_null())
                    .col(col("client_request_id").text().not_null().unique_key())
                    .col(col("substrate").text().not_null())
                    .col(col("status").text().not_null())
                    .col(col("active_node_id").text().null())
                    .col(col("execution_generation").big_integer().not_null())
                    .col(col("loss_observed_at_us").big_integer().null())
                    .col(col("idle_timeout_ms").big_integer().not_null())
                    .col(col("exit_code").integer().null())
                    .col(col("driver_handle").text().not_null())
                    .col(col("observation_seq").big_integer().not_null())
                    .col(col("observed_status").text().not_null())
                    .col(col("created_at_us").big_integer().not_null())
                    .col(col("updated_at_us").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("sandboxes_status")
                    .table(Alias::new("sandboxes"))
                    .col(Alias::new("status"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("route_identities"))
                    .col(col("sandbox_id").text().not_null().primary_key())
                    .col(col("current_node_id").text().not_null())
                    .col(col("execution_generation").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("nodes"))
                    .col(col("id").text().not_null().primary_key())
                    .col(col("endpoint").text().not_null())
                    .col(col("capacity").integer().not_null())
                    .col(col("last_heartbeat_us").big_integer().not_null())
                    .col(col("boot_id").text().not_null())
                    .col(col("epoch").big_integer().not_null())
                    .col(col("used").integer().not_null())
                    .col(col("registered_at_us").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("wakes"))
                    .col(col("id").text().not_null().primary_key())
                    .col(col("sandbox_id").text().not_null())
                    .col(col("state").text().not_null())
                    .col(col("node_id").text().null())
                    .col(col("attempts").integer().not_null())
                    .col(col("last_error").text().not_null())
                    .col(col("reason").text().not_null())
                    .col(col("requested_at_us").big_integer().not_null())
                    .col(col("settled_at_us").big_integer().null())
                    .to_owned(),
            )
            .await?;
        // One open wake per sandbox, on both backends.
        manager
            .get_connection()
            .execute_unprepared(
                "CREATE UNIQUE INDEX wakes_one_open ON wakes (sandbox_id) WHERE settled_at_us IS NULL",
            )
            .await?;
        manager
            .create_table(runplane_db::outbox::create_table())
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in ["outbox", "wakes", "nodes", "route_identities", "sandboxes"] {
            manager
                .drop_table(Table::drop().table(Alias::new(table)).to_owned())
                .await?;
        }
        Ok(())
    }
}

/// Named by hand: the derive would name it after this file, as it does the first one.
struct CreateNodeCredentials;

impl MigrationName for CreateNodeCredentials {
    fn name(&self) -> &str {
        "m0003_node_credentials"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for CreateNodeCredentials {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("node_credentials"))
                    .col(col("id").text().not_null().primary_key())
                    .col(col("node_id").text().not_null())
                    .col(col("token_sha256").text().not_null().unique_key())
                    .col(col("created_at_us").big_integer().not_null())
                    .col(col("revoked_at_us").big_integer().null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(Alias::new("node_credentials"))
                    .to_owned(),
            )
            .await
    }
}

/// `wakes.not_before_us`: a wake whose restore failed is not handed out again before
/// it, so a failing restore backs off instead of looping. NULL: due at once.
struct AddWakeNotBefore;

impl MigrationName for AddWakeNotBefore {
    fn name(&self) -> &str {
        "m0004_wake_not_before"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddWakeNotBefore {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("wakes"))
                    .add_column(col("not_before_us").big_integer().null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new("wakes"))
                    .drop_column(Alias::new("not_before_us"))
                    .to_owned(),
            )
            .await
    }
}
