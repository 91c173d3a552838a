//! The URLs of the stores (Postgres, SQLite, Redis): what the binary can speak, checked
//! at load so a URL it cannot use stops the start naming its field instead of failing at
//! the first connection, and [`redact_url`], the one way a store URL is printed.
//!
//! Postgres goes through sqlx and Redis through redis-rs, both over rustls with the
//! system's trust store (plus the CA a URL or `stream_recovery.redis_ca_file` names).
//! The checks follow what those drivers read: a parameter they would silently ignore is
//! refused, because an operator who wrote it expected it to do something.

use std::path::Path;

use crate::error::ConfigError;

/// The `sslmode` values sqlx knows (compared ignoring case, as sqlx does).
const SSL_MODES: &[&str] = &[
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
];

/// Every query parameter sqlx reads from a Postgres URL (besides `options[NAME]`).
const POSTGRES_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// A `database_url` field names Postgres or SQLite, the two databases the SQL services
/// speak; a Postgres URL's query only what sqlx reads, with usable TLS settings.
pub(crate) fn validate_database_url(field: &'static str, url: &str) -> Result<(), ConfigError> {
    if url.starts_with("sqlite:") {
        return Ok(());
    }
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(ConfigError::invalid(
            field,
            "must start with postgres:// or sqlite:",
        ));
    }
    validate_postgres_query(url).map_err(|reason| ConfigError::invalid(field, reason))
}

/// The TLS settings and other parameters of a Postgres URL's query.
fn validate_postgres_query(url: &str) -> Result<(), String> {
    let Some((_, query)) = url.split_once('?') else {
        return Ok(());
    };
    let mut mode = None;
    let mut root_cert = None;
    let mut client_cert = None;
    let mut client_key = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(key);
        let value = percent_decode(value);
        let known = POSTGRES_PARAMETERS.contains(&key.as_str())
            || (key.starts_with("options[") && key.ends_with(']'));
        if !known {
            // The key only: a mistyped `password` must not be echoed with its value.
            return Err(format!(
                "the query parameter `{}` is not one runplane's Postgres driver (sqlx) reads; \
                 it reads sslmode, sslrootcert, sslcert, sslkey, application_name, options and \
                 the connection's host, port, dbname, user and password",
                printable(&key)
            ));
        }
        match key.as_str() {
            "sslmode" | "ssl-mode" => {
                if !SSL_MODES.iter().any(|m| m.eq_ignore_ascii_case(&value)) {
                    return Err(format!(
                        "sslmode `{}` is not one of {}",
                        printable(&value),
                        SSL_MODES.join(", ")
                    ));
                }
                mode = Some(value.to_ascii_lowercase());
            }
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => root_cert = Some(value),
            "sslcert" | "ssl-cert" => client_cert = Some(value),
            "sslkey" | "ssl-key" => client_key = Some(value),
            _ => {}
        }
    }
    let verifies = matches!(mode.as_deref(), Some("verify-ca" | "verify-full"));
    if let Some(ca) = &root_cert {
        if !verifies {
            // libpq would verify against a root certificate with sslmode=require; sqlx
            // does not, so the CA the operator named would be silently unused.
            return Err(format!(
                "sslrootcert is only used with sslmode=verify-full or verify-ca (sqlx does not \
                 check the server's certificate with sslmode={}); add sslmode=verify-full",
                mode.as_deref().unwrap_or("prefer, the default")
            ));
        }
        pem_file("sslrootcert", ca, "CERTIFICATE")?;
    }
    match (&client_cert, &client_key) {
        (Some(cert), Some(key)) => {
            pem_file("sslcert", cert, "CERTIFICATE")?;
            pem_file("sslkey", key, "PRIVATE KEY")?;
        }
        (None, None) => {}
        _ => return Err("sslcert and sslkey go together: give both or neither".to_owned()),
    }
    Ok(())
}

/// One Redis URL (a whole `redis_url` naming one server, or one cluster seed): its host,
/// port, database number and query are what redis-rs reads, with a password when it has
/// credentials, and no `#insecure` (certificate checks cannot be turned off).
pub(crate) fn validate_redis_node(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("rediss://")
        .or_else(|| url.strip_prefix("redis://"))
        .ok_or("must be a redis:// or rediss:// URL")?;
    if rest.contains('#') {
        return Err(
            "has a #fragment (a # in a password is written %23): redis-rs reads only \
             #insecure, which turns off the check of the server's certificate and is not \
             compiled in; name the CA that signed it in stream_recovery.redis_ca_file"
                .to_owned(),
        );
    }
    // Credentials come before the last '@' (a password may hold '/' or '?').
    let (userinfo, location) = match rest.rsplit_once('@') {
        Some((userinfo, location)) => (Some(userinfo), location),
        None => (None, rest),
    };
    if let Some(userinfo) = userinfo
        && !userinfo.contains(':')
    {
        return Err(
            "has credentials without a password: the password goes after a colon, \
             rediss://:PASSWORD@host:port (or rediss://USER:PASSWORD@host:port for an ACL user)"
                .to_owned(),
        );
    }
    let (location, query) = location.split_once('?').unwrap_or((location, ""));
    let (authority, path) = location.split_once('/').unwrap_or((location, ""));
    // `[::1]` is a host without a port.
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !authority.ends_with(']') => (host, Some(port)),
        _ => (authority, None),
    };
    if host.is_empty() {
        return Err("has no host".to_owned());
    }
    if let Some(port) = port
        && port.parse::<u16>().is_err()
    {
        return Err("has a port that is not a number from 0 to 65535".to_owned());
    }
    if !path.is_empty() && path.trim_end_matches('/').parse::<u32>().is_err() {
        return Err("has a path that is not a database number".to_owned());
    }
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "protocol" {
            return Err(format!(
                "the query parameter `{}` is not one redis-rs reads (it reads protocol)",
                printable(&percent_decode(key))
            ));
        }
        if !matches!(value, "resp2" | "resp3") {
            return Err("protocol must be resp2 or resp3".to_owned());
        }
    }
    Ok(())
}

/// `path` (the value of `what`) is a readable file holding a PEM block of `kind`
/// (`CERTIFICATE`, `PRIVATE KEY`, which also matches `RSA PRIVATE KEY` and the like).
pub(crate) fn pem_file(what: &str, path: &str, kind: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err(format!("{what} is empty: give the path of a PEM file"));
    }
    let text = std::fs::read(Path::new(path)).map_err(|e| format!("{what} {path}: {e}"))?;
    let text = String::from_utf8_lossy(&text);
    let holds_kind = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|l| l.strip_suffix("-----"))
            .is_some_and(|label| label.ends_with(kind))
    });
    if !holds_kind {
        return Err(format!("{what} {path} holds no PEM {kind}"));
    }
    Ok(())
}

/// `%XX` escapes and `+` decoded, as a URL's query is read.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `text` shortened and without control characters, to quote in an error.
fn printable(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).take(64).collect()
}

/// `url` with any password replaced, safe to log or put in an error: the password of its
/// userinfo and a `password=` (Postgres) or `pass=` (a Redis socket) query parameter. A
/// comma-separated list (cluster seeds) has each element's replaced.
pub fn redact_url(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let url = match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    let Some((base, query)) = url.split_once('?') else {
        return url;
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if ["password", "pass"].contains(&percent_decode(key).as_str()) => {
                format!("{key}=***")
            }
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{base}?{query}")
}
