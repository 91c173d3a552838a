//! The gate the credential-health suites run through: real runs on a real run store and
//! a real credential health, over one gRPC socket. Failures travel the real path: the
//! runner's SubmitResult or turn_failed event → the run store's outbox →
//! ReportTurnFailure → classification and policy → MarkBackendError (credential health's
//! outbox) → the run's durable outcome; admission is asked by the run store's CreateRun.
//! Outbox delivery is driven by hand so each step is deterministic; the clock is manual.

// Each test binary uses only some of these.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::{Config, ProfileConfig, Secret};
use runplane_credential_health::CredentialHealth;
use runplane_grpc::client::Bearer;
use runplane_grpc::{ServiceSet, error_info};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_testkit::Backend;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub const TOKEN: &str = "gate-service-token-0123456789abcdef0123";
pub const ACME_TOKEN: &str = "gate-acme-org-token-0123456789abcdef01";
pub const GLOBEX_TOKEN: &str = "gate-globex-org-token-0123456789abcdef";
pub const OUTAGE: &str = "thinking…\nAPI Error: No response from API\n";
pub const SPENT: &str = "Error: Your credit balance is too low to access the API\n";

pub type RunClient = RunServiceClient<InterceptedService<Channel, Bearer>>;
pub type HealthClient = CredentialHealthServiceClient<InterceptedService<Channel, Bearer>>;

pub struct Gate {
    pub endpoint: String,
    pub config: Config,
    pub run_store: RunStore,
    pub health: CredentialHealth,
    pub clock: ManualClock,
    pub _stop: tokio::sync::oneshot::Sender<()>,
    pub _dbs: (Backend, Backend),
}

/// A profile on `credential` owned by org `acme`, whose runs these tests make: the
/// seed's outage and exhaustion rules hold on it as written. A credential shared by
/// several orgs is `owned(name, credential, &[])`.
pub fn profile(name: &str, credential: &str) -> ProfileConfig {
    ProfileConfig {
        name: name.into(),
        credential_id: credential.into(),
        capacity: 4,
        orgs: vec!["acme".into()],
        ..ProfileConfig::default()
    }
}

impl Gate {
    pub async fn start(health_db: Backend) -> Self {
        Self::with_profiles(
            health_db,
            vec![profile("sonnet", "cred-a"), profile("opus", "cred-b")],
        )
        .await
    }

    /// Two profiles of one name on two credentials.
    pub async fn two_pools(health_db: Backend) -> Self {
        Self::with_profiles(
            health_db,
            vec![profile("sonnet", "cred-a"), profile("sonnet", "cred-b")],
        )
        .await
    }

    pub async fn with_profiles(health_db: Backend, profiles: Vec<ProfileConfig>) -> Self {
        Self::with_config(health_db, profiles, |_| {}).await
    }

