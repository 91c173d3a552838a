//! The whole configuration through [`Config::load`]: sources, errors and secrets.

use super::*;

// `figment::Error` is large and Jail's closure signature is figment's, not ours.
#[allow(clippy::result_large_err)]
fn load_with(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let mut result = None;
    figment::Jail::expect_with(|jail| {
        jail.create_file("runplane.toml", toml)?;
        for (k, v) in env {
            jail.set_env(k, v);
        }
        result = Some(Config::load(Some(Path::new("runplane.toml"))));
        Ok(())
    });
    result.expect("jail ran")
}

#[test]
fn defaults_are_valid_and_listen_locally() {
    let config = load_with("", &[]).expect("defaults load");
    assert_eq!(config.listen_addr().unwrap().to_string(), DEFAULT_LISTEN);
    assert_eq!(config.telemetry.log_format, LogFormat::Text);
    assert!(config.require_operator_token().is_err());
}

#[test]
fn environment_overrides_the_file_and_foreign_variables_are_ignored() {
    let config = load_with(
        "[server]\nlisten = \"127.0.0.1:9000\"\n[telemetry]\nlog_format = \"json\"\n",
        &[
            ("RUNPLANE_SERVER__LISTEN", "0.0.0.0:7171"),
            ("RUNPLANE_RUN_KEY", "not-config"),
            ("RUNPLANE_CONFIG", "runplane.toml"),
        ],
    )
    .expect("loads");
    assert_eq!(config.server.listen, "0.0.0.0:7171");
    assert_eq!(config.telemetry.log_format, LogFormat::Json);
}

#[test]
fn errors_name_the_field() {
    let err = load_with("[server]\nlisten = \"nowhere\"\n", &[]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid config: server.listen:"),
        "{err}"
    );

    let err = load_with("", &[("RUNPLANE_SERVER__SHUTDOWN_GRACE_SECONDS", "soon")]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.to_lowercase().contains("server.shutdown_grace_seconds"),
        "{msg}"
    );
    assert!(msg.contains("RUNPLANE_"), "{msg}");

    let err = load_with("[server]\nlisten_addr = \"x\"\n", &[]).unwrap_err();
    assert!(err.to_string().contains("listen_addr"), "{err}");

    let err = load_with("[run_store]\ndatabase_url = \"mysql://x\"\n", &[]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid config: run_store.database_url:"),
        "{err}"
    );
}

#[test]
fn a_short_operator_token_is_refused_without_echoing_it() {
    let err = load_with("[auth]\noperator_token = \"hunter2\"\n", &[]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("invalid config: auth.operator_token:"),
        "{msg}"
    );
    assert!(!msg.contains("hunter2"), "{msg}");
}

#[test]
fn a_profile_may_take_the_network_away_and_says_so_once() {
    let entry = |credential: &str, network: &str| {
        format!(
            "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"{credential}\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n{network}"
        )
    };
    let offline = load_with(
        &(entry("a", "network = \"none\"\n") + &entry("b", "network = \"none\"\n")),
        &[],
    )
    .unwrap();
    assert_eq!(
        offline.credential_health.offline_profiles(),
        ["p".to_owned()].into()
    );
    let default = load_with(&entry("a", ""), &[]).unwrap();
    assert!(default.credential_health.offline_profiles().is_empty());
    let mixed = load_with(&(entry("a", "network = \"none\"\n") + &entry("b", "")), &[])
        .unwrap_err()
        .to_string();
    assert!(
        mixed.contains("profile `p` gives its sandboxes two networks"),
        "{mixed}"
    );
    assert!(load_with(&entry("a", "network = \"off\"\n"), &[]).is_err());
}

