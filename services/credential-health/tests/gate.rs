//! Credential health through the gate: real runs on a real run store and a real
//! credential health, both on Postgres, over one gRPC socket. Failures travel the real
//! path: the runner's SubmitResult or turn_failed event → the run store's outbox →
//! ReportTurnFailure → classification and policy → MarkBackendError (credential health's
//! outbox) → the run's durable outcome; admission is asked by the run store's CreateRun.
//! Outbox delivery is driven by hand so each step is deterministic; the clock is manual.

use std::sync::Arc;
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::{Config, ProfileConfig, Secret};
use runplane_credential_health::CredentialHealth;
use runplane_grpc::client::Bearer;
use runplane_grpc::{ErrorReason, ServiceSet, error_info};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_testkit::{Backend, TestDatabase};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const TOKEN: &str = "gate-service-token-0123456789abcdef0123";
const ACME_TOKEN: &str = "gate-acme-org-token-0123456789abcdef01";
const GLOBEX_TOKEN: &str = "gate-globex-org-token-0123456789abcdef";
const OUTAGE: &str = "thinking…\nAPI Error: No response from API\n";
const SPENT: &str = "Error: Your credit balance is too low to access the API\n";

type RunClient = RunServiceClient<InterceptedService<Channel, Bearer>>;
type HealthClient = CredentialHealthServiceClient<InterceptedService<Channel, Bearer>>;

struct Gate {
    endpoint: String,
    config: Config,
    run_store: RunStore,
    health: CredentialHealth,
    clock: ManualClock,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dbs: (Backend, Backend),
}

fn profile(name: &str, credential: &str) -> ProfileConfig {
    ProfileConfig {
        name: name.into(),
        credential_id: credential.into(),
        capacity: 4,
        ..ProfileConfig::default()
    }
}

impl Gate {
    async fn start(health_db: Backend) -> Self {
        Self::with_profiles(
            health_db,
            vec![profile("sonnet", "cred-a"), profile("opus", "cred-b")],
        )
        .await
    }

    /// Two profiles of one name on two credentials.
    async fn two_pools(health_db: Backend) -> Self {
        Self::with_profiles(
            health_db,
            vec![profile("sonnet", "cred-a"), profile("sonnet", "cred-b")],
        )
        .await
    }

    async fn with_profiles(health_db: Backend, profiles: Vec<ProfileConfig>) -> Self {
        Self::with_config(health_db, profiles, |_| {}).await
    }