    /// Credential health over `health_db`, with a run store on a database of the same
    /// kind.
    pub async fn with_config(
        health_db: Backend,
        profiles: Vec<ProfileConfig>,
        tune: impl FnOnce(&mut Config),
    ) -> Self {
        let run_db = match health_db {
            Backend::Sqlite(_) => Backend::sqlite().await,
            _ => Backend::postgres().await,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let mut config = runplane_testkit::config::with_operator(TOKEN);
        config.run_store.database_url = run_db.url();
        config.run_store.endpoint = endpoint.clone();
        config.run_store.receipt_signing_key =
            Secret::new(runplane_testkit::config::fresh_receipt_seed());
        config.credential_health.database_url = health_db.url();
        config.credential_health.endpoint = endpoint.clone();
        config.credential_health.profiles = profiles;
        tune(&mut config);
        config.validate().unwrap();
        let clock = ManualClock::new(chrono::Utc::now());
        let shared: runplane_clock::SharedClock = Arc::new(clock.clone());
        let run_store = RunStore::open(&config, shared.clone()).await.unwrap();
        let health = CredentialHealth::open(&config, shared).await.unwrap();
        let mut services = ServiceSet::new();
        run_store.register(&mut services);
        health.register(&mut services);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Self {
            endpoint,
            config,
            run_store,
            health,
            clock,
            _stop: stop,
            _dbs: (run_db, health_db),
        }
    }

    /// Two orgs with their own tokens: acme owns cred-a, globex owns cred-g, cred-s is shared.
    pub async fn two_orgs(health_db: Backend) -> Self {
        Gate::with_config(
            health_db,
            vec![
                owned("sonnet", "cred-a", &["acme"]),
                owned("sonnet", "cred-g", &["globex"]),
                owned("opus", "cred-a", &["acme"]),
                owned("shared", "cred-s", &[]),
            ],
            |config| {
                config
                    .auth
                    .org_tokens
                    .insert("acme".into(), Secret::new(ACME_TOKEN));
                config
                    .auth
                    .org_tokens
                    .insert("globex".into(), Secret::new(GLOBEX_TOKEN));
            },
        )
        .await
    }

    /// A second credential-health replica on the same database, on its own socket.
    pub async fn health_replica(&self) -> String {
        let health = CredentialHealth::open(&self.config, Arc::new(self.clock.clone()))
            .await
            .unwrap();
        let mut services = ServiceSet::new();
        health.register(&mut services);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        endpoint
    }

    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn runs(&self) -> RunClient {
        self.runs_as(TOKEN).await
    }

    pub async fn runs_as(&self, token: &str) -> RunClient {
        RunServiceClient::with_interceptor(self.channel().await, Bearer::new(token))
    }

    pub async fn credentials(&self) -> HealthClient {
        self.credentials_as(TOKEN).await
    }

    pub async fn credentials_as(&self, token: &str) -> HealthClient {
        CredentialHealthServiceClient::with_interceptor(self.channel().await, Bearer::new(token))
    }

    pub async fn create(
        &self,
        request_id: &str,
        lead: &str,
        target: runstore_pb::create_run_request::Target,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.create_as(TOKEN, "acme", request_id, lead, target)
            .await
    }

    /// CreateRun with `token` for a run of `org`.
    pub async fn create_as(
        &self,
        token: &str,
        org: &str,
        request_id: &str,
        lead: &str,
        target: runstore_pb::create_run_request::Target,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.runs_as(token)
            .await
            .create_run(runstore_pb::CreateRunRequest {
                client_request_id: format!("{request_id:0>16}"),
                org_id: org.into(),
                lead_id: lead.into(),
                target: Some(target),
                command: "agent".into(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().run.unwrap())
    }

    /// A run on `credential` whose runner said Hello; returns its id and key.
    pub async fn running(
        &self,
        request_id: &str,
        lead: &str,
        credential: &str,
    ) -> (String, String) {
        self.running_in("acme", request_id, lead, credential).await
    }

    /// A run of `org` on `credential` whose runner said Hello.
    pub async fn running_in(
        &self,
        org: &str,
        request_id: &str,
        lead: &str,
        credential: &str,
    ) -> (String, String) {
        let run = self
            .create_as(TOKEN, org, request_id, lead, credential_target(credential))
            .await
            .expect("admitted");
        self.start_run(&run.id).await
    }

    pub async fn start_run(&self, run_id: &str) -> (String, String) {
        let key = self
            .runs()
            .await
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: run_id.into(),
                sandbox_id: "sbx-gate".into(),
                sandbox_generation: 1,
                idempotency_key: format!("sbx-gate:{run_id}:issue"),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .run_key;
        self.runner(&key)
            .await
            .hello(runstore_pb::HelloRequest {
                run_id: run_id.into(),
                nonce: "gate-runner-nonce-0001".into(),
                runner_version: "test".into(),
            })
            .await
            .unwrap();
        (run_id.to_owned(), key)
    }

    pub async fn runner(
        &self,
        key: &str,
    ) -> RunnerServiceClient<InterceptedService<Channel, Bearer>> {
        RunnerServiceClient::with_interceptor(self.channel().await, Bearer::new(key))
    }

    /// The runner ends the run as failed with `tail` as its failure tail.
    pub async fn fail(
        &self,
        run: &(String, String),
        tail: &str,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.submit(run, failed(), tail).await
    }

    pub async fn submit(
        &self,
        (run_id, key): &(String, String),
        verdict: runstore_pb::Verdict,
        tail: &str,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.runner(key)
            .await
            .submit_result(runstore_pb::SubmitResultRequest {
                run_id: run_id.clone(),
                verdict: Some(verdict),
                failure_tail: tail.into(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().run.unwrap())
    }

    /// The runner reports a failed turn (the run goes on).
    pub async fn turn_failed(&self, (run_id, key): &(String, String), batch: &str, tail: &str) {
        self.runner(key)
            .await
            .append_events(runstore_pb::AppendEventsRequest {
                run_id: run_id.clone(),
                batch_key: format!("{batch:0>16}"),
                events: vec![runstore_pb::EventInput {
                    kind: runstore_pb::EventKind::TurnFailed as i32,
                    text: tail.into(),
                    ..Default::default()
                }],
            })
            .await
            .expect("turn_failed appended");
    }

    /// Delivers both outboxes until nothing is left to deliver: run store → credential
    /// health, then credential health → run store.
    pub async fn settle(&self) {
        loop {
            let reported = self.run_store.deliver_outbox().await.unwrap();
            let marked = self.health.deliver_outbox(100).await.unwrap();
            if reported == 0 && marked == 0 {
                return;
            }
        }
    }

    pub async fn get(&self, run_id: &str) -> runstore_pb::Run {
        self.runs()
            .await
            .get_run(runstore_pb::GetRunRequest {
                run_id: run_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap()
    }

    pub async fn fleet(&self) -> credentials_pb::GetFleetResponse {
        self.credentials()
            .await
            .get_fleet(credentials_pb::GetFleetRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn credential(&self, id: &str) -> credentials_pb::CredentialHealth {
        self.fleet()
            .await
            .credentials
            .into_iter()
            .find(|c| c.credential_id == id)
            .unwrap()
    }

    /// Every notice `lead` of acme can read now (the watch is cut once it is idle).
    pub async fn notices(
        &self,
        lead: &str,
        after: &str,
    ) -> Vec<credentials_pb::watch_notices_response::Item> {
        self.notices_as(TOKEN, "acme", lead, after).await.unwrap()
    }

    /// Every notice `lead` of `org` can read now, asked with `token`.
    pub async fn notices_as(
        &self,
        token: &str,
        org: &str,
        lead: &str,
        after: &str,
    ) -> Result<Vec<credentials_pb::watch_notices_response::Item>, tonic::Status> {
        let mut stream = self
            .credentials_as(token)
            .await
            .watch_notices(credentials_pb::WatchNoticesRequest {
                lead_id: lead.into(),
                after_cursor: after.into(),
                org_id: org.into(),
                heartbeat_interval: None,
            })
            .await?
            .into_inner();
        let mut items = Vec::new();
        while let Ok(Ok(Some(next))) =
            tokio::time::timeout(Duration::from_millis(300), stream.message()).await
        {
            items.push(next.item.unwrap());
        }
        Ok(items)
    }
}

pub fn credential_target(c: &str) -> runstore_pb::create_run_request::Target {
    runstore_pb::create_run_request::Target::CredentialId(c.into())
}

pub fn profile_target(p: &str) -> runstore_pb::create_run_request::Target {
    runstore_pb::create_run_request::Target::Profile(p.into())
}

pub fn failed() -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: "exit_nonzero".into(),
        exit_code: Some(1),
        ..Default::default()
    }
}

pub fn succeeded() -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
        reason: "exit_zero".into(),
        exit_code: Some(0),
        ..Default::default()
    }
}

pub fn reason(status: &tonic::Status) -> String {
    error_info(status).map(|i| i.reason).unwrap_or_default()
}

pub fn metadata(status: &tonic::Status, key: &str) -> String {
    error_info(status)
        .and_then(|i| i.metadata.get(key).cloned())
        .unwrap_or_default()
}

pub fn notices_only(
    items: &[credentials_pb::watch_notices_response::Item],
) -> Vec<credentials_pb::Notice> {
    items
        .iter()
        .filter_map(|i| match i {
            credentials_pb::watch_notices_response::Item::Notice(n) => Some(n.clone()),
            credentials_pb::watch_notices_response::Item::Gap(_)
            | credentials_pb::watch_notices_response::Item::Heartbeat(_) => None,
        })
        .collect()
}

pub fn owned(name: &str, credential: &str, orgs: &[&str]) -> ProfileConfig {
    ProfileConfig {
        orgs: orgs.iter().map(|o| o.to_string()).collect(),
        ..profile(name, credential)
    }
}

/// Serves `services` on `listener` until the returned sender is dropped or fired.
pub fn serve(
    listener: tokio::net::TcpListener,
    services: ServiceSet,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<runplane_grpc::Stopped, runplane_grpc::server::ServeError>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(runplane_grpc::serve(
        listener,
        services,
        async {
            let _ = stopped.await;
        },
        Duration::from_millis(200),
    ));
    (stop, served)
}
