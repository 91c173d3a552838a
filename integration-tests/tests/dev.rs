//! `runplane dev` as a new user meets it: one process, one port, all four services with
//! health, reflection (v1alpha for grpcurl 1.8, and v1) and their method options.

use futures::StreamExt;
use prost::Message;
use prost_reflect::DescriptorPool;
use runplane_integration_tests::{channel, start_dev};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1alpha::{ServerReflectionRequest, ServerReflectionResponse};

const RUNPLANE_SERVICES: [&str; 6] = [
    "runplane.runstore.v1.RunnerService",
    "runplane.runstore.v1.RunService",
    "runplane.reconciler.v1.SandboxService",
    "runplane.reconciler.v1.NodeService",
    "runplane.recovery.v1.StreamRecoveryService",
    "runplane.credentials.v1.CredentialHealthService",
];

async fn reflect(endpoint: &str, request: MessageRequest) -> MessageResponse {
    let mut client = ServerReflectionClient::new(channel(endpoint).await);
    let mut responses = client
        .server_reflection_info(futures::stream::iter([ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        }]))
        .await
        .expect("reflection call")
        .into_inner();
    let response: ServerReflectionResponse = responses.next().await.unwrap().unwrap();
    response.message_response.expect("a reflection answer")
}

#[tokio::test]
async fn dev_lists_every_service_and_reports_each_serving() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    assert!(
        dev.stdout_lines
            .iter()
            .any(|l| l.contains(&format!("grpcurl -plaintext {} list", dev.address))),
        "banner offers a grpcurl line: {:?}",
        dev.stdout_lines
    );

    let MessageResponse::ListServicesResponse(list) =
        reflect(&dev.endpoint(), MessageRequest::ListServices(String::new())).await
    else {
        panic!("not a service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in RUNPLANE_SERVICES.iter().chain(&[
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ]) {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }

    let mut health = HealthClient::new(channel(&dev.endpoint()).await);
    for service in RUNPLANE_SERVICES.iter().chain(&[""]) {
        let status = health
            .check(HealthCheckRequest {
                service: (*service).to_owned(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of {service:?}: {e}"))
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::Serving, "{service}");
    }
}

#[tokio::test]
async fn reflection_describes_methods_with_their_replay_policy() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    // As grpcurl does: the file with the symbol, then each import it names, by file name.
    let mut request =
        MessageRequest::FileContainingSymbol("runplane.runstore.v1.RunnerService".into());
    let mut files: Vec<prost_types::FileDescriptorProto> = Vec::new();
    let mut raw_set = Vec::new();
    loop {
        let MessageResponse::FileDescriptorResponse(answer) =
            reflect(&dev.endpoint(), request).await
        else {
            panic!("not a file descriptor answer");
        };
        for bytes in answer.file_descriptor_proto {
            // prost's own types drop the extension; keep the served bytes for the pool and
            // use the decoded file only for its name and imports.
            let file = prost_types::FileDescriptorProto::decode(bytes.as_slice()).unwrap();
            if !files.iter().any(|f| f.name == file.name) {
                files.push(file);
                prost::encoding::bytes::encode(1, &bytes, &mut raw_set);
            }
        }
        let missing = files
            .iter()
            .flat_map(|f| f.dependency.iter())
            .find(|d| !files.iter().any(|f| f.name.as_deref() == Some(d.as_str())))
            .cloned();
        match missing {
            Some(name) => request = MessageRequest::FileByFilename(name),
            None => break,
        }
    }
    // Decode through prost-reflect from the served bytes so the custom option survives.
    let pool = DescriptorPool::decode(raw_set.as_slice()).expect("a complete set");
    let policy = pool
        .get_extension_by_name("runplane.options.v1.policy")
        .expect("reflection serves the options proto too");
    let method = pool
        .get_service_by_name("runplane.runstore.v1.RunnerService")
        .unwrap()
        .methods()
        .find(|m| m.name() == "AppendEvents")
        .unwrap();
    let options = method.options();
    let value = options.get_extension(&policy);
    let value = value.as_message().unwrap();
    assert_eq!(
        value.get_field_by_name("key_field").unwrap().as_str(),
        Some("batch_key")
    );
    assert_eq!(
        value
            .get_field_by_name("replay_safety")
            .unwrap()
            .as_enum_number(),
        Some(3), // REPLAY_SAFETY_KEYED
    );
}