#[test]
fn the_service_token_is_required_to_serve_and_is_not_the_operator_token() {
    let operator = "o".repeat(32);
    let none = load_with(&format!("[auth]\noperator_token = \"{operator}\"\n"), &[]).unwrap();
    let missing = none
        .require_calling_token(ServiceRole::RunStore)
        .unwrap_err()
        .to_string();
    assert!(
        missing.starts_with("invalid config: auth.service_token: required to serve"),
        "{missing}"
    );
    let same = load_with(
        &format!("[auth]\noperator_token = \"{operator}\"\nservice_token = \"{operator}\"\n"),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        same.contains("auth.service_token: must differ from auth.operator_token"),
        "{same}"
    );
    assert!(!same.contains(&operator), "{same}");
    let short = load_with("[auth]\nservice_token = \"hunter2\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(
        short.starts_with("invalid config: auth.service_token:"),
        "{short}"
    );
    assert!(!short.contains("hunter2"), "{short}");
    let both = load_with(
        &format!(
            "[auth]\noperator_token = \"{operator}\"\nservice_token = \"{}\"\n",
            "s".repeat(32)
        ),
        &[],
    )
    .unwrap();
    assert!(both.require_calling_token(ServiceRole::RunStore).is_ok());
}

#[test]
fn secrets_do_not_debug_print() {
    let config = load_with(
        "[auth]\noperator_token = \"0123456789abcdef0123456789abcdef\"\n",
        &[],
    )
    .unwrap();
    let debug = format!("{config:?}");
    assert!(!debug.contains("0123456789abcdef"), "{debug}");
    assert!(debug.contains("<redacted>"));
}

