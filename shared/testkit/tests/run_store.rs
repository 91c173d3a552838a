//! The in-process run store answers the operator token its config names, refuses others,
//! and is gone once shut down.

#![cfg(feature = "run-store")]

use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_testkit::run_store::InProcessRunStore;
use runplane_testkit::{TestSqlite, authed};

const TOKEN: &str = "testkit-operator-token-0123456789abcdef01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_run_store_serves_its_operator_until_shut_down() {
    let sqlite = TestSqlite::new();
    let server =
        InProcessRunStore::start(&runplane_testkit::config::run_store(TOKEN, &sqlite.url())).await;
    let endpoint = server.endpoint().to_owned();
    let mut runs = RunServiceClient::connect(endpoint.clone()).await.unwrap();
    let listed = runs
        .list_runs(authed(runstore_pb::ListRunsRequest::default(), TOKEN))
        .await
        .unwrap()
        .into_inner();
    assert!(listed.runs.is_empty(), "{listed:?}");
    let refused = runs
        .list_runs(authed(
            runstore_pb::ListRunsRequest::default(),
            "not-the-token",
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);

    server.shutdown().await;
    assert!(RunServiceClient::connect(endpoint).await.is_err());
}
