//! Two credential-health replicas on one Postgres database delivering their outbox
//! (MarkBackendError owed to the run store) at the same time: each call is sent by one
//! replica at a time, and a call whose replica died mid-delivery is sent by the other
//! once the claim lapses on the injected clock.
//!
//! The callee is a real gRPC run-store server that counts MarkBackendError calls per
//! idempotency key and can hold a call open, so the interleavings are forced.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use runplane_clock::ManualClock;
use runplane_config::{ProfileConfig, Secret};
use runplane_credential_health::CredentialHealth;
use runplane_credential_health::store::outbox::OUTBOX_MARK_BACKEND_ERROR;
use runplane_db::outbox::CLAIM_TIMEOUT;
use runplane_grpc::ServiceSet;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_server::{RunService, RunServiceServer};
use runplane_testkit::TestDatabase;
use tokio::sync::{Notify, Semaphore};
use tonic::{Request, Response, Status};

/// The run store as the outbox sees it: MarkBackendError answered (after the gate, for
/// the first `hold` calls) and counted per key; every other method unimplemented.
#[derive(Clone)]
struct Receiver {
    calls: Arc<Mutex<HashMap<String, u32>>>,
    arrived: Arc<Notify>,
    hold: Arc<Mutex<u32>>,
    gate: Arc<Semaphore>,
}

impl Receiver {
    fn new() -> Self {
        Self {
            calls: Arc::default(),
            arrived: Arc::default(),
            hold: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn calls(&self) -> HashMap<String, u32> {
        self.calls.lock().unwrap().clone()
    }

    async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        // It accepts what a run store would: the harness's service token.
        let auth = runplane_config::AuthConfig {
            service_token: Secret::new(runplane_testkit::SERVICE_TOKEN),
            ..Default::default()
        };
        let mut services = ServiceSet::new();
        services
            .authenticate(runplane_grpc::auth::Tokens::from_config(&auth))
            .add(RunServiceServer::new(self.clone()));
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
impl RunService for Receiver {
    async fn mark_backend_error(
        &self,
        request: Request<runstore_pb::MarkBackendErrorRequest>,
    ) -> Result<Response<runstore_pb::MarkBackendErrorResponse>, Status> {
        let key = request.into_inner().idempotency_key;
        *self.calls.lock().unwrap().entry(key).or_default() += 1;
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
            runstore_pb::MarkBackendErrorResponse::default(),
        ))
    }
}

struct Replicas {
    a: CredentialHealth,
    b: CredentialHealth,
    clock: ManualClock,
    receiver: Receiver,
    _db: TestDatabase,
}

impl Replicas {
    async fn start() -> Self {
        let db = TestDatabase::new().await;
        let receiver = Receiver::new();
        let mut config =
            runplane_testkit::config::with_operator("service-token-0123456789abcdef0123456789");
        config.run_store.endpoint = receiver.serve().await;
        config.credential_health.database_url = db.url().to_owned();
        config.credential_health.profiles = vec![ProfileConfig {
            name: "sonnet".into(),
            credential_id: "cred-a".into(),
            capacity: 4,
            ..ProfileConfig::default()
        }];
        let clock = ManualClock::new(chrono::Utc::now());
        let a = CredentialHealth::open(&config, Arc::new(clock.clone()))
            .await
            .unwrap();
        let b = CredentialHealth::open(&config, Arc::new(clock.clone()))
            .await
            .unwrap();
        Self {
            a,
            b,
            clock,
            receiver,
            _db: db,
        }
    }

    /// Writes `n` owed MarkBackendError calls, as a classified report does; returns their
    /// keys.
    async fn owe(&self, n: usize) -> Vec<String> {
        let now_us = self.a.store().now_us();
        let mut keys = Vec::new();
        for i in 0..n {
            let key = format!("run-health-{i:04}:result");
            let request = runstore_pb::MarkBackendErrorRequest {
                run_id: format!("run-health-{i:04}"),
                idempotency_key: key.clone(),
                turn_id: key.clone(),
                credential_id: "cred-a".into(),
                ..Default::default()
            };
            let row = runplane_db::outbox::row(
                OUTBOX_MARK_BACKEND_ERROR,
                key.clone(),
                prost::Message::encode_to_vec(&request),
                now_us - 1000 + i as i64,
            );
            assert!(
                runplane_db::outbox::enqueue(self.a.database(), row)
                    .await
                    .unwrap()
            );
            keys.push(key);
        }
        keys
    }

    async fn owed(&self) -> usize {
        runplane_db::outbox::all(self.a.database())
            .await
            .unwrap()
            .iter()
            .filter(|r| r.delivered_at_us.is_none())
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_delivering_at_once_send_each_call_once() {
    let r = Replicas::start().await;
    let keys = r.owe(5).await;

    // A is mid-call on the oldest row while B runs a whole round.
    *r.receiver.hold.lock().unwrap() = 1;
    let round_a = tokio::spawn({
        let a = r.a.clone();
        async move { a.deliver_outbox(100).await.unwrap() }
    });
    r.receiver.arrived.notified().await;
    let sent_by_b = r.b.deliver_outbox(100).await.unwrap();
    r.receiver.gate.add_permits(1);
    let sent_by_a = round_a.await.unwrap();

    let calls = r.receiver.calls();
    for key in &keys {
        assert_eq!(calls.get(key), Some(&1), "{key} sent once: {calls:?}");
    }
    assert_eq!((sent_by_a, sent_by_b), (1, 4));
    assert_eq!(r.owed().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_replica_died_mid_delivery_is_sent_by_the_other_after_the_claim_timeout() {
    let r = Replicas::start().await;
    let keys = r.owe(1).await;

    // A's call reaches the run store, and A dies before the answer.
    *r.receiver.hold.lock().unwrap() = 1;
    let round_a = tokio::spawn({
        let a = r.a.clone();
        async move { a.deliver_outbox(100).await }
    });
    r.receiver.arrived.notified().await;
    round_a.abort();
    assert!(round_a.await.unwrap_err().is_cancelled());

    // The outbox reads this clock in milliseconds.
    r.clock.advance(CLAIM_TIMEOUT - Duration::from_millis(1));
    assert_eq!(r.b.deliver_outbox(100).await.unwrap(), 0, "still A's claim");
    assert_eq!(r.receiver.calls().get(&keys[0]), Some(&1));

    r.clock.advance(Duration::from_millis(1));
    assert_eq!(
        r.b.deliver_outbox(100).await.unwrap(),
        1,
        "A's claim lapsed"
    );
    assert_eq!(r.receiver.calls().get(&keys[0]), Some(&2));
    assert_eq!(r.owed().await, 0);
}
