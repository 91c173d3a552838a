//! Checks several sections share: bounded numbers, names, database URLs and endpoint
//! lists.

use std::fmt::Display;
use std::ops::RangeInclusive;

use crate::error::ConfigError;

/// Whether `value` is an id of an org, lead, credential or profile: a
/// [`runplane_ids::Name`], the one rule for them everywhere runplane takes one.
pub fn is_name(value: &str) -> bool {
    runplane_ids::Name::parse(value).is_ok()
}

/// `Ok` when `value` lies in `range`; otherwise `field` is invalid and "must be between"
/// the range's ends, which is how every bounded number of the config is checked.
pub(crate) fn in_range<T: PartialOrd + Display>(
    field: impl Into<std::borrow::Cow<'static, str>>,
    value: T,
    range: RangeInclusive<T>,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::invalid(field, between(&range)))
    }
}

/// "must be between LO and HI".
pub(crate) fn between<T: Display>(range: &RangeInclusive<T>) -> String {
    format!("must be between {} and {}", range.start(), range.end())
}

/// A `database_url` field names Postgres or SQLite, the two databases the SQL services
/// speak.
pub(crate) fn validate_database_url(field: &'static str, url: &str) -> Result<(), ConfigError> {
    if !(url.starts_with("postgres://")
        || url.starts_with("postgresql://")
        || url.starts_with("sqlite:"))
    {
        return Err(ConfigError::invalid(
            field,
            "must start with postgres:// or sqlite:",
        ));
    }
    Ok(())
}

/// An endpoint field is one `http://` or `https://` URL or several separated by commas
/// (replicas). The full parse happens where the client is built
/// (`runplane_grpc::endpoints`); this catches a bad list at start-up, naming the field
/// and the entry, and never echoing an entry that could hold a secret.
pub(crate) fn validate_endpoint_list(
    field: &str,
    list: &str,
    has_ca: bool,
) -> Result<(), ConfigError> {
    for (i, entry) in list.split(',').map(str::trim).enumerate() {
        let which = format!("entry {} of the list", i + 1);
        if entry.is_empty() {
            return Err(ConfigError::invalid(
                field.to_owned(),
                format!(
                    "{which} is empty: give one http:// or https:// URL, or several separated by commas"
                ),
            ));
        }
        if entry.contains(['@', '?']) {
            return Err(ConfigError::invalid(
                field.to_owned(),
                format!(
                    "{which} (not shown) has userinfo or a query: credentials do not belong in an endpoint"
                ),
            ));
        }
        let rest = entry
            .strip_prefix("http://")
            .or_else(|| entry.strip_prefix("https://"));
        match rest {
            None => {
                return Err(ConfigError::invalid(
                    field.to_owned(),
                    format!("{which} (`{entry}`) must be an http:// or https:// URL"),
                ));
            }
            Some(rest)
                if rest.trim_end_matches('/').is_empty()
                    || rest.trim_end_matches('/').contains('/') =>
            {
                return Err(ConfigError::invalid(
                    field.to_owned(),
                    format!("{which} (`{entry}`) must be a host and port, with no path"),
                ));
            }
            Some(_) => {}
        }
        if entry.starts_with("https://") && !has_ca {
            return Err(ConfigError::invalid(
                "tls.ca_file",
                format!(
                    "required by the https:// endpoint in {field}: the CA that signed its server certificate"
                ),
            ));
        }
    }
    Ok(())
}
