//! Where a client may reach a service: the one endpoint-list parser every runplane
//! client (services, the CLI, runners, node agents) goes through.
//!
//! A list is one `http://` or `https://` URI or several separated by commas: replicas.
//! A URI whose host is a name stands for every address the name resolves to (A and
//! AAAA), resolved again every [`RESOLVE_EVERY`], so a Kubernetes headless Service's pods
//! are followed as they come and go. The name stays on the wire (`:authority`, the TLS
//! server name); only the TCP connect goes to a resolved address.
//!
//! Errors name the entry by its position and show it only when it cannot hold a secret
//! (no userinfo, no query): an endpoint is configuration, and configuration gets pasted
//! into bug reports.
//!
//! Every endpoint gets the same settings ([`endpoint_settings`]: h2 keepalive, TLS for
//! `https://`); whoever connects bounds the connect by [`CONNECT_TIMEOUT`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Endpoint;

use crate::error::{ClientError, error_chain};
use crate::tls::ClientTls;

/// How long a TCP connect may take before it counts as failed (and provably unsent).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// h2 keepalive: a ping every interval on a connection with calls open; no answer
/// within the timeout breaks the connection.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a name is resolved again. A pod that joins a headless Service gets calls
/// within this; one that left stops being tried once a connect to it fails.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(30);

/// One entry of a list.
#[derive(Clone)]
pub struct Target {
    shown: Arc<str>,
    endpoint: Endpoint,
    host: Host,
    port: u16,
}

#[derive(Clone, Debug)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

impl Target {
    /// The URI as logs and errors may show it.
    pub fn shown(&self) -> &Arc<str> {
        &self.shown
    }

    /// tonic's settings for this URI (TLS included), without a connect timeout: the
    /// caller's connector bounds the connect.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The address of a URI whose host is an IP literal, which needs no resolving.
    pub fn literal(&self) -> Option<SocketAddr> {
        match self.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.port)),
            Host::Name(_) => None,
        }
    }

    /// Every address the host stands for, sorted and without duplicates.
    pub async fn resolve(&self) -> std::io::Result<Vec<SocketAddr>> {
        let mut addresses: Vec<SocketAddr> = match &self.host {
            Host::Ip(ip) => vec![SocketAddr::new(*ip, self.port)],
            Host::Name(name) => tokio::net::lookup_host((name.as_str(), self.port))
                .await?
                .collect(),
        };
        addresses.sort();
        addresses.dedup();
        if addresses.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} resolves to no address", self.shown),
            ));
        }
        Ok(addresses)
    }
}

/// A parsed endpoint list: at least one target.
#[derive(Clone, Debug)]
pub struct EndpointList {
    targets: Arc<[Target]>,
}

impl EndpointList {
    /// Parses `list` with the installed TLS client settings ([`crate::tls::install`]).
    pub fn parse(list: &str) -> Result<Self, ClientError> {
        Self::parse_with_tls(list, crate::tls::client().as_ref())
    }

    /// [`EndpointList::parse`] with explicit TLS for `https://` entries.
    pub fn parse_with_tls(list: &str, tls: Option<&ClientTls>) -> Result<Self, ClientError> {
        let entries: Vec<&str> = list.split(',').map(str::trim).collect();
        let several = entries.len() > 1;
        let targets = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| target(entry, several.then_some(i + 1), tls))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            targets: targets.into(),
        })
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// The list as logs may show it.
    pub fn shown(&self) -> String {
        let shown: Vec<&str> = self.targets.iter().map(|t| &*t.shown).collect();
        shown.join(",")
    }
}

/// An entry as an error may show it: not at all when it could hold a secret.
pub fn shown(entry: &str) -> String {
    if entry.contains(['@', '?']) {
        return "<not shown: it may hold a secret>".to_owned();
    }
    let mut shown: String = entry.chars().take(120).collect();
    if shown.len() < entry.len() {
        shown.push('…');
    }
    shown
}

/// [`crate::client::endpoint_with_tls`] without the connect timeout, for a caller whose own connector
/// bounds the connect (the retrying transport does, and classifies it).
pub fn endpoint_settings(uri: &str, tls: Option<&ClientTls>) -> Result<Endpoint, ClientError> {
    let invalid = |reason: String| ClientError::InvalidEndpoint {
        endpoint: shown(uri),
        reason,
    };
    let endpoint = Endpoint::from_shared(uri.to_owned())
        .map_err(|e| invalid(e.to_string()))?
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    if endpoint.uri().scheme_str() != Some("https") {
        return Ok(endpoint);
    }
    let tls = tls.ok_or_else(|| {
        invalid(
            "an https:// endpoint needs tls.ca_file (RUNPLANE_TLS__CA_FILE): the CA that \
             signed the server's certificate"
                .to_owned(),
        )
    })?;
    endpoint
        .tls_config(tls.config())
        .map_err(|e| invalid(error_chain(&e)))
}

