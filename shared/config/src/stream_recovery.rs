//! `[stream_recovery]`: where the stream recovery coordinator keeps its state.

use serde::Deserialize;

use crate::error::ConfigError;
use crate::server::default_endpoint;
use crate::store_urls::{pem_file, validate_redis_node};

#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamRecoveryConfig {
    /// One Redis, `redis://[[user]:password@]host:port[/db]` (`rediss://` for TLS); or a
    /// Redis Cluster, `redis+cluster://[[user]:password@]host:port,host:port,...`
    /// (`rediss+cluster://` for TLS) or a comma-separated list of `redis://` seed nodes;
    /// or `memory://`, the in-process store. The password is never logged.
    pub redis_url: String,
    /// For a TLS `redis_url`: a PEM bundle of the CA certificates the servers'
    /// certificates are checked against, instead of the system's trust store. Empty: the
    /// system's trust store.
    pub redis_ca_file: String,
    /// Prefix of every Redis key the coordinator writes (no `{` or `}`: a run's keys are
    /// hash-tagged `{run:<id>}` so each run's keys share one cluster slot).
    pub key_prefix: String,
    pub endpoint: String,
    /// Most bytes one org's live streams hold in the replay buffers, counted as what
    /// they appended in the buffers' lifetime; past it AppendFrames is refused
    /// RESOURCE_EXHAUSTED (BUDGET_EXCEEDED, `budget_scope` `org_buffer`).
    pub max_org_buffered_bytes: u64,
}

impl Default for StreamRecoveryConfig {
    fn default() -> Self {
        Self {
            redis_url: "redis://127.0.0.1:6379".to_owned(),
            redis_ca_file: String::new(),
            key_prefix: "runplane:".to_owned(),
            endpoint: default_endpoint(),
            max_org_buffered_bytes: 4 << 30,
        }
    }
}

/// Written out so `redis_url` prints without its password.
impl std::fmt::Debug for StreamRecoveryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            redis_url,
            redis_ca_file,
            key_prefix,
            endpoint,
            max_org_buffered_bytes,
        } = self;
        f.debug_struct("StreamRecoveryConfig")
            .field("redis_url", &crate::store_urls::redact_url(redis_url))
            .field("redis_ca_file", redis_ca_file)
            .field("key_prefix", key_prefix)
            .field("endpoint", endpoint)
            .field("max_org_buffered_bytes", max_org_buffered_bytes)
            .finish()
    }
}

impl StreamRecoveryConfig {
    /// `redis_url`, parsed (see [`RedisTarget::parse`]).
    pub fn target(&self) -> Result<RedisTarget, &'static str> {
        RedisTarget::parse(&self.redis_url)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let target = self
            .target()
            .map_err(|reason| ConfigError::invalid("stream_recovery.redis_url", reason))?;
        let nodes: &[String] = match &target {
            RedisTarget::Memory => &[],
            RedisTarget::Single(url) => std::slice::from_ref(url),
            RedisTarget::Cluster(seeds) => seeds,
        };
        for (i, node) in nodes.iter().enumerate() {
            validate_redis_node(node).map_err(|reason| {
                let which = match nodes.len() {
                    1 => String::new(),
                    _ => format!("seed {} ", i + 1),
                };
                // The reason never repeats the URL (a password could be in it).
                ConfigError::invalid("stream_recovery.redis_url", format!("{which}{reason}"))
            })?;
        }
        let tls = nodes.iter().filter(|n| n.starts_with("rediss://")).count();
        if tls != 0 && tls != nodes.len() {
            return Err(ConfigError::invalid(
                "stream_recovery.redis_url",
                "mixes redis:// and rediss:// seeds: a cluster is reached over TLS or not at all",
            ));
        }
        if !self.redis_ca_file.is_empty() {
            if tls == 0 {
                return Err(ConfigError::invalid(
                    "stream_recovery.redis_ca_file",
                    "is set but stream_recovery.redis_url is not TLS: use rediss:// (or \
                     rediss+cluster://), or leave the CA file empty",
                ));
            }
            pem_file("the CA file", &self.redis_ca_file, "CERTIFICATE")
                .map_err(|reason| ConfigError::invalid("stream_recovery.redis_ca_file", reason))?;
        }
        crate::checks::in_range(
            "stream_recovery.max_org_buffered_bytes",
            self.max_org_buffered_bytes,
            (1 << 20)..=u64::MAX,
        )?;
        // A brace in the prefix would become every key's hash tag: all runs in one slot.
        if self.key_prefix.contains(['{', '}']) {
            return Err(ConfigError::invalid(
                "stream_recovery.key_prefix",
                "must not contain { or } (they would make every key share one cluster slot)",
            ));
        }
        Ok(())
    }
}

