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

/// Adds a `NOT NULL` 64-bit integer column defaulting to 0, named by hand as
/// [`AddTextColumn`].
pub struct AddBigIntColumn {
    pub name: &'static str,
    pub table: &'static str,
    pub column: &'static str,
}

/// Generates the `MigrationName` and `MigrationTrait` of a one-column migration whose
/// column is `$column` (a `ColumnDef` for the column's name).
macro_rules! add_column {
    ($migration:ident, $column:expr) => {
        impl MigrationName for $migration {
            fn name(&self) -> &str {
                self.name
            }
        }

        #[async_trait::async_trait]
        impl MigrationTrait for $migration {
            async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                #[allow(clippy::redundant_closure_call)]
                let column: ColumnDef = ($column)(Alias::new(self.column));
                manager
                    .alter_table(
                        Table::alter()
                            .table(Alias::new(self.table))
                            .add_column(column)
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
    };
}

add_column!(AddTextColumn, |name| ColumnDef::new(name)
    .text()
    .not_null()
    .default("")
    .to_owned());
add_column!(AddBigIntColumn, |name| ColumnDef::new(name)
    .big_integer()
    .not_null()
    .default(0)
    .to_owned());
