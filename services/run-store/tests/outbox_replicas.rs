//! Two run-store replicas on one Postgres database running their outbox delivery and
//! their deadline sweep at the same time (docs/architecture.md "Failure model": a cross-service
//! effect is delivered once per claim; every background loop is correct with two replicas
//! running it).
//!
//! The outbox's callee is a real gRPC credential-health server that counts the
//! ReportTurnFailure calls per turn and can hold a call open, so "one replica is
//! mid-delivery while the other runs a round" is forced, not hoped for.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Backend, Harness};
use runplane_clock::{Clock, ManualClock, SharedClock, SystemClock};
use runplane_config::{Config, Secret};
use runplane_db::outbox::CLAIM_TIMEOUT;
use runplane_grpc::ServiceSet;
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_server::{
    CredentialHealthService, CredentialHealthServiceServer,
};
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_run_store::RunStore;
use runplane_run_store::domain::receipt::verify;
use runplane_run_store::store::OUTBOX_REPORT_TURN_FAILURE;
use runplane_testkit::TestDatabase;
use tokio::sync::{Notify, Semaphore};
use tonic::{Request, Response, Status};

/// Credential health as the run store's outbox sees it: ReportTurnFailure answered
/// (after the gate, for the first `hold` calls), counted per turn; nothing else.
#[derive(Clone)]
struct Receiver {
    calls: Arc<Mutex<HashMap<String, u32>>>,
    arrived: Arc<Notify>,
    hold: Arc<Mutex<u32>>,
    gate: Arc<Semaphore>,
}

