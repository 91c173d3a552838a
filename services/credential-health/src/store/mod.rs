//! Credential health's persistence: sea-orm entities and migrations, Postgres or SQLite.

use sea_orm_migration::{MigrationTrait, MigratorTrait};

/// Applies the service's migrations, oldest first, at every start.
pub struct Migrator;

impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        // Tables arrive with the credential health issue; the migration table exists from day one.
        Vec::new()
    }
}
