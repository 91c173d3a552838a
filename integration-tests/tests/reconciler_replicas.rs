//! Sandbox-reconciler replicas on one PostgreSQL database, as processes. A local sandbox
//! lives in one replica's process tree, so only one replica with local sandboxes may serve
//! a database: two would both launch every sandbox they read as not started (each runner
//! then holding a run key the other's launch replaced) and each would probe the other's
//! sandboxes lost.

use std::process::Stdio;
use std::time::Duration;

use runplane_integration_tests::{SERVICE_TOKEN, runplane_bin, start_serve};
use runplane_testkit::{TestDatabase, free_local_addr};

const TOKEN: &str = "replicas-test-operator-token-0123456789abc";

fn reconciler_env(database_url: &str, state_dir: &std::path::Path) -> Vec<(String, String)> {
    let listen = free_local_addr().to_string();
    let elsewhere = format!("http://{}", free_local_addr());
    vec![
        ("RUNPLANE_SERVER__LISTEN".into(), listen.clone()),
        ("RUNPLANE_AUTH__OPERATOR_TOKEN".into(), TOKEN.into()),
        (
            "RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES_BESIDE_SECRETS".into(),
            "true".into(),
        ),
        ("RUNPLANE_RUN_STORE__ENDPOINT".into(), elsewhere.clone()),
        (
            "RUNPLANE_CREDENTIAL_HEALTH__ENDPOINT".into(),
            elsewhere.clone(),
        ),
        ("RUNPLANE_STREAM_RECOVERY__ENDPOINT".into(), elsewhere),
        (
            "RUNPLANE_SANDBOX_RECONCILER__ENDPOINT".into(),
            format!("http://{listen}"),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__DATABASE_URL".into(),
            database_url.into(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__STATE_DIR".into(),
            state_dir.display().to_string(),
        ),
        (
            "RUNPLANE_SANDBOX_RECONCILER__ISOLATION".into(),
            "none".into(),
        ),
    ]
}

fn refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_reconciler_with_local_sandboxes_on_one_database_is_refused_until_the_first_is_gone()
 {
    let database = TestDatabase::new().await;
    let dir = tempfile::tempdir().unwrap();
    let first_env = reconciler_env(database.url(), &dir.path().join("a"));
    let mut first = start_serve(&["sandbox-reconciler"], &refs(&first_env)).await;

    // A second replica with local sandboxes (the default) is refused at start, naming the
    // setting and what to do instead.
    let second_env = reconciler_env(database.url(), &dir.path().join("b"));
    let second = tokio::process::Command::new(runplane_bin())
        .args(["serve", "sandbox-reconciler"])
        .envs(second_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env_remove("RUNPLANE_CONFIG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env("RUNPLANE_AUTH__SERVICE_TOKEN", SERVICE_TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let second = tokio::time::timeout(Duration::from_secs(90), second)
        .await
        .expect("the second replica exits")
        .unwrap();
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{said}");
    assert!(
        said.contains("sandbox_reconciler.local_sandboxes")
            && said.contains("another sandbox reconciler with local sandboxes"),
        "{said}"
    );

    // The same replica with local sandboxes off starts beside the first.
    let mut placing_env = reconciler_env(database.url(), &dir.path().join("c"));
    placing_env.push((
        "RUNPLANE_SANDBOX_RECONCILER__LOCAL_SANDBOXES".into(),
        "false".into(),
    ));
    let _placing = start_serve(&["sandbox-reconciler"], &refs(&placing_env)).await;

    // Once the first is gone (killed: no shutdown), a replacement with local sandboxes
    // takes its place.
    first.kill().await;
    let _replacement = start_serve(&["sandbox-reconciler"], &refs(&second_env)).await;
}
