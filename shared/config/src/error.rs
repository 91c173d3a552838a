//! The one error the configuration gives: a missing file, an unparsable source, or a
//! field that is invalid, named.

use std::borrow::Cow;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path} does not exist")]
    MissingFile { path: String },
    #[error("invalid config: {0}")]
    Parse(String),
    #[error("invalid config: {field}: {reason}")]
    Invalid {
        field: Cow<'static, str>,
        reason: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
