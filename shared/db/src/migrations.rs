//! Migrations more than one service needs, written once.

use sea_orm_migration::prelude::*;

/// Adds a `NOT NULL` text column defaulting to `''` (rows that exist get the empty
/// string), under a name given by hand: the derive names a migration after its file,
/// which a service's first migration already holds.
pub struct AddTextColumn {
    pub name: &'static str,
    pub table: &'static str,
    pub column: &'static str,
}

impl MigrationName for AddTextColumn {
    fn name(&self) -> &str {
        self.name
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddTextColumn {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new(self.table))
                    .add_column(
                        ColumnDef::new(Alias::new(self.column))
                            .text()
                            .not_null()
                            .default(""),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Alias::new(self.table))
                    .drop_column(Alias::new(self.column))
                    .to_owned(),
            )
            .await
    }
}
