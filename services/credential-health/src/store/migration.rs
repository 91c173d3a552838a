//! Credential health's schema.

use sea_orm_migration::prelude::*;

/// Applies the service's migrations, oldest first, at every start.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(CreateCredentialHealth),
            Box::new(NoticesByOrg),
            // The orgs a notice's penalty is for (`notices.affected_orgs`, a JSON array;
            // empty: every org).
            Box::new(runplane_db::migrations::AddTextColumn {
                name: "m0003_notice_affected_orgs",
                table: "notices",
                column: "affected_orgs",
            }),
        ]
    }
}

#[derive(DeriveMigrationName)]
struct CreateCredentialHealth;

fn col(name: &'static str) -> ColumnDef {
    ColumnDef::new(Alias::new(name))
}

#[async_trait::async_trait]
impl MigrationTrait for CreateCredentialHealth {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("credentials"))
                    .col(col("credential_id").text().not_null().primary_key())
                    .col(col("version").big_integer().not_null())
                    .col(col("evidence").text().not_null())
                    .col(col("cool_off_until_ms").big_integer().not_null())
                    .col(col("open_incident_id").text().null())
                    .col(col("quarantine_until_ms").big_integer().not_null())
                    .col(col("last_seen_ms").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("incidents"))
                    .col(col("id").text().not_null().primary_key())
                    .col(col("credential_id").text().not_null())
                    .col(col("state").text().not_null())
                    .col(col("opening_run_ids").text().not_null())
                    .col(col("failures_during_cool_off").integer().not_null())
                    .col(col("notified_lead_ids").text().not_null())
                    .col(col("opened_at_ms").big_integer().not_null())
                    .col(col("cool_off_ends_at_ms").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("incidents_by_credential")
                    .table(Alias::new("incidents"))
                    .col(Alias::new("credential_id"))
                    .col(Alias::new("opened_at_ms"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("turn_failures"))
                    .col(col("turn_id").text().not_null().primary_key())
                    .col(col("run_id").text().not_null())
                    .col(col("credential_id").text().not_null())
                    .col(col("request_digest").text().not_null())
                    .col(col("outcome").text().not_null())
                    .col(col("incident_id").text().null())
                    .col(col("answer").blob().not_null())
                    .col(col("created_at_ms").big_integer().not_null())
                    .to_owned(),
            )
            .await?;
        manager.create_table(notices_table(false)).await?;
        manager
            .create_table(
                Table::create()
                    .table(Alias::new("counters"))
                    .col(col("name").text().not_null().primary_key())
                    .col(col("value").big_integer().not_null())
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(runplane_db::outbox::create_table())
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            "outbox",
            "counters",
            "notices",
            "turn_failures",
            "incidents",
            "credentials",
        ] {
            manager
                .drop_table(Table::drop().table(Alias::new(table)).to_owned())
                .await?;
        }
        Ok(())
    }
}

/// Notices are keyed by (org, lead): a lead id is unique only within its org. The
/// notices kept before cannot be given an org after the fact, and showing them to every
/// org's lead of that id is the leak this closes, so they are dropped (they are advisory
/// and retention drops them within a week anyway) with their sequence counters.
struct NoticesByOrg;

impl MigrationName for NoticesByOrg {
    fn name(&self) -> &str {
        "m0002_notices_by_org"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for NoticesByOrg {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("notices")).to_owned())
            .await?;
        manager
            .get_connection()
            .execute_unprepared("DELETE FROM counters WHERE name LIKE 'notice_seq:%'")
            .await?;
        manager.create_table(notices_table(true)).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Alias::new("notices")).to_owned())
            .await?;
        manager
            .get_connection()
            .execute_unprepared("DELETE FROM counters WHERE name LIKE 'notice_seq:%'")
            .await?;
        manager.create_table(notices_table(false)).await
    }
}

/// The notices table, keyed by (org, lead, seq) or, before orgs, by (lead, seq).
fn notices_table(by_org: bool) -> TableCreateStatement {
    let mut table = Table::create();
    table.table(Alias::new("notices"));
    let mut key = Index::create();
    if by_org {
        table.col(col("org_id").text().not_null());
        key.col(Alias::new("org_id"));
    }
    key.col(Alias::new("lead_id")).col(Alias::new("seq"));
    table
        .col(col("lead_id").text().not_null())
        .col(col("seq").big_integer().not_null())
        .col(col("id").text().not_null().unique_key())
        .col(col("kind").text().not_null())
        .col(col("credential_id").text().not_null())
        .col(col("incident_id").text().not_null())
        .col(col("affected_run_ids").text().not_null())
        .col(col("message").text().not_null())
        .col(col("cooling_off_for_seconds").integer().not_null())
        .col(col("quarantined_for_seconds").integer().not_null())
        .col(col("created_at_ms").big_integer().not_null())
        .col(col("pruned").boolean().not_null())
        .primary_key(&mut key)
        .to_owned()
}
