//! The split topology operators deploy: each service its own `runplane serve` process,
//! on its own Postgres database, the coordinator on Redis, on free local ports.

use std::collections::HashMap;
use std::path::Path;

use runplane_testkit::{TestDatabase, TestRedis, free_local_addr};

use crate::{Process, start_serve};

/// The services, in the order they are started.
pub const SERVICES: [&str; 4] = [
    "run-store",
    "credential-health",
    "stream-recovery",
    "sandbox-reconciler",
];

pub const TOKEN: &str = "split-operator-token-0123456789abcdef012345";
const RECEIPT_KEY: &str = "0202020202020202020202020202020202020202020202020202020202020202";

/// Four `runplane serve` processes and what they run on; all stop when dropped.
pub struct Split {
    pub processes: HashMap<&'static str, Process>,
    addrs: HashMap<&'static str, String>,
    _databases: Vec<TestDatabase>,
    _redis: TestRedis,
}

impl Split {
    /// Starts the four services. `config` (a TOML file, e.g. with profiles) is read by
    /// every process; `env` adds `RUNPLANE_*` overrides; sandboxes' state lives in
    /// `state_dir`.
    pub async fn start(config: Option<&Path>, state_dir: &Path, env: &[(&str, &str)]) -> Self {
        Self::start_each(config, state_dir, env, |_| Vec::new()).await
    }

    /// [`Split::start`], with `each(service)` adding overrides for that service's process
    /// alone (its own token, say).
    pub async fn start_each(
        config: Option<&Path>,
        state_dir: &Path,
        env: &[(&str, &str)],
        each: impl Fn(&str) -> Vec<(String, String)>,
    ) -> Self {
        let databases = vec![
            TestDatabase::new().await,
            TestDatabase::new().await,
            TestDatabase::new().await,
        ];
        let redis = TestRedis::new().await;
        let addrs: HashMap<&'static str, String> = SERVICES
            .into_iter()
            .map(|s| (s, free_local_addr().to_string()))
            .collect();
        let url = |s: &str| format!("http://{}", addrs[s]);
        let mut common: Vec<(String, String)> = vec![
            ("RUNPLANE_AUTH__OPERATOR_TOKEN".into(), TOKEN.into()),
            (
                "RUNPLANE_RUN_STORE__DATABASE_URL".into(),
                databases[0].url().into(),
            ),
            (
                "RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY".into(),
                RECEIPT_KEY.into(),
            ),
            ("RUNPLANE_RUN_STORE__ENDPOINT".into(), url("run-store")),
            (
                "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL".into(),
                databases[1].url().into(),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__ENDPOINT".into(),
                url("sandbox-reconciler"),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR".into(),
                state_dir.display().to_string(),
            ),
            (
                "RUNPLANE_SANDBOX_RECONCILER__TICK_INTERVAL_MS".into(),
                "200".into(),
            ),
            (
                "RUNPLANE_STREAM_RECOVERY__REDIS_URL".into(),
                redis.url().into(),
            ),
            (
                "RUNPLANE_STREAM_RECOVERY__KEY_PREFIX".into(),
                redis.prefix().into(),
            ),
            (
                "RUNPLANE_STREAM_RECOVERY__ENDPOINT".into(),
                url("stream-recovery"),
            ),
            (
                "RUNPLANE_CREDENTIAL_HEALTH__DATABASE_URL".into(),
                databases[2].url().into(),
            ),
            (
                "RUNPLANE_CREDENTIAL_HEALTH__ENDPOINT".into(),
                url("credential-health"),
            ),
        ];
        if let Some(config) = config {
            common.push(("RUNPLANE_CONFIG".into(), config.display().to_string()));
        }
        for (k, v) in env {
            common.push(((*k).into(), (*v).into()));
        }
        let mut processes = HashMap::new();
        for service in SERVICES {
            let own = each(service);
            let mut env: Vec<(&str, &str)> = common
                .iter()
                .chain(&own)
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            env.push(("RUNPLANE_SERVER__LISTEN", addrs[service].as_str()));
            processes.insert(service, start_serve(&[service], &env).await);
        }
        Self {
            processes,
            addrs,
            _databases: databases,
            _redis: redis,
        }
    }

    /// `http://ADDR` of `service`.
    pub fn url(&self, service: &str) -> String {
        format!("http://{}", self.addrs[service])
    }
}
