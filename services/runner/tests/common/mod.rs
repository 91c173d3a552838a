//! Set-up shared by the runner's tests: a run store's config, one served on its own
//! runtime, an operator client connected to it, and a run with its run key.

// Each test binary uses only some of these.
#![allow(dead_code)]

use std::time::Duration;

use runplane_config::{Config, Secret};
use runplane_grpc::ServiceSet;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_run_store::RunStore;
use tonic::transport::Channel;

pub const TOKEN: &str = "runner-test-service-token-0123456789abcd";

/// A run store's config on `database_url`, signing receipts with `seed`.
pub fn config(database_url: &str, seed: &str) -> Config {
    let mut config = Config::default();
    config.auth.operator_token = Secret::new(TOKEN);
    config.auth.service_token = Secret::new(runplane_testkit::SERVICE_TOKEN);
    config.run_store.database_url = database_url.to_owned();
    config.run_store.receipt_signing_key = Secret::new(seed);
    // Not about admission: runs are created on the credential they name.
    config.run_store.admission = false;
    config
}

/// [`config`] with a fresh signing key.
pub fn fresh_config(database_url: &str) -> Config {
    config(
        database_url,
        &runplane_run_store::domain::receipt::ReceiptSigner::generate().seed_hex(),
    )
}

/// A fresh run store (its own pool) on its own runtime: shutting the runtime down is a
/// crashed process.
pub fn serve(config: &Config, addr: String) -> tokio::runtime::Runtime {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let config = config.clone();
    runtime.spawn(async move {
        let store = RunStore::open(&config, runplane_clock::SystemClock::shared())
            .await
            .unwrap();
        let mut services = ServiceSet::new();
        store.register(&mut services);
        let listener = loop {
            match tokio::net::TcpListener::bind(&addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        let _ = runplane_grpc::serve(
            listener,
            services,
            std::future::pending(),
            Duration::from_secs(1),
        )
        .await;
    });
    runtime
}

pub fn authed<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

/// A channel to `endpoint`, once something answers there.
pub async fn connected(endpoint: &str) -> Channel {
    for _ in 0..500 {
        if let Ok(c) = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .unwrap()
            .connect()
            .await
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no run store at {endpoint}");
}

/// Creates a run of `command args` for org `acme` on credential `c`, and issues its run
/// key for sandbox `sbx` generation 1: the run and the key.
pub async fn run_with_key(
    op: &mut RunServiceClient<Channel>,
    client_request_id: &str,
    command: &str,
    args: Vec<String>,
    idempotency_key: &str,
) -> (runstore_pb::Run, String) {
    let run = op
        .create_run(authed(runstore_pb::CreateRunRequest {
            client_request_id: client_request_id.into(),
            org_id: "acme".into(),
            target: Some(runstore_pb::create_run_request::Target::CredentialId(
                "c".into(),
            )),
            command: command.into(),
            args,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = op
        .issue_run_key(authed(runstore_pb::IssueRunKeyRequest {
            run_id: run.id.clone(),
            sandbox_id: "sbx".into(),
            sandbox_generation: 1,
            idempotency_key: idempotency_key.into(),
        }))
        .await
        .unwrap()
        .into_inner()
        .run_key;
    (run, key)
}
