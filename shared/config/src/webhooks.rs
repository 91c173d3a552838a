//! `[[run_store.webhooks]]` and `[run_store.webhook_delivery]`: lifecycle webhooks, signed
//! as Standard Webhooks sign them, and how they are delivered.

use std::net::IpAddr;

use base64::Engine;
use runplane_ids::Name;
use serde::Deserialize;

use crate::checks::in_range;
use crate::error::ConfigError;
use crate::secret::Secret;

/// Every lifecycle event a webhook can be sent, in the order a run meets them.
pub const WEBHOOK_EVENTS: [&str; 8] = [
    "run.started",
    "run.succeeded",
    "run.failed",
    "run.cancelled",
    "run.backend_error",
    "run.paused",
    "run.resumed",
    "run.waiting_for_input",
];

/// One endpoint runplane POSTs run lifecycle events to.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// `http://` or `https://` URL the events are POSTed to.
    pub url: String,
    /// `whsec_` and the base64 of 24 to 64 random bytes (Standard Webhooks' format): the
    /// HMAC-SHA256 key of every signature. Never logged or shown.
    pub secret: Secret,
    /// Only these events (see [`WEBHOOK_EVENTS`]); empty: all of them.
    pub events: Vec<String>,
    /// Only runs of these orgs; empty: every org.
    pub orgs: Vec<String>,
    /// Allow a URL whose host is loopback, private, link-local or otherwise not public.
    /// Off: such a target is refused at config load (an IP literal) or at delivery (a
    /// name that resolves to one), because a webhook URL is a request forgery vector.
    pub allow_private_targets: bool,
    /// A PEM file of the CAs an `https://` endpoint's certificate is checked against;
    /// empty: the system's (`/etc/ssl/certs/ca-certificates.crt`).
    pub ca_file: String,
}

/// `[run_store.webhook_delivery]`: how deliveries are retried and bounded.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookDeliveryConfig {
    /// Longest wait between two attempts of one delivery, in seconds; the wait starts at
    /// 1 s and doubles up to it.
    pub max_backoff_seconds: u32,
    /// How long a delivery is retried, in seconds from its event; then it is given up
    /// and counted as failed.
    pub give_up_after_seconds: u32,
    /// Most deliveries in flight to one endpoint at once, per replica.
    pub max_in_flight: u32,
    /// How long one attempt may take, in milliseconds, connecting included.
    pub timeout_ms: u32,
}

impl Default for WebhookDeliveryConfig {
    fn default() -> Self {
        Self {
            max_backoff_seconds: 300,
            give_up_after_seconds: 86_400,
            max_in_flight: 4,
            timeout_ms: 10_000,
        }
    }
}

impl WebhookDeliveryConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let field = "run_store.webhook_delivery";
        in_range(
            format!("{field}.max_backoff_seconds"),
            self.max_backoff_seconds,
            1..=86_400,
        )?;
        in_range(
            format!("{field}.give_up_after_seconds"),
            self.give_up_after_seconds,
            1..=7 * 86_400,
        )?;
        in_range(format!("{field}.max_in_flight"), self.max_in_flight, 1..=64)?;
        in_range(format!("{field}.timeout_ms"), self.timeout_ms, 100..=60_000)?;
        Ok(())
    }
}

/// The parts of a webhook URL delivery needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookTarget {
    pub https: bool,
    /// The host as written: a name, or an IP address without brackets.
    pub host: String,
    pub port: u16,
    /// Path and query, `/` at least.
    pub path: String,
}

impl WebhookTarget {
    /// `url` taken apart; `Err` says what is wrong with it. Only `http` and `https`, no
    /// user information (a credential in a URL ends up in logs), no fragment.
    pub fn parse(url: &str) -> Result<Self, String> {
        let (https, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err("must be an http:// or https:// URL".into());
        };
        if url
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err("must not hold spaces or control characters".into());
        }
        if url.contains('#') {
            return Err("must not have a fragment".into());
        }
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest.as_bytes()[i] == b'?' => (&rest[..i], format!("/{}", &rest[i..])),
            Some(i) => (&rest[..i], rest[i..].to_owned()),
            None => (rest, "/".to_owned()),
        };
        if authority.contains('@') {
            return Err("must not hold user information (put credentials in the secret)".into());
        }
        let default_port = if https { 443 } else { 80 };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or("has an unclosed [")?;
            let port = match after {
                "" => default_port,
                p => p
                    .strip_prefix(':')
                    .and_then(|p| p.parse().ok())
                    .ok_or("has a port that is not a number")?,
            };
            (host.to_owned(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (
                    host.to_owned(),
                    port.parse()
                        .map_err(|_| "has a port that is not a number")?,
                ),
                None => (authority.to_owned(), default_port),
            }
        };
        if host.is_empty() {
            return Err("has no host".into());
        }
        if port == 0 {
            return Err("has port 0".into());
        }
        Ok(Self {
            https,
            host: host.to_ascii_lowercase(),
            port,
            path,
        })
    }

    /// The host's address when it is an IP literal.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }
}

