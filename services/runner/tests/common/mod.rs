//! Set-up shared by the runner's tests: the operator token their run stores take
//! (configs and servers come from `runplane_testkit`), a connection to a run store once
//! it answers, and a run with its run key.

// Each test binary uses only some of these.
#![allow(dead_code)]

use std::time::Duration;

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::authed;
use tonic::transport::Channel;

pub const TOKEN: &str = "runner-test-service-token-0123456789abcd";

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
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: client_request_id.into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "c".into(),
                )),
                command: command.into(),
                args,
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run
        .unwrap();
    let key = op
        .issue_run_key(authed(
            runstore_pb::IssueRunKeyRequest {
                run_id: run.id.clone(),
                sandbox_id: "sbx".into(),
                sandbox_generation: 1,
                idempotency_key: idempotency_key.into(),
                ..Default::default()
            },
            TOKEN,
        ))
        .await
        .unwrap()
        .into_inner()
        .run_key;
    (run, key)
}
