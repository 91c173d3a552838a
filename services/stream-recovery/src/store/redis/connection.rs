//! The Redis store's handle: one server's connection or a cluster's, and what it keeps
//! beside (its key prefix, the index memo, the wake-ups of its followers); and the
//! clients it connects with (over TLS, trusting the CA it was given, if any).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use runplane_grpc::notifier::Notifier;

/// The Redis-backed store; cheap to clone (one multiplexed, reconnecting connection, or
/// the cluster client's connections, one per master, routed by each script's first key).
#[derive(Clone)]
pub struct RedisStore {
    pub(super) conn: Conn,
    pub(super) prefix: String,
    /// When this process last wrote each run into the index (see `remember`).
    pub(super) indexed: Arc<Mutex<HashMap<String, Instant>>>,
    pub(super) notifier: Notifier,
    /// The group of the subscriber relaying every replica's changes to `notifier`;
    /// cancelled with the last clone of the store.
    pub(super) _relay: Arc<runplane_grpc::tasks::CancelOnDrop>,
}

/// One server or a cluster. Every script's keys share the run's (or org's) hash tag, so
/// the cluster client sends each whole script to the one master that owns the slot; a
/// script's `SCRIPT LOAD` on `NOSCRIPT` goes to every master.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// A client of the one server `url` names; over TLS, `ca` (PEM) replaces the system's
/// CAs. A CA with a `redis://` URL is refused by redis-rs (and earlier by the config).
pub(super) fn client(url: &str, ca: Option<&[u8]>) -> redis::RedisResult<redis::Client> {
    match ca {
        Some(ca) => redis::Client::build_with_tls(url, certificates(ca)),
        None => redis::Client::open(url),
    }
}

/// The certificates a TLS connection trusts: the CAs of `ca` (PEM), no client identity.
pub(super) fn certificates(ca: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca.to_vec()),
    }
}