/// Whether `ip` is not a public unicast address: loopback, private, link-local (cloud
/// metadata lives there), unspecified, shared (CGNAT), unique-local, multicast or
/// documentation ranges, and IPv4 mapped into IPv6 likewise.
pub fn is_private_target(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || a >= 240
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private_target(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || first == 0x2001 && v6.segments()[1] == 0x0db8
        }
    }
}

/// The HMAC key in a `whsec_` secret, or why it is not one.
pub fn webhook_secret_key(secret: &str) -> Result<Vec<u8>, &'static str> {
    let encoded = secret
        .strip_prefix("whsec_")
        .ok_or("must start with whsec_ and hold base64 (Standard Webhooks' format)")?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| "must be whsec_ followed by base64")?;
    if !(24..=64).contains(&key.len()) {
        return Err(
            "must hold 24 to 64 bytes after whsec_ (e.g. whsec_ and the base64 of 32 random bytes)",
        );
    }
    Ok(key)
}

pub(crate) fn validate_webhooks(webhooks: &[WebhookConfig]) -> Result<(), ConfigError> {
    for (i, webhook) in webhooks.iter().enumerate() {
        let field = |name: &str| format!("run_store.webhooks[{i}].{name}");
        let target = WebhookTarget::parse(&webhook.url)
            .map_err(|why| ConfigError::invalid(field("url"), why))?;
        let named_private = target.host == "localhost" || target.host.ends_with(".localhost");
        if !webhook.allow_private_targets
            && (named_private || target.ip().is_some_and(is_private_target))
        {
            return Err(ConfigError::invalid(
                field("url"),
                "targets a loopback, private or link-local address; set \
                 allow_private_targets = true if that is meant",
            ));
        }
        if webhooks[..i].iter().any(|w| w.url == webhook.url) {
            return Err(ConfigError::invalid(
                field("url"),
                "is already another webhook's URL: one entry per URL",
            ));
        }
        webhook_secret_key(webhook.secret.expose())
            .map_err(|why| ConfigError::invalid(field("secret"), why))?;
        for event in &webhook.events {
            if !WEBHOOK_EVENTS.contains(&event.as_str()) {
                return Err(ConfigError::invalid(
                    field("events"),
                    format!(
                        "{event:?} is not an event; the events are {}",
                        WEBHOOK_EVENTS.join(", ")
                    ),
                ));
            }
        }
        for org in &webhook.orgs {
            Name::parse(org).map_err(|e| ConfigError::invalid(field("orgs"), e.to_string()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_taken_apart_or_refused_with_a_reason() {
        let t = WebhookTarget::parse("https://hooks.example.com/runs?x=1").unwrap();
        assert_eq!(
            (t.https, t.host.as_str(), t.port, t.path.as_str()),
            (true, "hooks.example.com", 443, "/runs?x=1")
        );
        let t = WebhookTarget::parse("http://[::1]:8080").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("::1", 8080, "/")
        );
        let t = WebhookTarget::parse("http://10.0.0.1:81?q").unwrap();
        assert_eq!((t.port, t.path.as_str()), (81, "/?q"));
        for bad in [
            "ftp://example.com/",
            "example.com",
            "http://user:pw@example.com/",
            "http:///x",
            "http://example.com:port/",
            "http://example.com/#frag",
            "http://exa mple.com/",
        ] {
            assert!(WebhookTarget::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn private_targets_are_named() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_private_target(private.parse().unwrap()), "{private}");
        }
        for public in ["93.184.216.34", "2606:4700::1111", "8.8.8.8"] {
            assert!(!is_private_target(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn secrets_are_standard_webhooks_secrets() {
        assert_eq!(
            webhook_secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
                .unwrap()
                .len(),
            24
        );
        assert!(webhook_secret_key("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(webhook_secret_key("whsec_c2hvcnQ=").is_err());
        assert!(webhook_secret_key("whsec_***").is_err());
    }
}