#[tokio::test]
async fn dev_reports_the_fleet_of_its_embedded_default_profile() {
    use runplane_proto::credentials::v1 as credentials_pb;
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let mut client =
        credentials_pb::credential_health_service_client::CredentialHealthServiceClient::new(
            channel(&dev.endpoint()).await,
        );
    let request =
        runplane_testkit::authed(credentials_pb::GetFleetRequest::default(), token.trim());
    let fleet = client.get_fleet(request).await.unwrap().into_inner();
    assert_eq!(fleet.profiles.len(), 1, "{fleet:?}");
    let profile = &fleet.profiles[0];
    assert_eq!(
        (profile.profile.as_str(), profile.credential_id.as_str()),
        ("default", "local")
    );
    assert_eq!((profile.capacity, profile.free), (8, 8));
    assert_eq!(
        (
            profile.cooling_off_for_seconds,
            profile.quarantined_for_seconds
        ),
        (0, 0)
    );
    // Without a token: refused, not served.
    let err = client
        .get_fleet(credentials_pb::GetFleetRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn sigterm_stops_dev_cleanly_and_a_restart_keeps_its_token() {
    let data = tempfile::tempdir().unwrap();
    let mut first = start_dev(data.path()).await;
    let token_line = |lines: &[String]| {
        lines
            .iter()
            .find(|l| l.trim_start().starts_with("operator token:"))
            .cloned()
            .expect("banner shows the operator token")
    };
    let token = token_line(&first.stdout_lines);
    let status = first.terminate().await;
    assert!(status.success(), "exit status {status:?}");
    let logs = first.stderr().await;
    assert!(logs.contains("shutting down"), "{logs}");

    let second = start_dev(data.path()).await;
    assert_eq!(token_line(&second.stdout_lines), token);
    let file = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    assert!(token.contains(file.trim()));
}

#[tokio::test]
async fn a_taken_port_is_refused_with_the_address() {
    let data = tempfile::tempdir().unwrap();
    let dev = start_dev(data.path()).await;
    let other = tempfile::tempdir().unwrap();
    let output = tokio::process::Command::new(runplane_integration_tests::runplane_bin())
        .args(["dev", "--listen", &dev.address, "--data-dir"])
        .arg(other.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("runplane: cannot listen on {}", dev.address)),
        "{stderr}"
    );
}

#[tokio::test]
async fn run_keys_and_tokens_never_reach_the_logs() {
    use runplane_proto::runstore::v1 as runstore_pb;
    use runplane_proto::runstore::v1::run_service_client::RunServiceClient;
    use runplane_proto::runstore::v1::runner_service_client::RunnerServiceClient;
    use runplane_testkit::authed;

    let data = tempfile::tempdir().unwrap();
    let mut dev =
        runplane_integration_tests::start_dev_with_env(data.path(), &[("RUST_LOG", "trace")]).await;
    let token = std::fs::read_to_string(data.path().join("operator-token")).unwrap();
    let token = token.trim().to_owned();
    let mut op = RunServiceClient::new(channel(&dev.endpoint()).await);
    let run = op
        .create_run(authed(
            runstore_pb::CreateRunRequest {
                client_request_id: "log-scan-request-0001".into(),
                org_id: "acme".into(),
                target: Some(runstore_pb::create_run_request::Target::CredentialId(
                    "local".into(),
                )),
                command: "true".into(),
                ..Default::default()
            },
            &token,
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
                idempotency_key: "log-scan-key-000001".into(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner()
        .run_key;
    let mut runner = RunnerServiceClient::new(channel(&dev.endpoint()).await);
    runner
        .hello(authed(
            runstore_pb::HelloRequest {
                run_id: run.id.clone(),
                nonce: "log-scan-nonce-000001".into(),
                runner_version: String::new(),
            },
            &key,
        ))
        .await
        .unwrap();
    // A refused call too: its error must not echo the key either.
    let refused = runner
        .append_events(authed(
            runstore_pb::AppendEventsRequest {
                run_id: run.id.clone(),
                batch_key: "short".into(),
                events: vec![],
            },
            &key,
        ))
        .await
        .unwrap_err();
    assert!(!refused.message().contains(&key));

    assert!(dev.terminate().await.success());
    let logs = dev.stderr().await;
    assert!(logs.contains(&run.id), "trace logs were captured");
    assert!(!logs.contains(&key), "a run key reached the logs");
    assert!(
        !logs.contains(&token),
        "the operator token reached the logs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_sees_none_of_the_control_planes_secrets_in_its_environment() {
    const TOKEN: &str = "env-operator-token-0123456789abcdef0123456";
    const KEY: &str = "abababababababababababababababababababababababababababababababab";
    let data = tempfile::tempdir().unwrap();
    let dev = runplane_integration_tests::start_dev_with_env(
        data.path(),
        &[
            ("RUNPLANE_AUTH__OPERATOR_TOKEN", TOKEN),
            ("RUNPLANE_RUN_STORE__RECEIPT_SIGNING_KEY", KEY),
        ],
    )
    .await;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        tokio::process::Command::new(runplane_integration_tests::runplane_bin())
            .args(["run", "--endpoint", &dev.endpoint(), "--", "env"])
            .env("RUNPLANE_TOKEN", TOKEN)
            .env_remove("RUNPLANE_CONFIG")
            .output(),
    )
    .await
    .expect("the run ends")
    .unwrap();
    let agent_env = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        agent_env.contains("PATH="),
        "the agent's environment: {agent_env}"
    );
    for secret in [
        TOKEN,
        KEY,
        "RUNPLANE_RUN_KEY=",
        "RUNPLANE_AUTH__",
        "DATABASE_URL",
    ] {
        assert!(
            !agent_env.contains(secret),
            "{secret} reached the agent:\n{agent_env}"
        );
    }
}
