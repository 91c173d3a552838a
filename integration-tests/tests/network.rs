//! A profile may take its sandboxes' network away (`network = "none"`): the agent of a run
//! on it sees only loopback, while a run on another profile keeps the host's network.

use std::process::Stdio;

use runplane_integration_tests::{runplane_bin, start_dev_with_env};

const PROFILES: &str = r#"
[[credential_health.profiles]]
name = "offline"
credential_id = "local"
capacity = 2
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
network = "none"

[[credential_health.profiles]]
name = "online"
credential_id = "local"
capacity = 2
error_pattern = "API Error:"
exhausted_pattern = "quota exceeded"
"#;

/// The network interfaces the agent of a run on `profile` sees, as it prints them.
async fn interfaces_seen(endpoint: &str, token: &str, profile: &str) -> String {
    let out = tokio::process::Command::new(runplane_bin())
        .args(["run", "--endpoint", endpoint, "--profile", profile, "--"])
        .args([
            "sh",
            "-c",
            "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '",
        ])
        .env("RUNPLANE_TOKEN", token)
        .env_remove("RUNPLANE_CONFIG")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("runplane run");
    assert!(
        out.status.success(),
        "runplane run --profile {profile}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_without_network_gives_its_agents_only_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runplane.toml");
    std::fs::write(&config, PROFILES).unwrap();
    let data = dir.path().join("data");
    let config_path = config.display().to_string();
    let dev = start_dev_with_env(&data, &[("RUNPLANE_CONFIG", config_path.as_str())]).await;
    let token = std::fs::read_to_string(data.join("operator-token"))
        .map(|t| t.trim().to_owned())
        .expect("dev keeps its operator token");
    let endpoint = format!("http://{}", dev.address);

    let offline = interfaces_seen(&endpoint, &token, "offline").await;
    assert_eq!(
        offline, "lo",
        "a sandbox of an offline profile: loopback only"
    );
    let online = interfaces_seen(&endpoint, &token, "online").await;
    assert!(
        online.split(' ').any(|i| i != "lo"),
        "a sandbox of another profile keeps the host's network: {online:?}"
    );
}