#[test]
fn tls_fields_come_in_pairs_and_errors_name_the_missing_field() {
    let err = load_with("[tls]\ncert_file = \"server.pem\"\n", &[]).unwrap_err();
    assert!(
        err.to_string().starts_with("invalid config: tls.key_file:"),
        "{err}"
    );

    let err = load_with("", &[("RUNPLANE_TLS__KEY_FILE", "server.key")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid config: tls.cert_file:"),
        "{err}"
    );

    let err = load_with("[tls]\nclient_ca_file = \"ca.pem\"\n", &[]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid config: tls.cert_file:"),
        "{err}"
    );

    let err = load_with("[run_store]\nendpoint = \"https://run-store:7070\"\n", &[]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("invalid config: tls.ca_file:"), "{msg}");
    assert!(msg.contains("run_store.endpoint"), "{msg}");

    let err = load_with("[tls]\ncertfile = \"x\"\n", &[]).unwrap_err();
    assert!(err.to_string().contains("certfile"), "{err}");

    let config = load_with(
        "[tls]\ncert_file = \"s.pem\"\nkey_file = \"s.key\"\nclient_ca_file = \"ca.pem\"\n",
        &[("RUNPLANE_TLS__CA_FILE", "ca.pem")],
    )
    .expect("a complete [tls] loads; the files are read later");
    assert!(config.tls.serves_tls());
    assert!(config.tls.requires_client_certificates());
    assert_eq!(config.tls.ca_file, "ca.pem");
}

#[test]
fn an_endpoint_list_is_checked_entry_by_entry_without_echoing_secrets() {
    let config = load_with(
        "[run_store]\nendpoint = \"http://run-store-0:7070, http://run-store-1:7070\"\n",
        &[],
    )
    .expect("a list of replicas loads");
    assert!(config.run_store.endpoint.contains("run-store-1"));
    for (list, says) in [
        (
            "http://a:1,run-store:7070",
            "entry 2 of the list (`run-store:7070`)",
        ),
        ("http://a:1,,http://b:1", "entry 2 of the list is empty"),
        ("http://a:1/v1", "no path"),
    ] {
        let err = load_with(&format!("[run_store]\nendpoint = \"{list}\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run_store.endpoint") && err.contains(says),
            "{err}"
        );
    }
    let err = load_with(
        "[credential_health]\nendpoint = \"http://a:1,http://u:hunter2-secret@b:1\"\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("credential_health.endpoint"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // An https:// entry anywhere in the list needs a CA.
    let err = load_with("[run_store]\nendpoint = \"http://a:1,https://b:1\"\n", &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("tls.ca_file"), "{err}");
}

#[test]
fn isolation_is_bwrap_unless_none_is_chosen_and_a_bad_uid_range_is_refused() {
    let default = load_with("", &[]).unwrap().sandbox_reconciler;
    assert_eq!(default.isolation, Isolation::Bwrap);
    assert_eq!(default.network, SandboxNetwork::Outbound);
    let chosen = load_with(
        "[sandbox_reconciler]\nisolation = \"none\"\nnetwork = \"none\"\n",
        &[],
    )
    .unwrap()
    .sandbox_reconciler;
    assert_eq!(chosen.isolation, Isolation::None);
    assert_eq!(chosen.network, SandboxNetwork::None);
    let unknown = load_with("[sandbox_reconciler]\nisolation = \"off\"\n", &[]);
    assert!(unknown.is_err(), "{unknown:?}");
    for range in [
        "sandbox_uid_base = 0",
        "sandbox_uid_count = 0",
        "sandbox_uid_base = 4294967295",
    ] {
        let err = load_with(&format!("[sandbox_reconciler]\n{range}\n"), &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("sandbox_reconciler.sandbox_uid_base"),
            "{range}: {err}"
        );
    }
}

#[test]
fn a_profiles_orgs_are_names_and_an_absent_list_shares_it() {
    let profile = "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"c\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n";
    let shared = load_with(profile, &[]).unwrap();
    assert!(shared.credential_health.profiles[0].orgs.is_empty());
    let owned = load_with(&format!("{profile}orgs = [\"acme\", \"globex\"]\n"), &[]).unwrap();
    assert_eq!(owned.credential_health.profiles[0].orgs, ["acme", "globex"]);
    let err = load_with(&format!("{profile}orgs = [\"acme\", \"a b\"]\n"), &[]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid config: credential_health.profiles[0].orgs[1]:"),
        "{err}"
    );
}

#[test]
fn a_missing_file_is_named() {
    let err = Config::load(Some(Path::new("/nonexistent/runplane.toml"))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config file /nonexistent/runplane.toml does not exist"
    );
}

#[test]
fn sandbox_limits_default_to_bounds_and_out_of_range_ones_are_refused_by_name() {
    let default = load_with("", &[]).unwrap().sandbox_reconciler;
    assert_eq!(default.limits.memory_mib, 4096);
    assert_eq!(default.limits.pids, 512);
    assert!(default.unenforced_limits.is_empty());
    let chosen = load_with(
        "[sandbox_reconciler]\nunenforced_limits = [\"disk\"]\n[sandbox_reconciler.limits]\nmemory_mib = 64\n",
        &[("RUNPLANE_SANDBOX_RECONCILER__LIMITS__PIDS", "32")],
    )
    .unwrap()
    .sandbox_reconciler;
    assert_eq!(
        (
            chosen.limits.memory_mib,
            chosen.limits.pids,
            chosen.limits.cpus
        ),
        (64, 32, 2.0)
    );
    assert_eq!(chosen.unenforced_limits, vec![Limit::Disk]);
    for (bad, field) in [
        ("memory_mib = 15", "sandbox_reconciler.limits.memory_mib"),
        ("pids = 0", "sandbox_reconciler.limits.pids"),
        ("cpus = 0.0", "sandbox_reconciler.limits.cpus"),
        ("disk_mib = 1", "sandbox_reconciler.limits.disk_mib"),
    ] {
        let err = load_with(&format!("[sandbox_reconciler.limits]\n{bad}\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{bad}: {err}");
    }
    let unknown = load_with("[sandbox_reconciler]\nunenforced_limits = [\"gpu\"]\n", &[]);
    assert!(unknown.is_err(), "{unknown:?}");
}

#[test]
fn a_profile_sets_its_own_limits_over_the_deployments_once_and_in_bounds() {
    let entry = |credential: &str, limits: &str| {
        format!(
            "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"{credential}\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n{limits}\n"
        )
    };
    let config = load_with(
        &(entry("a", "limits = { memory_mib = 64 }") + "[sandbox_reconciler.limits]\npids = 100\n"),
        &[],
    )
    .unwrap();
    let limits = config
        .credential_health
        .profile_limits(&config.sandbox_reconciler.limits);
    assert_eq!(
        limits.get("p").map(|l| (l.memory_mib, l.pids, l.disk_mib)),
        Some((64, 100, 10 * 1024))
    );
    let bad = load_with(&entry("a", "limits = { pids = 0 }"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("credential_health.profiles[0].limits.pids"),
        "{bad}"
    );
    let twice = load_with(
        &(entry("a", "limits = { memory_mib = 64 }") + &entry("b", "limits = { memory_mib = 65 }")),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(twice.contains("two sets of limits"), "{twice}");
    let unknown = load_with(&entry("a", "limits = { gpus = 1 }"), &[]);
    assert!(unknown.is_err(), "{unknown:?}");
}

#[test]
fn a_profile_names_its_own_image_once_and_as_a_reference() {
    let entry = |credential: &str, image: &str| {
        format!(
            "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"{credential}\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n{image}\n"
        )
    };
    let config = load_with(
        &entry("a", "image = \"docker.io/library/python:3.12\""),
        &[],
    )
    .unwrap();
    assert_eq!(
        config
            .credential_health
            .profile_images()
            .get("p")
            .map(String::as_str),
        Some("docker.io/library/python:3.12")
    );
    let none = load_with(&entry("a", ""), &[]).unwrap();
    assert!(none.credential_health.profile_images().is_empty());
    let bad = load_with(&entry("a", "image = \"Not An Image!\""), &[])
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("credential_health.profiles[0].image")
            && bad.contains("not an image reference"),
        "{bad}"
    );
    let twice = load_with(
        &(entry("a", "image = \"python:3.12\"") + &entry("b", "image = \"python:3.13\"")),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(twice.contains("two images"), "{twice}");
}

#[test]
fn the_operator_token_may_be_given_by_its_digest_alone() {
    let digest = "a".repeat(64);
    let config = load_with(
        &format!("[auth]\noperator_token_sha256 = \"{digest}\"\n[auth.org_token_sha256]\nacme = \"{digest}\"\n"),
        &[],
    )
    .expect("digests load");
    assert!(
        config.require_operator_token().is_ok(),
        "a digest is enough to serve"
    );

    let bad = load_with("[auth]\noperator_token_sha256 = \"not-hex\"\n", &[]).unwrap_err();
    assert!(
        bad.to_string()
            .contains("auth.operator_token_sha256: must be 64 hex digits"),
        "{bad}"
    );
    let both = load_with(
        &format!(
            "[auth]\noperator_token = \"{}\"\noperator_token_sha256 = \"{digest}\"\n",
            "o".repeat(40)
        ),
        &[],
    )
    .unwrap_err();
    assert!(both.to_string().contains("not both"), "{both}");
    let org_twice = load_with(
        &format!(
            "[auth.org_tokens]\nacme = \"{}\"\n[auth.org_token_sha256]\nacme = \"{digest}\"\n",
            "t".repeat(40)
        ),
        &[],
    )
    .unwrap_err();
    assert!(
        org_twice.to_string().contains("org acme has a token"),
        "{org_twice}"
    );
}

#[test]
fn a_profiles_retry_policy_is_bounded_and_a_bad_one_is_refused_by_name() {
    let profile = "[[credential_health.profiles]]\nname = \"p\"\ncredential_id = \"c\"\ncapacity = 1\nerror_pattern = \"e\"\nexhausted_pattern = \"x\"\n";
    let unset = load_with(profile, &[]).unwrap();
    assert_eq!(unset.credential_health.profiles[0].retry, None);
    let set = load_with(
        &format!("{profile}retry = {{ max_attempts = 5, backoff_seconds = 0.5, exit_codes = [3, 75], on_out_of_memory = true }}\n"),
        &[],
    )
    .unwrap();
    assert_eq!(
        set.credential_health.profiles[0].retry,
        Some(crate::RetryPolicy {
            max_attempts: 5,
            backoff_seconds: 0.5,
            max_backoff_seconds: 30.0,
            exit_codes: vec![3, 75],
            on_out_of_memory: true,
            on_image_unavailable: false,
        })
    );
    for (retry, field) in [
        ("max_attempts = 0", "retry.max_attempts"),
        ("max_attempts = 101", "retry.max_attempts"),
        ("backoff_seconds = -1.0", "retry.backoff_seconds"),
        ("max_backoff_seconds = 0.5", "retry.max_backoff_seconds"),
        ("max_backoff_seconds = 3601.0", "retry.max_backoff_seconds"),
        ("exit_codes = [3, 256]", "retry.exit_codes[1]"),
        ("exit_codes = [0]", "retry.exit_codes[0]"),
        ("attempts = 2", "retry"),
    ] {
        let err = load_with(&format!("{profile}retry = {{ {retry} }}\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("credential_health.profiles[0].{field}"))
                || (field == "retry" && err.contains("attempts")),
            "{retry}: {err}"
        );
    }
}
