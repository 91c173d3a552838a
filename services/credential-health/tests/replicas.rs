//! Replicas and restarts through the gate (`common`), on Postgres: two replicas racing on
//! one database, and credential health restarted under a running run store.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use runplane_clock::ManualClock;
use runplane_config::Secret;
use runplane_credential_health::CredentialHealth;
use runplane_grpc::client::Bearer;
use runplane_grpc::{ErrorReason, ServiceSet};
use runplane_proto::credentials::v1 as credentials_pb;
use runplane_proto::credentials::v1::credential_health_service_client::CredentialHealthServiceClient;
use runplane_proto::runstore::v1 as runstore_pb;
use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
use runplane_run_store::RunStore;
use runplane_testkit::{Backend, TestDatabase};

#[tokio::test]
async fn replicas_sharing_the_database_open_exactly_one_incident() {
    // Two credential health replicas on one database (the second is opened beside the
    // gate's own), each reporting failures of distinct runs at the same moment: the
    // compare-and-set on the credential's row makes them agree on one incident.
    let gate = Gate::start(Backend::postgres().await).await;
    let mut config = runplane_testkit::config::with_operator(TOKEN);
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

#[tokio::test]
async fn a_credential_health_restart_loses_no_failure_and_admission_fails_closed_meanwhile() {
    // The run store and credential health on separate sockets, so credential health can
    // be stopped and started again under the run store, as a deploy does.
    let (run_db, health_db) = (TestDatabase::new().await, TestDatabase::new().await);
    let run_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_addr = health_listener.local_addr().unwrap();
    drop(health_listener); // start_health binds it, again after the restart
    let mut config = runplane_testkit::config::with_operator(TOKEN);
    config.run_store.database_url = run_db.url().to_owned();
    config.run_store.endpoint = format!("http://{}", run_listener.local_addr().unwrap());
    config.run_store.receipt_signing_key =
        Secret::new(runplane_testkit::config::fresh_receipt_seed());
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
            ..Default::default()
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
