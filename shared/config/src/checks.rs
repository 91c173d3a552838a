//! Checks several sections share: bounded numbers, names and endpoint lists (the stores'
//! URLs are `store_urls`).

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

/// Whether `reference` reads as an image reference: `[registry/]name[:tag][@digest]`,
/// lower-case name components, no spaces or control characters.
pub fn is_image_reference(reference: &str) -> bool {
    let (name, _digest) = match reference.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (reference, None),
    };
    if name.is_empty() || reference.len() > 512 {
        return false;
    }
    let tagless = match name.rsplit_once(':') {
        Some((before, tag)) if !tag.contains('/') => {
            if tag.is_empty()
                || !tag
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return false;
            }
            before
        }
        _ => name,
    };
    let parts = tagless.split('/').count();
    // A registry's port is a number.
    if parts > 1
        && let Some((_, port)) = tagless
            .split('/')
            .next()
            .unwrap_or_default()
            .split_once(':')
        && (port.is_empty() || !port.chars().all(|c| c.is_ascii_digit()))
    {
        return false;
    }
    tagless.split('/').enumerate().all(|(i, part)| {
        !part.is_empty()
            && part.chars().all(|c| {
                c.is_ascii_lowercase()
                    || c.is_ascii_digit()
                    || "._-".contains(c)
                    // A registry host (the first part) may carry a port and capitals.
                    || (i == 0 && parts > 1 && (c == ':' || c.is_ascii_uppercase()))
            })
    })
}

#[cfg(test)]
mod tests {
    use super::is_image_reference as valid_image;

    #[test]
    fn image_references_are_checked() {
        for good in [
            "busybox",
            "localhost/runplane-busybox:test",
            "registry.example.com:5000/team/agent:1.2.3",
            "ghcr.io/org/agent@sha256:0123abcd",
        ] {
            assert!(valid_image(good), "{good}");
        }
        for bad in ["", "Busybox", "a b", "name:", "name:tag/x", "a//b", "x\n"] {
            assert!(!valid_image(bad), "{bad:?}");
        }
    }
}