impl Default for Receiver {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            arrived: Arc::default(),
            hold: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Receiver {
    fn calls(&self) -> HashMap<String, u32> {
        self.calls.lock().unwrap().clone()
    }

    /// Holds the next `n` calls open until [`Self::release`].
    fn hold_next(&self, n: u32) {
        *self.hold.lock().unwrap() = n;
    }

    fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Serves on a fresh local socket; returns the endpoint.
    async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let mut services = ServiceSet::new();
        services
            .authenticate(service_tokens())
            .add(CredentialHealthServiceServer::new(self.clone()));
        tokio::spawn(runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        endpoint
    }
}

#[tonic::async_trait]
impl CredentialHealthService for Receiver {
    async fn report_turn_failure(
        &self,
        request: Request<credentials_pb::ReportTurnFailureRequest>,
    ) -> Result<Response<credentials_pb::ReportTurnFailureResponse>, Status> {
        let turn = request.into_inner().turn_id;
        *self.calls.lock().unwrap().entry(turn).or_default() += 1;
        let held = {
            let mut hold = self.hold.lock().unwrap();
            let held = *hold > 0;
            *hold = hold.saturating_sub(1);
            held
        };
        self.arrived.notify_one();
        if held {
            self.gate.acquire().await.unwrap().forget();
        }
        Ok(Response::new(
            credentials_pb::ReportTurnFailureResponse::default(),
        ))
    }
}

/// What a credential health replica would accept: the harness's service token.
fn service_tokens() -> runplane_grpc::auth::Tokens {
    let auth = runplane_config::AuthConfig {
        service_token: Secret::new(runplane_testkit::SERVICE_TOKEN),
        ..Default::default()
    };
    runplane_grpc::auth::Tokens::from_config(&auth)
}

/// A run-store replica with admission on, reporting turn failures to `receiver`.
async fn replica(database_url: &str, receiver: &str, clock: SharedClock) -> RunStore {
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(common::SERVICE_TOKEN);
    config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
    config.run_store.database_url = database_url.to_owned();
    config.run_store.receipt_signing_key =
        Secret::new(runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex());
    config.run_store.admission = true;
    config.credential_health.endpoint = receiver.to_owned();
    RunStore::open(&config, clock)
        .await
        .expect("run store opens")
}

/// Writes `n` owed turn-failure reports, as the checked result path does; returns
/// their turn ids.
async fn owe_reports(store: &RunStore, n: usize) -> Vec<String> {
    let mut turns = Vec::new();
    for i in 0..n {
        let turn_id = format!("run-outbox-{i:04}:result");
        let request = credentials_pb::ReportTurnFailureRequest {
            turn_id: turn_id.clone(),
            run_id: format!("run-outbox-{i:04}"),
            credential_id: "cred-a".into(),
            ..Default::default()
        };
        let row = runplane_db::outbox::row(
            OUTBOX_REPORT_TURN_FAILURE,
            turn_id.clone(),
            prost::Message::encode_to_vec(&request),
            store.store().now_us() - 1000 + i as i64,
        );
        assert!(
            runplane_db::outbox::enqueue(store.store().database(), row)
                .await
                .unwrap()
        );
        turns.push(turn_id);
    }
    turns
}

async fn owed(store: &RunStore) -> usize {
    runplane_db::outbox::all(store.store().database())
        .await
        .unwrap()
        .iter()
        .filter(|r| r.delivered_at_us.is_none())
        .count()
}

fn manual_clock() -> (Arc<ManualClock>, SharedClock) {
    let clock = Arc::new(ManualClock::new(SystemClock::new().now()));
    (clock.clone(), clock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_delivering_at_once_send_each_report_once() {
    let db = TestDatabase::new().await;
    let receiver = Receiver::default();
    let endpoint = receiver.serve().await;
    let (_, clock) = manual_clock();
    let a = replica(db.url(), &endpoint, clock.clone()).await;
    let b = replica(db.url(), &endpoint, clock).await;
    let turns = owe_reports(&a, 5).await;

    // A is mid-call on the oldest report while B runs a whole round.
    receiver.hold_next(1);
    let round_a = tokio::spawn({
        let a = a.clone();
        async move { a.deliver_outbox().await.unwrap() }
    });
    receiver.arrived.notified().await;
    let sent_by_b = b.deliver_outbox().await.unwrap();
    receiver.release(1);
    let sent_by_a = round_a.await.unwrap();

    let calls = receiver.calls();
    for turn in &turns {
        assert_eq!(calls.get(turn), Some(&1), "{turn} reported once: {calls:?}");
    }
    assert_eq!((sent_by_a, sent_by_b), (1, 4));
    assert_eq!(owed(&a).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_whose_replica_died_mid_call_is_sent_by_the_other_after_the_claim_timeout() {
    let db = TestDatabase::new().await;
    let receiver = Receiver::default();
    let endpoint = receiver.serve().await;
    let (manual, clock) = manual_clock();
    let a = replica(db.url(), &endpoint, clock.clone()).await;
    let b = replica(db.url(), &endpoint, clock).await;
    let turns = owe_reports(&a, 1).await;

    // A's call reaches credential health, and A dies before the answer.
    receiver.hold_next(1);
    let round_a = tokio::spawn({
        let a = a.clone();
        async move { a.deliver_outbox().await }
    });
    receiver.arrived.notified().await;
    round_a.abort();
    assert!(round_a.await.unwrap_err().is_cancelled());

    manual.advance(CLAIM_TIMEOUT - Duration::from_micros(1));
    assert_eq!(b.deliver_outbox().await.unwrap(), 0, "still A's claim");
    assert_eq!(receiver.calls().get(&turns[0]), Some(&1));

    manual.advance(Duration::from_micros(1));
    assert_eq!(b.deliver_outbox().await.unwrap(), 1, "A's claim lapsed");
    // A's call's outcome is unknown, so B sends it again: the key makes it one report.
    assert_eq!(receiver.calls().get(&turns[0]), Some(&2));
    assert_eq!(owed(&b).await, 0);
}

/// Two replicas sweep the same due runs at the same time: each run is ended once, by
/// one of them, with one verdict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sweeping_the_same_due_runs_end_each_once() {
    const RUNS: usize = 12;
    let a = Harness::start(Backend::postgres().await).await;
    let b = a.replica().await;
    let mut op = a.operator().await;
    let mut ids = Vec::new();
    for i in 0..RUNS {
        let mut request = common::create_request(&format!("sweep-two-{i}"));
        request.max_duration = Some(prost_types::Duration {
            seconds: 0,
            nanos: 1_000_000,
        });
        let run = op
            .create_run(request)
            .await
            .unwrap()
            .into_inner()
            .run
            .unwrap();
        ids.push(run.id);
    }
    // Both replicas see every run as due before either sweeps.
    while a.store.store().past_deadline(100).await.unwrap().len() < RUNS {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (sa, sb) = (a.store.clone(), b.store.clone());
    let (ended_a, ended_b) = tokio::join!(
        tokio::spawn(async move { sa.sweep_deadlines().await.unwrap() }),
        tokio::spawn(async move { sb.sweep_deadlines().await.unwrap() }),
    );
    assert_eq!(ended_a.unwrap() + ended_b.unwrap(), RUNS as u64);
    assert_eq!(a.store.sweep_deadlines().await.unwrap(), 0);
    assert_eq!(b.store.sweep_deadlines().await.unwrap(), 0);

    for id in &ids {
        let run = b.get_run(id).await;
        assert_eq!(run.state(), runstore_pb::RunState::Failed);
        assert_eq!(run.failure_reason, "deadline_exceeded");
        let receipt = a
            .operator()
            .await
            .get_receipt(runstore_pb::GetReceiptRequest { run_id: id.clone() })
            .await
            .unwrap()
            .into_inner()
            .receipt
            .unwrap();
        // Each harness replica signs with its own key: the receipt names the one that
        // ended the run.
        let body = verify(&receipt, &a.store.receipt_public_key())
            .or_else(|_| verify(&receipt, &b.store.receipt_public_key()))
            .expect("receipt signed by one of the replicas");
        assert_eq!(body.verdict.unwrap().reason, "deadline_exceeded");
    }
}