/// Where the stream recovery coordinator keeps its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// The in-process store (`memory://`).
    Memory,
    /// One Redis server.
    Single(String),
    /// A Redis Cluster, by its seed nodes (each a `redis://` or `rediss://` URL).
    Cluster(Vec<String>),
}

const REDIS_URL_FORMS: &str = "must be redis://host:port, rediss://host:port, \
     redis+cluster://host:port,host:port,..., a comma-separated list of redis:// seed nodes, \
     or memory:// for the in-process store";

impl RedisTarget {
    /// A `[stream_recovery].redis_url`, in any of its forms; the reason is safe to show
    /// (it never repeats the URL, which may hold a password).
    pub fn parse(url: &str) -> Result<Self, &'static str> {
        let single = |u: &str| u.starts_with("redis://") || u.starts_with("rediss://");
        if url == "memory://" {
            return Ok(RedisTarget::Memory);
        }
        for (scheme, node_scheme) in [
            ("redis+cluster://", "redis://"),
            ("rediss+cluster://", "rediss://"),
        ] {
            if let Some(rest) = url.strip_prefix(scheme) {
                let rest = rest.trim_end_matches('/');
                // Credentials, if any, are written once before the first host and apply to all.
                let (userinfo, hosts) = match rest.rsplit_once('@') {
                    Some((u, h)) => (format!("{u}@"), h),
                    None => (String::new(), rest),
                };
                let seeds: Vec<String> = hosts
                    .split(',')
                    .map(|h| format!("{node_scheme}{userinfo}{}", h.trim()))
                    .collect();
                if hosts
                    .split(',')
                    .any(|h| h.trim().is_empty() || h.contains('/'))
                {
                    return Err("a redis+cluster:// URL lists host:port seeds separated by commas");
                }
                return Ok(RedisTarget::Cluster(seeds));
            }
        }
        if url.contains(',') {
            let seeds: Vec<String> = url.split(',').map(|s| s.trim().to_owned()).collect();
            if seeds
                .iter()
                .all(|s| single(s) && s.len() > "redis://".len())
            {
                return Ok(RedisTarget::Cluster(seeds));
            }
            return Err(REDIS_URL_FORMS);
        }
        if single(url) {
            return Ok(RedisTarget::Single(url.to_owned()));
        }
        Err(REDIS_URL_FORMS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redis_url_names_one_server_a_cluster_or_memory() {
        use RedisTarget::*;
        let t = RedisTarget::parse;
        assert_eq!(t("memory://"), Ok(Memory));
        assert_eq!(t("redis://h:6379/2"), Ok(Single("redis://h:6379/2".into())));
        assert_eq!(t("rediss://h:6380"), Ok(Single("rediss://h:6380".into())));
        assert_eq!(
            t("redis+cluster://a:7000,b:7001/"),
            Ok(Cluster(vec![
                "redis://a:7000".into(),
                "redis://b:7001".into()
            ]))
        );
        assert_eq!(
            t("rediss+cluster://u:p@a:7000,b:7001"),
            Ok(Cluster(vec![
                "rediss://u:p@a:7000".into(),
                "rediss://u:p@b:7001".into()
            ]))
        );
        assert_eq!(
            t("redis://a:7000, redis://b:7001"),
            Ok(Cluster(vec![
                "redis://a:7000".into(),
                "redis://b:7001".into()
            ]))
        );
        for bad in [
            "",
            "http://h",
            "redis+cluster://",
            "redis+cluster://a:1,,b:2",
            "redis+cluster://a:1/0,b:2",
            "redis://a:1,http://b",
            "redis://a:1,",
        ] {
            assert!(t(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            crate::store_urls::redact_url("redis://u:pw@a:1,redis://u:pw@b:2"),
            "redis://u:***@a:1,redis://u:***@b:2"
        );
        // The reason never repeats the URL (a password could be in it).
        let reason = t("redis://u:secret@a:1,nope").unwrap_err();
        assert!(!reason.contains("secret"));
    }
}