fn target(
    entry: &str,
    position: Option<usize>,
    tls: Option<&ClientTls>,
) -> Result<Target, ClientError> {
    let invalid = |reason: &str| ClientError::InvalidEndpoint {
        endpoint: match position {
            Some(n) => format!("{} (entry {n} of the list)", shown(entry)),
            None => shown(entry),
        },
        reason: reason.to_owned(),
    };
    if entry.is_empty() {
        return Err(invalid(
            "empty: give one http:// or https:// URL, or several separated by commas",
        ));
    }
    let uri: http::Uri = entry
        .parse()
        .map_err(|_| invalid("not a URL (http://host:port or https://host:port)"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(invalid("must start with http:// or https://"));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| invalid("has no host"))?
        .clone();
    if authority.as_str().contains('@') {
        return Err(invalid(
            "credentials do not belong in an endpoint: the bearer comes from [auth] or RUNPLANE_TOKEN",
        ));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(invalid("must not have a path or query"));
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let host = match host.parse::<IpAddr>() {
        Ok(ip) => Host::Ip(ip),
        Err(_) if host.is_empty() => return Err(invalid("has no host")),
        Err(_) => Host::Name(host.to_owned()),
    };
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    let endpoint = endpoint_settings(entry, tls).map_err(|e| match e {
        ClientError::InvalidEndpoint { reason, .. } => invalid(&reason),
        other => other,
    })?;
    Ok(Target {
        shown: shown(entry).into(),
        endpoint,
        host,
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(list: &str) -> String {
        EndpointList::parse_with_tls(list, None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_list_is_its_entries_in_order() {
        let list =
            EndpointList::parse_with_tls(" http://10.0.0.1:7070 ,http://run-store:7070", None)
                .unwrap();
        let shown: Vec<&str> = list.targets().iter().map(|t| &**t.shown()).collect();
        assert_eq!(shown, ["http://10.0.0.1:7070", "http://run-store:7070"]);
        assert_eq!(
            list.targets()[0].literal(),
            Some("10.0.0.1:7070".parse().unwrap())
        );
        assert_eq!(list.targets()[1].literal(), None);
        let v6 = EndpointList::parse_with_tls("http://[::1]:7", None).unwrap();
        assert_eq!(v6.targets()[0].literal(), Some("[::1]:7".parse().unwrap()));
    }

    #[test]
    fn bad_entries_are_named_by_position_and_why() {
        let e = error("http://a:1,,http://b:1");
        assert!(
            e.contains("entry 2 of the list") && e.contains("empty"),
            "{e}"
        );
        let e = error("http://a:1,b:1");
        assert!(e.contains("`b:1 (entry 2") && e.contains("http://"), "{e}");
        let e = error("http://a:1/runs");
        assert!(e.contains("path"), "{e}");
        let e = error("");
        assert!(e.contains("empty"), "{e}");
        // https without a CA to trust is refused here too, with the same reason.
        let e = error("https://a:1");
        assert!(e.contains("tls.ca_file"), "{e}");
    }

    #[test]
    fn an_entry_that_may_hold_a_secret_is_not_echoed() {
        for list in [
            "http://user:hunter2-secret@a:1",
            "http://a:1,http://a:1/?token=hunter2-secret",
            "ftp://x:hunter2-secret@a",
        ] {
            let e = error(list);
            assert!(!e.contains("hunter2"), "{e}");
            assert!(e.contains("not shown"), "{e}");
        }
    }

    #[tokio::test]
    async fn a_name_resolves_to_its_addresses_and_a_literal_to_itself() {
        let list =
            EndpointList::parse_with_tls("http://localhost:7070,http://127.0.0.9:1", None).unwrap();
        let local = list.targets()[0].resolve().await.unwrap();
        assert!(
            !local.is_empty()
                && local
                    .iter()
                    .all(|a| a.ip().is_loopback() && a.port() == 7070)
        );
        assert_eq!(
            list.targets()[1].resolve().await.unwrap(),
            ["127.0.0.9:1".parse::<SocketAddr>().unwrap()]
        );
    }
}
