//! Credential health's errors.

#[derive(Debug, thiserror::Error)]
pub enum CredentialHealthError {
    #[error(transparent)]
    Database(#[from] runplane_db::DbError),
}