    /// Credential health over `health_db`, with a run store on a database of the same
    /// kind.
    async fn with_config(
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
        let mut config = Config::default();
        config.auth.operator_token = Secret::new(TOKEN);
        config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
        config.run_store.database_url = run_db.url();
        config.run_store.endpoint = endpoint.clone();
        config.run_store.receipt_signing_key =
            Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
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
    async fn two_orgs(health_db: Backend) -> Self {
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
    async fn health_replica(&self) -> String {
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

    async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn runs(&self) -> RunClient {
        self.runs_as(TOKEN).await
    }

    async fn runs_as(&self, token: &str) -> RunClient {
        RunServiceClient::with_interceptor(self.channel().await, Bearer::new(token))
    }

    async fn credentials(&self) -> HealthClient {
        self.credentials_as(TOKEN).await
    }

    async fn credentials_as(&self, token: &str) -> HealthClient {
        CredentialHealthServiceClient::with_interceptor(self.channel().await, Bearer::new(token))
    }

    async fn create(
        &self,
        request_id: &str,
        lead: &str,
        target: runstore_pb::create_run_request::Target,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.create_as(TOKEN, "acme", request_id, lead, target)
            .await
    }

    /// CreateRun with `token` for a run of `org`.
    async fn create_as(
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
    async fn running(&self, request_id: &str, lead: &str, credential: &str) -> (String, String) {
        self.running_in("acme", request_id, lead, credential).await
    }

    /// A run of `org` on `credential` whose runner said Hello.
    async fn running_in(
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

    async fn start_run(&self, run_id: &str) -> (String, String) {
        let key = self
            .runs()
            .await
            .issue_run_key(runstore_pb::IssueRunKeyRequest {
                run_id: run_id.into(),
                sandbox_id: "sbx-gate".into(),
                sandbox_generation: 1,
                idempotency_key: format!("sbx-gate:{run_id}:issue"),
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

    async fn runner(&self, key: &str) -> RunnerServiceClient<InterceptedService<Channel, Bearer>> {
        RunnerServiceClient::with_interceptor(self.channel().await, Bearer::new(key))
    }

    /// The runner ends the run as failed with `tail` as its failure tail.
    async fn fail(
        &self,
        run: &(String, String),
        tail: &str,
    ) -> Result<runstore_pb::Run, tonic::Status> {
        self.submit(run, failed(), tail).await
    }

    async fn submit(
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
    async fn turn_failed(&self, (run_id, key): &(String, String), batch: &str, tail: &str) {
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
    async fn settle(&self) {
        loop {
            let reported = self.run_store.deliver_outbox().await.unwrap();
            let marked = self.health.deliver_outbox(100).await.unwrap();
            if reported == 0 && marked == 0 {
                return;
            }
        }
    }

    async fn get(&self, run_id: &str) -> runstore_pb::Run {
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

    async fn fleet(&self) -> credentials_pb::GetFleetResponse {
        self.credentials()
            .await
            .get_fleet(credentials_pb::GetFleetRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    async fn credential(&self, id: &str) -> credentials_pb::CredentialHealth {
        self.fleet()
            .await
            .credentials
            .into_iter()
            .find(|c| c.credential_id == id)
            .unwrap()
    }

    /// Every notice `lead` of acme can read now (the watch is cut once it is idle).
    async fn notices(
        &self,
        lead: &str,
        after: &str,
    ) -> Vec<credentials_pb::watch_notices_response::Item> {
        self.notices_as(TOKEN, "acme", lead, after).await.unwrap()
    }

    /// Every notice `lead` of `org` can read now, asked with `token`.
    async fn notices_as(
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

/// A lead watching its notices on one replica is woken by a notice another replica
/// created (NOTIFY), well before the 30 s re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_reaches_a_watcher_on_another_replica_at_once() {
    let gate = Gate::start(Backend::postgres().await).await;
    let replica = gate.health_replica().await;
    let channel = tonic::transport::Endpoint::from_shared(replica)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut watch = CredentialHealthServiceClient::with_interceptor(channel, Bearer::new(TOKEN))
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-1".into(),
            org_id: "acme".into(),
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let a = gate.running("replica-outage-a", "lead-1", "cred-a").await;
    let b = gate.running("replica-outage-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.clock.advance(Duration::from_secs(20));
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    let notice = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let item = watch
                .message()
                .await
                .unwrap()
                .expect("the watch stays open");
            if let Some(credentials_pb::watch_notices_response::Item::Notice(n)) = item.item {
                return n;
            }
        }
    })
    .await
    .expect("the other replica's notice woke this watcher within 10 s");
    assert_eq!(notice.credential_id, "cred-a");
}

fn credential_target(c: &str) -> runstore_pb::create_run_request::Target {
    runstore_pb::create_run_request::Target::CredentialId(c.into())
}

fn profile_target(p: &str) -> runstore_pb::create_run_request::Target {
    runstore_pb::create_run_request::Target::Profile(p.into())
}

fn failed() -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Failed as i32,
        reason: "exit_nonzero".into(),
        exit_code: Some(1),
        ..Default::default()
    }
}

fn succeeded() -> runstore_pb::Verdict {
    runstore_pb::Verdict {
        outcome: runstore_pb::VerdictOutcome::Succeeded as i32,
        reason: "exit_zero".into(),
        exit_code: Some(0),
        ..Default::default()
    }
}

fn reason(status: &tonic::Status) -> String {
    error_info(status).map(|i| i.reason).unwrap_or_default()
}

fn metadata(status: &tonic::Status, key: &str) -> String {
    error_info(status)
        .and_then(|i| i.metadata.get(key).cloned())
        .unwrap_or_default()
}

fn notices_only(
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

async fn two_runs_failing_on_one_credential_refuse_the_next_run_mark_both_and_tell_the_lead_once(
    gate: Gate,
) {
    let a = gate.running("outage-a", "lead-1", "cred-a").await;
    let b = gate.running("outage-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.clock.advance(Duration::from_secs(20));
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;

    gate.clock.advance(Duration::from_secs(18));
    let refused = gate
        .create("outage-c", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "42");
    assert_eq!(metadata(&refused, "quarantined_for_seconds"), "0");
    assert!(
        refused
            .message()
            .contains("cooling off after repeated backend errors, 42 s left"),
        "{}",
        refused.message()
    );
    // The refused request stored nothing: the roster still holds two runs.
    let roster = gate
        .runs()
        .await
        .list_runs(runstore_pb::ListRunsRequest {
            lead_id: "lead-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(roster.len(), 2);
    for run in &roster {
        assert_eq!(run.state(), runstore_pb::RunState::BackendError, "{run:?}");
        assert_eq!(run.failure_reason, "API Error: No response from API");
        let outcome = run.backend_error.as_ref().unwrap();
        assert_eq!(outcome.kind(), runstore_pb::BackendErrorKind::Error);
        assert_eq!(outcome.credential_id, "cred-a");
    }
    // A replay of a request admitted before the outage gets its run back, not a refusal.
    let replayed = gate
        .create("outage-a", "lead-1", credential_target("cred-a"))
        .await
        .expect("a replay is not asked again");
    assert_eq!(replayed.id, a.0);
    // Another credential is unaffected.
    gate.create("other-cred", "lead-1", credential_target("cred-b"))
        .await
        .unwrap();

    let health = gate.credential("cred-a").await;
    assert_eq!(
        (
            health.free,
            health.cooling_off_for_seconds,
            health.quarantined_for_seconds
        ),
        (0, 42, 0)
    );
    let incident = health.open_incident.unwrap();
    assert_eq!(incident.opening_run_ids.len(), 2);

    let notices = notices_only(&gate.notices("lead-1", "").await);
    assert_eq!(notices.len(), 1, "{notices:?}");
    let notice = &notices[0];
    assert_eq!(notice.kind(), credentials_pb::NoticeKind::IncidentOpened);
    assert_eq!(notice.credential_id, "cred-a");
    assert_eq!(notice.incident_id, incident.id);
    let mut affected = notice.affected_run_ids.clone();
    affected.sort();
    let mut expected = vec![a.0.clone(), b.0.clone()];
    expected.sort();
    assert_eq!(affected, expected);
    assert_eq!(notice.cooling_off_for_seconds, 60);
}

fn owned(name: &str, credential: &str, orgs: &[&str]) -> ProfileConfig {
    ProfileConfig {
        orgs: orgs.iter().map(|o| o.to_string()).collect(),
        ..profile(name, credential)
    }
}

async fn an_org_token_cannot_use_another_orgs_credential(gate: Gate) {
    // Named directly, or through a profile whose every credential is acme's.
    for (i, target) in [credential_target("cred-a"), profile_target("opus")]
        .into_iter()
        .enumerate()
    {
        let refused = gate
            .create_as(
                GLOBEX_TOKEN,
                "globex",
                &format!("not-ours-{i}"),
                "lead-1",
                target,
            )
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert_eq!(
            reason(&refused),
            ErrorReason::CredentialNotOwned.as_str_name()
        );
        assert_eq!(metadata(&refused, "org_id"), "globex");
    }
    // Refused before anything was stored: globex has no runs.
    let listed = gate
        .runs_as(GLOBEX_TOKEN)
        .await
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert!(listed.is_empty(), "{listed:?}");
    // A pool spanning both orgs places globex only on its own credential, even when
    // acme's has more free slots.
    for i in 0..3 {
        let run = gate
            .create_as(
                GLOBEX_TOKEN,
                "globex",
                &format!("pool-{i}"),
                "lead-1",
                profile_target("sonnet"),
            )
            .await
            .unwrap();
        assert_eq!(run.credential_id, "cred-g");
        gate.start_run(&run.id).await;
    }
    // A shared credential and the org's own are usable.
    gate.create_as(
        GLOBEX_TOKEN,
        "globex",
        "shared-1",
        "lead-1",
        credential_target("cred-s"),
    )
    .await
    .unwrap();
    gate.create_as(
        ACME_TOKEN,
        "acme",
        "own-1",
        "lead-1",
        credential_target("cred-a"),
    )
    .await
    .unwrap();
    // The operator token creating a run for globex is held to globex's credentials too.
    let refused = gate
        .create_as(
            TOKEN,
            "globex",
            "operator-1",
            "lead-1",
            credential_target("cred-a"),
        )
        .await
        .unwrap_err();
    assert_eq!(
        reason(&refused),
        ErrorReason::CredentialNotOwned.as_str_name()
    );
}

async fn notices_of_two_orgs_with_the_same_lead_id_do_not_mix(gate: Gate) {
    // acme's lead-1 opens an incident on the shared credential; globex's lead-1 fails
    // on it during the cool-off and is a lead of its own, told once.
    let a = gate.running_in("acme", "mix-a", "lead-1", "cred-s").await;
    let b = gate.running_in("acme", "mix-b", "lead-1", "cred-s").await;
    let g = gate.running_in("globex", "mix-g", "lead-1", "cred-s").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    gate.fail(&g, OUTAGE).await.unwrap();
    gate.settle().await;

    let acme = notices_only(&gate.notices_as(ACME_TOKEN, "", "lead-1", "").await.unwrap());
    assert_eq!(acme.len(), 1, "{acme:?}");
    assert_eq!(acme[0].org_id, "acme");
    let mut affected = acme[0].affected_run_ids.clone();
    affected.sort();
    let mut expected = vec![a.0.clone(), b.0.clone()];
    expected.sort();
    assert_eq!(affected, expected);

    let globex = notices_only(
        &gate
            .notices_as(GLOBEX_TOKEN, "", "lead-1", "")
            .await
            .unwrap(),
    );
    assert_eq!(globex.len(), 1, "{globex:?}");
    assert_eq!(globex[0].org_id, "globex");
    assert_eq!(globex[0].affected_run_ids, vec![g.0.clone()]);
    assert_eq!(globex[0].incident_id, acme[0].incident_id);

    // The operator names the org; an org token cannot name another.
    let by_operator = notices_only(
        &gate
            .notices_as(TOKEN, "globex", "lead-1", "")
            .await
            .unwrap(),
    );
    assert_eq!(by_operator, globex);
    let denied = gate
        .notices_as(ACME_TOKEN, "globex", "lead-1", "")
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    let unnamed = gate.notices_as(TOKEN, "", "lead-1", "").await.unwrap_err();
    assert_eq!(unnamed.code(), tonic::Code::InvalidArgument, "{unnamed:?}");
    // An org token is no service token: it cannot read the fleet (or report failures).
    let fleet = gate
        .credentials_as(ACME_TOKEN)
        .await
        .get_fleet(credentials_pb::GetFleetRequest::default())
        .await
        .unwrap_err();
    assert_eq!(fleet.code(), tonic::Code::PermissionDenied, "{fleet:?}");
}

async fn one_failure_changes_nothing_but_the_runs_own_outcome(gate: Gate) {
    let a = gate.running("single-a", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.settle().await;

    assert_eq!(
        gate.get(&a.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    gate.create("single-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one failure does not cool anything off");
    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 0);
    assert!(health.open_incident.is_none());
    assert!(gate.notices("lead-1", "").await.is_empty());
}

async fn the_same_run_failing_repeatedly_is_not_an_incident(gate: Gate) {
    let a = gate.running("repeat-a", "lead-1", "cred-a").await;
    // Three failed turns of one run reach credential health before its outcome is
    // recorded: one target, however often it fails.
    gate.turn_failed(&a, "turn-1", OUTAGE).await;
    gate.clock.advance(Duration::from_secs(5));
    gate.turn_failed(&a, "turn-2", OUTAGE).await;
    gate.clock.advance(Duration::from_secs(5));
    gate.turn_failed(&a, "turn-3", OUTAGE).await;
    gate.settle().await;

    assert_eq!(
        gate.get(&a.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 0, "{health:?}");
    assert!(health.open_incident.is_none());
    assert!(gate.notices("lead-1", "").await.is_empty());
    gate.create("repeat-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one run failing repeatedly does not cool its credential off");
}

async fn after_the_cool_off_one_fresh_error_does_not_reopen_and_two_do(gate: Gate) {
    let a = gate.running("cool-a", "lead-1", "cred-a").await;
    let b = gate.running("cool-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    assert!(
        gate.create("cool-during", "lead-1", credential_target("cred-a"))
            .await
            .is_err()
    );

    gate.clock.advance(Duration::from_secs(60));
    let c = gate.running("cool-c", "lead-1", "cred-a").await;
    gate.fail(&c, OUTAGE).await.unwrap();
    gate.settle().await;
    assert_eq!(
        gate.get(&c.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    gate.create("cool-after-one", "lead-1", credential_target("cred-a"))
        .await
        .expect("the expired incident's evidence is gone: one fresh error is not an outage");

    let d = gate.running("cool-d", "lead-1", "cred-a").await;
    gate.clock.advance(Duration::from_secs(10));
    gate.fail(&d, OUTAGE).await.unwrap();
    gate.settle().await;
    let refused = gate
        .create("cool-after-two", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());

    let incidents = gate
        .credentials()
        .await
        .list_incidents(credentials_pb::ListIncidentsRequest {
            credential_id: "cred-a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .incidents;
    assert_eq!(incidents.len(), 2, "{incidents:?}");
    assert_eq!(incidents[0].state(), credentials_pb::IncidentState::Open);
    assert_eq!(incidents[1].state(), credentials_pb::IncidentState::Closed);
    // The lead heard of each incident once.
    assert_eq!(notices_only(&gate.notices("lead-1", "").await).len(), 2);
}

async fn errors_during_the_cool_off_neither_extend_it_nor_open_another_incident(gate: Gate) {
    let runs = [
        gate.running("during-a", "lead-1", "cred-a").await,
        gate.running("during-b", "lead-1", "cred-a").await,
        gate.running("during-c", "lead-1", "cred-a").await,
        gate.running("during-d", "lead-2", "cred-a").await,
    ];
    gate.fail(&runs[0], OUTAGE).await.unwrap();
    gate.fail(&runs[1], OUTAGE).await.unwrap();
    gate.settle().await;
    gate.clock.advance(Duration::from_secs(30));
    gate.fail(&runs[2], OUTAGE).await.unwrap();
    gate.fail(&runs[3], OUTAGE).await.unwrap();
    gate.settle().await;

    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 30, "not extended");
    let incident = health.open_incident.unwrap();
    assert_eq!(incident.failures_during_cool_off, 2);
    let incidents = gate
        .credentials()
        .await
        .list_incidents(credentials_pb::ListIncidentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .incidents;
    assert_eq!(incidents.len(), 1);
    // Every run carries its backend_error; the one that opened the incident and the
    // absorbed ones name it (the first was recorded before the incident existed, and
    // the incident lists it among its opening runs).
    for (i, run) in runs.iter().enumerate() {
        let run = gate.get(&run.0).await;
        assert_eq!(run.state(), runstore_pb::RunState::BackendError);
        let named = run.backend_error.unwrap().incident_id;
        assert_eq!(
            named,
            if i == 0 {
                String::new()
            } else {
                incident.id.clone()
            }
        );
    }
    assert!(incident.opening_run_ids.contains(&runs[0].0));
    // lead-1 was told once; lead-2, whose run failed during the cool-off, once too.
    assert_eq!(notices_only(&gate.notices("lead-1", "").await).len(), 1);
    let lead2 = notices_only(&gate.notices("lead-2", "").await);
    assert_eq!(lead2.len(), 1);
    assert_eq!(lead2[0].affected_run_ids, vec![runs[3].0.clone()]);
}

async fn exhaustion_and_cool_off_together_report_both_and_refuse_as_exhausted(gate: Gate) {
    let a = gate.running("both-a", "lead-1", "cred-a").await;
    let b = gate.running("both-b", "lead-1", "cred-a").await;
    let c = gate.running("both-c", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.fail(&c, SPENT).await.unwrap();
    gate.settle().await;

    let health = gate.credential("cred-a").await;
    assert_eq!(health.cooling_off_for_seconds, 60);
    assert_eq!(health.quarantined_for_seconds, 1800);
    assert_eq!(health.free, 0);
    let refused = gate
        .create("both-next", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&refused), ErrorReason::Exhausted.as_str_name());
    assert_eq!(metadata(&refused, "quarantined_for_seconds"), "1800");
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "60");
    assert!(
        refused.message().contains("exhausted"),
        "{}",
        refused.message()
    );
    let c = gate.get(&c.0).await;
    assert_eq!(
        c.backend_error.unwrap().kind(),
        runstore_pb::BackendErrorKind::Exhausted
    );

    // After the cool-off, exhaustion alone still refuses; cool-off is not reported.
    gate.clock.advance(Duration::from_secs(61));
    let health = gate.credential("cred-a").await;
    assert_eq!(
        (
            health.cooling_off_for_seconds,
            health.quarantined_for_seconds
        ),
        (0, 1739)
    );
    let refused = gate
        .create("both-later", "lead-1", credential_target("cred-a"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::Exhausted.as_str_name());
}

async fn a_profile_is_placed_on_a_healthy_credential_and_refused_only_when_none_is(gate: Gate) {
    let a = gate.running("pool-a", "lead-1", "cred-a").await;
    let b = gate.running("pool-b", "lead-1", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    for i in 0..3 {
        let run = gate
            .create(
                &format!("pool-next-{i}"),
                "lead-1",
                profile_target("sonnet"),
            )
            .await
            .unwrap();
        assert_eq!(run.credential_id, "cred-b", "cooling-off cred-a is skipped");
        assert_eq!(run.profile, "sonnet");
    }
    let c = gate.running("pool-c", "lead-1", "cred-b").await;
    let d = gate.running("pool-d", "lead-1", "cred-b").await;
    gate.clock.advance(Duration::from_secs(10));
    gate.fail(&c, OUTAGE).await.unwrap();
    gate.fail(&d, OUTAGE).await.unwrap();
    gate.settle().await;
    let refused = gate
        .create("pool-none", "lead-1", profile_target("sonnet"))
        .await
        .unwrap_err();
    assert_eq!(reason(&refused), ErrorReason::CoolingOff.as_str_name());
    // cred-a frees first: 50 s left against cred-b's 60.
    assert_eq!(metadata(&refused, "credential_id"), "cred-a");
    assert_eq!(metadata(&refused, "cooling_off_for_seconds"), "50");

    let unknown = gate
        .create("pool-unknown", "lead-1", profile_target("haiku"))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    assert_eq!(reason(&unknown), ErrorReason::ProfileUnknown.as_str_name());
}

async fn a_run_that_finished_and_then_is_classified_ends_backend_error_either_way(gate: Gate) {
    // Done first: the run's failed result is recorded, then classified.
    let done_first = gate.running("race-done", "lead-1", "cred-a").await;
    let run = gate.fail(&done_first, OUTAGE).await.unwrap();
    assert_eq!(run.state(), runstore_pb::RunState::Failed);
    gate.settle().await;
    let run = gate.get(&done_first.0).await;
    assert_eq!(run.state(), runstore_pb::RunState::BackendError);
    assert_eq!(
        run.verdict.unwrap().outcome(),
        runstore_pb::VerdictOutcome::Failed
    );

    // Classified first: a failed turn's outcome lands while the run is running; the
    // runner's later verdict (even a success) cannot turn it back into done.
    let marked_first = gate.running("race-marked", "lead-1", "cred-a").await;
    gate.turn_failed(&marked_first, "race-turn", OUTAGE).await;
    gate.settle().await;
    assert_eq!(
        gate.get(&marked_first.0).await.state(),
        runstore_pb::RunState::BackendError
    );
    let late = gate
        .submit(&marked_first, succeeded(), "")
        .await
        .unwrap_err();
    assert_eq!(reason(&late), ErrorReason::RunTerminal.as_str_name());
    assert_eq!(
        gate.get(&marked_first.0).await.state(),
        runstore_pb::RunState::BackendError
    );

    // Truly at once: the outcome's delivery and the runner's verdict race on the run's
    // lock; whichever wins, the run ends backend_error.
    for i in 0..6 {
        // Past the window: each round's failure is the only evidence, so no incident
        // refuses the next round's run.
        gate.clock.advance(Duration::from_secs(61));
        let run = gate
            .running(&format!("race-both-{i}"), "lead-2", "cred-b")
            .await;
        gate.turn_failed(&run, &format!("race-both-turn-{i}"), OUTAGE)
            .await;
        gate.run_store.deliver_outbox().await.unwrap();
        let verdict = if i % 2 == 0 { succeeded() } else { failed() };
        let (_, submitted) = tokio::join!(
            gate.health.deliver_outbox(100),
            gate.submit(&run, verdict, if i % 2 == 0 { "" } else { OUTAGE })
        );
        let _ = submitted; // either recorded or refused as terminal
        gate.settle().await;
        let after = gate.get(&run.0).await;
        assert_eq!(
            after.state(),
            runstore_pb::RunState::BackendError,
            "round {i}: {after:?}"
        );
        assert_eq!(after.failure_reason, "API Error: No response from API");
    }
}

async fn notices_resume_from_a_cursor_and_follow_live(gate: Gate) {
    let mut watch = gate
        .credentials()
        .await
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-9".into(),
            after_cursor: String::new(),
            org_id: "acme".into(),
            // The longest interval: this test reads the notice as the first item.
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let a = gate.running("watch-a", "lead-9", "cred-a").await;
    let b = gate.running("watch-b", "lead-9", "cred-a").await;
    gate.fail(&a, OUTAGE).await.unwrap();
    gate.fail(&b, OUTAGE).await.unwrap();
    gate.settle().await;
    let live = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the live watcher is woken")
        .unwrap()
        .unwrap();
    let credentials_pb::watch_notices_response::Item::Notice(first) = live.item.unwrap() else {
        panic!("a notice")
    };
    assert_eq!(first.kind(), credentials_pb::NoticeKind::IncidentOpened);

    gate.clock.advance(Duration::from_secs(1));
    let c = gate.running("watch-c", "lead-9", "cred-b").await;
    gate.fail(&c, SPENT).await.unwrap();
    gate.settle().await;
    let resumed = notices_only(&gate.notices("lead-9", &first.cursor).await);
    assert_eq!(resumed.len(), 1, "only what came after the cursor");
    assert_eq!(
        resumed[0].kind(),
        credentials_pb::NoticeKind::CredentialQuarantined
    );
    assert_eq!(resumed[0].credential_id, "cred-b");
    assert_eq!(resumed[0].quarantined_for_seconds, 1800);

    let bad = gate
        .credentials()
        .await
        .watch_notices(credentials_pb::WatchNoticesRequest {
            lead_id: "lead-9".into(),
            after_cursor: "999999".into(),
            org_id: "acme".into(),
            heartbeat_interval: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&bad), ErrorReason::CursorInvalid.as_str_name());

    // Retention prunes the first notice: a watcher from the start hears of the gap.
    gate.health
        .store()
        .prune_notices({
            let at = first.created_at.as_ref().unwrap();
            at.seconds * 1000 + i64::from(at.nanos) / 1_000_000 + 1
        })
        .await
        .unwrap();
    let items = gate.notices("lead-9", "").await;
    assert!(
        matches!(
            items[0],
            credentials_pb::watch_notices_response::Item::Gap(credentials_pb::NoticesGap {
                missed: 1
            })
        ),
        "{items:?}"
    );
    assert_eq!(notices_only(&items).len(), 1);
}

async fn a_replayed_report_returns_the_first_answer_and_counts_once(gate: Gate) {
    let a = gate.running("replay-a", "lead-1", "cred-a").await;
    let report = credentials_pb::ReportTurnFailureRequest {
        turn_id: format!("{}:turn-7", a.0),
        run_id: a.0.clone(),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        credential_id: "cred-a".into(),
        failure_tail: OUTAGE.into(),
        ..Default::default()
    };
    let mut client = gate.credentials().await;
    let first = client
        .report_turn_failure(report.clone())
        .await
        .unwrap()
        .into_inner();
    gate.clock.advance(Duration::from_secs(1));
    let again = client
        .report_turn_failure(report.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first, again);
    assert_eq!(first.outcome(), credentials_pb::TurnOutcome::BackendError);
    assert_eq!(first.reason, "API Error: No response from API");
    // The same key with another body is refused, and nothing is written.
    let reused = client
        .report_turn_failure(credentials_pb::ReportTurnFailureRequest {
            failure_tail: "something else".into(),
            ..report.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(
        reason(&reused),
        ErrorReason::IdempotencyKeyReused.as_str_name()
    );
    gate.create("replay-next", "lead-1", credential_target("cred-a"))
        .await
        .expect("one run, however often reported, is not an incident");
}

async fn bad_reports_are_refused_with_a_reason_and_write_nothing(gate: Gate) {
    let mut client = gate.credentials().await;
    let good = credentials_pb::ReportTurnFailureRequest {
        turn_id: "run-x:turn-0000001".into(),
        run_id: "run-x".into(),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        credential_id: "cred-a".into(),
        failure_tail: OUTAGE.into(),
        ..Default::default()
    };
    let cases: Vec<(
        credentials_pb::ReportTurnFailureRequest,
        tonic::Code,
        ErrorReason,
    )> = vec![
        (
            credentials_pb::ReportTurnFailureRequest {
                turn_id: "short".into(),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                credential_id: String::new(),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                failure_tail: "x".repeat(8193),
                ..good.clone()
            },
            tonic::Code::InvalidArgument,
            ErrorReason::InvalidField,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                credential_id: "cred-nobody-names".into(),
                ..good.clone()
            },
            tonic::Code::NotFound,
            ErrorReason::CredentialUnknown,
        ),
        (
            credentials_pb::ReportTurnFailureRequest {
                profile: "haiku".into(),
                ..good.clone()
            },
            tonic::Code::NotFound,
            ErrorReason::ProfileUnknown,
        ),
    ];
    for (request, code, expected) in cases {
        let err = client.report_turn_failure(request).await.unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
        assert_eq!(reason(&err), expected.as_str_name(), "{err:?}");
    }
    let mut anonymous = CredentialHealthServiceClient::new(gate.channel().await);
    let err = anonymous
        .report_turn_failure(good.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // Nothing was counted: the good report is the first the credential sees.
    let first = client.report_turn_failure(good).await.unwrap().into_inner();
    assert!(first.incident.is_none());
    assert!(
        gate.health
            .store()
            .states(&["cred-a".into()])
            .await
            .unwrap()["cred-a"]
            .0
            .evidence
            .len()
            == 1
    );
}

#[tokio::test]
async fn replicas_sharing_the_database_open_exactly_one_incident() {
    // Two credential health replicas on one database (the second is opened beside the
    // gate's own), each reporting failures of distinct runs at the same moment: the
    // compare-and-set on the credential's row makes them agree on one incident.
    let gate = Gate::start(Backend::postgres().await).await;
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
    config.credential_health.database_url = gate._dbs.1.url().to_owned();
    config.credential_health.profiles = vec![profile("sonnet", "cred-a")];
    let clock: runplane_clock::SharedClock = Arc::new(gate.clock.clone());
    let replica = CredentialHealth::open(&config, clock).await.unwrap();
    let replica_addr = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut services = ServiceSet::new();
        replica.register(&mut services);
        tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        format!("http://{addr}")
    };
    let replica_channel = tonic::transport::Endpoint::from_shared(replica_addr)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let gate_channel = gate.channel().await;
    for round in 0..4 {
        gate.clock.advance(Duration::from_secs(121));
        let reports = (0..16).map(|i| {
            let channel = if i % 2 == 0 {
                replica_channel.clone()
            } else {
                gate_channel.clone()
            };
            async move {
                let mut client =
                    CredentialHealthServiceClient::with_interceptor(channel, Bearer::new(TOKEN));
                client
                    .report_turn_failure(credentials_pb::ReportTurnFailureRequest {
                        turn_id: format!("round-{round}-run-{i}:result"),
                        run_id: format!("round-{round}-run-{i}"),
                        org_id: "acme".into(),
                        lead_id: format!("lead-{round}"),
                        credential_id: "cred-a".into(),
                        failure_tail: OUTAGE.into(),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner()
            }
        });
        let answers = futures::future::join_all(reports).await;
        let mut incidents: Vec<String> = answers
            .iter()
            .filter_map(|a| a.incident.as_ref().map(|i| i.id.clone()))
            .collect();
        incidents.sort();
        incidents.dedup();
        assert_eq!(incidents.len(), 1, "round {round}: {incidents:?}");
        let open = gate
            .credentials()
            .await
            .list_incidents(credentials_pb::ListIncidentsRequest {
                state: credentials_pb::IncidentState::Open as i32,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .incidents;
        assert_eq!(open.len(), 1, "round {round}: {open:?}");
        assert_eq!(
            open[0].opening_run_ids.len() as u32 + open[0].failures_during_cool_off,
            16
        );
        let notices = notices_only(&gate.notices(&format!("lead-{round}"), "").await);
        assert_eq!(notices.len(), 1, "round {round}: one lead, one notice");
    }
}

/// Serves `services` on `listener` until the returned sender is dropped or fired.
fn serve(
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

#[tokio::test]
async fn a_credential_health_restart_loses_no_failure_and_admission_fails_closed_meanwhile() {
    // The run store and credential health on separate sockets, so credential health can
    // be stopped and started again under the run store, as a deploy does.
    let (run_db, health_db) = (TestDatabase::new().await, TestDatabase::new().await);
    let run_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_addr = health_listener.local_addr().unwrap();
    drop(health_listener); // start_health binds it, again after the restart
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
    config.run_store.database_url = run_db.url().to_owned();
    config.run_store.endpoint = format!("http://{}", run_listener.local_addr().unwrap());
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    config.credential_health.database_url = health_db.url().to_owned();
    config.credential_health.endpoint = format!("http://{health_addr}");
    config.credential_health.profiles = vec![profile("sonnet", "cred-a")];
    let clock = ManualClock::new(chrono::Utc::now());
    let shared: runplane_clock::SharedClock = Arc::new(clock.clone());
    let run_store = RunStore::open(&config, shared.clone()).await.unwrap();
    let mut services = ServiceSet::new();
    run_store.register(&mut services);
    let run_endpoint = config.run_store.endpoint.clone();
    let (_run_stop, _) = serve(run_listener, services);
    let start_health = || async {
        let health = CredentialHealth::open(&config, shared.clone())
            .await
            .unwrap();
        let mut services = ServiceSet::new();
        health.register(&mut services);
        let listener = loop {
            match tokio::net::TcpListener::bind(health_addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let (stop, served) = serve(listener, services);
        (health, stop, served)
    };
    let (_, stop, served) = start_health().await;

    let channel = tonic::transport::Endpoint::from_shared(run_endpoint.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut runs = RunServiceClient::with_interceptor(channel.clone(), Bearer::new(TOKEN));
    let create = |id: &str| runstore_pb::CreateRunRequest {
        client_request_id: format!("{id:0>16}"),
        org_id: "acme".into(),
        lead_id: "lead-1".into(),
        target: Some(credential_target("cred-a")),
        command: "agent".into(),
        ..Default::default()
    };
    let run = runs
        .create_run(create("restart-a"))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = runs
        .issue_run_key(runstore_pb::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "sbx-r".into(),
            sandbox_generation: 1,
            idempotency_key: "sbx-r:1:issue-key-0".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .run_key;
    let mut runner = RunnerServiceClient::with_interceptor(channel.clone(), Bearer::new(key));
    runner
        .hello(runstore_pb::HelloRequest {
            run_id: run.id.clone(),
            nonce: "restart-runner-nonce-01".into(),
            runner_version: "test".into(),
        })
        .await
        .unwrap();

    // Credential health goes away (a deploy).
    stop.send(()).unwrap();
    served.await.unwrap().unwrap();

    // Admission cannot be asked: refused as UNAVAILABLE, and nothing is stored.
    let refused = runs.create_run(create("restart-b")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(
        reason(&refused),
        ErrorReason::UpstreamUnavailable.as_str_name()
    );
    let listed = runs
        .list_runs(runstore_pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(listed.len(), 1);

    // The run fails meanwhile; its report stays in the outbox, owed.
    runner
        .submit_result(runstore_pb::SubmitResultRequest {
            run_id: run.id.clone(),
            verdict: Some(failed()),
            failure_tail: OUTAGE.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(run_store.deliver_outbox().await.unwrap(), 0);
    let owed = runplane_db::outbox::all(run_store.store().database())
        .await
        .unwrap();
    assert_eq!(owed.len(), 1);
    assert!(owed[0].delivered_at_us.is_none() && owed[0].attempts == 1);

    // Credential health is back: after the backoff the report is delivered, classified,
    // and the run gets its durable outcome.
    let (health, _stop, _served) = start_health().await;
    clock.advance(Duration::from_secs(2));
    assert_eq!(run_store.deliver_outbox().await.unwrap(), 1);
    assert_eq!(health.deliver_outbox(100).await.unwrap(), 1);
    let after = runs
        .get_run(runstore_pb::GetRunRequest {
            run_id: run.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    assert_eq!(after.state(), runstore_pb::RunState::BackendError);
    assert_eq!(after.failure_reason, "API Error: No response from API");
}

// The suite, on Postgres and on SQLite (as `runplane dev` runs it). What needs
// replicas sharing a database (the notice relay, two replicas racing) runs on Postgres.

/// Two profiles on two credentials.
mod started {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::start =>
        two_runs_failing_on_one_credential_refuse_the_next_run_mark_both_and_tell_the_lead_once,
        one_failure_changes_nothing_but_the_runs_own_outcome,
        the_same_run_failing_repeatedly_is_not_an_incident,
        after_the_cool_off_one_fresh_error_does_not_reopen_and_two_do,
        errors_during_the_cool_off_neither_extend_it_nor_open_another_incident,
        exhaustion_and_cool_off_together_report_both_and_refuse_as_exhausted,
        a_run_that_finished_and_then_is_classified_ends_backend_error_either_way,
        notices_resume_from_a_cursor_and_follow_live,
        a_replayed_report_returns_the_first_answer_and_counts_once,
        bad_reports_are_refused_with_a_reason_and_write_nothing,
    );
}

/// Profiles owned by two orgs.
mod with_two_orgs {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_orgs =>
        an_org_token_cannot_use_another_orgs_credential,
        notices_of_two_orgs_with_the_same_lead_id_do_not_mix,
    );
}

/// Two profiles of one name on two credentials.
mod with_two_pools {
    use super::*;

    runplane_testkit::on_both_backends!(
        Gate::two_pools =>
        a_profile_is_placed_on_a_healthy_credential_and_refused_only_when_none_is,
    );
}
