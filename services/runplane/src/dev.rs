//! `runplane dev`: all four services in one process on one port, on an embedded default
//! (SQLite under the data directory, the in-process coordinator store), with an operator
//! token and a service token generated once and kept in the data directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rand::RngCore;
use runplane_config::{Config, Secret};
use runplane_run_store::domain::receipt::ReceiptSigner;

use runplane_config::{DriverKind, Isolation, SandboxNetwork};
use runplane_sandbox::process::ContainmentError;

use crate::startup::{EMBEDDED_STORE, Selection, bind, init_telemetry, open, run_until};

const TOKEN_FILE: &str = "operator-token";
const SERVICE_TOKEN_FILE: &str = "service-token";
const RECEIPT_KEY_FILE: &str = "receipt-signing-key";

/// `--driver` and `--image`: what a sandbox is, over the config's choice.
#[derive(Debug, Default)]
pub struct DriverChoice {
    pub driver: Option<String>,
    pub image: Option<String>,
}

pub async fn dev(
    config_file: Option<&Path>,
    listen: &str,
    data_dir: &Path,
    choice: DriverChoice,
) -> anyhow::Result<()> {
    let mut config = Config::load(config_file)?;
    match choice.driver.as_deref() {
        Some("container") => config.sandbox_reconciler.driver = DriverKind::Container,
        Some("process") => config.sandbox_reconciler.driver = DriverKind::Process,
        _ => {}
    }
    if let Some(image) = choice.image {
        config.sandbox_reconciler.container.image = image;
    }
    let _telemetry = init_telemetry(&config, "runplane-dev")?;
    runplane_grpc::tls::install(&config.tls)?;
    // Before the banner: a user may press Ctrl-C the moment it appears.
    let shutdown = runplane_grpc::shutdown_signal();

    let data_dir = prepare_data_dir(data_dir)?;
    let random_token = || {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    };
    if config.auth.operator_token.is_empty() {
        config.auth.operator_token = kept_secret(&data_dir, TOKEN_FILE, random_token)?;
    }
    // What the services call each other with, inside this process; never printed.
    if config.auth.service_token.is_empty() {
        config.auth.service_token = kept_secret(&data_dir, SERVICE_TOKEN_FILE, random_token)?;
    }
    if config.run_store.receipt_signing_key.is_empty() {
        config.run_store.receipt_signing_key = kept_secret(&data_dir, RECEIPT_KEY_FILE, || {
            ReceiptSigner::generate().seed_hex()
        })?;
    }
    let listener = bind(listen).await?;
    let addr = listener.local_addr()?;
    // With [tls] the services reach each other (and sandboxes reach them) over TLS: the
    // certificate needs an IP SAN for the listen address, and tls.ca_file must trust it.
    let scheme = if config.tls.serves_tls() {
        "https"
    } else {
        "http"
    };
    let endpoint = format!("{scheme}://{addr}");
    let sqlite = |name: &str| format!("sqlite://{}", data_dir.join(name).display());
    config.server.listen = addr.to_string();
    config.run_store.database_url = sqlite("run-store.sqlite");
    config.run_store.endpoint = endpoint.clone();
    config.sandbox_reconciler.database_url = sqlite("sandbox-reconciler.sqlite");
    config.sandbox_reconciler.endpoint = endpoint.clone();
    config.sandbox_reconciler.state_dir = data_dir.join("sandboxes").display().to_string();
    config.sandbox_reconciler.tick_interval_ms = 500;
    config.stream_recovery.endpoint = endpoint.clone();
    config.stream_recovery.redis_url = EMBEDDED_STORE.to_owned();
    config.credential_health.database_url = sqlite("credential-health.sqlite");
    config.credential_health.endpoint = endpoint;
    config.validate()?;

    let (containment, gave_up) = best_containment(&mut config).await?;
    let isolation = if config.sandbox_reconciler.local_sandboxes {
        let mut isolation = containment.describe();
        for what in &gave_up {
            isolation.push_str(&format!("\n  NOT CONTAINED:  {what}"));
        }
        isolation
    } else {
        "no local sandboxes (sandbox_reconciler.local_sandboxes = false): runs go to node \
         agents, each containing its own"
            .to_owned()
    };
    let services = open(&config, Selection::all(), Some(containment)).await?;
    print_banner(&config, &data_dir, services.names(), &isolation)?;
    run_until(listener, services, &config, shutdown).await
}

fn prepare_data_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot restrict {}", dir.display()))?;
    }
    Ok(dir.canonicalize()?)
}

/// A secret kept in `<data_dir>/<name>`, made by `generate` (mode 0600) on first start so
/// that what was configured once (clients' token, receipts' key) survives restarts.
fn kept_secret(
    data_dir: &Path,
    name: &str,
    generate: impl FnOnce() -> String,
) -> anyhow::Result<Secret> {
    let path = data_dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(token) if token.trim().len() >= 32 => return Ok(Secret::new(token.trim())),
        Ok(_) => anyhow::bail!(
            "{} holds no valid secret; delete it to have a new one generated",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
    let token = generate();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    writeln!(file, "{token}")?;
    Ok(Secret::new(token))
}

/// The best containment this host offers `runplane dev`'s local sandboxes, and what it
/// had to give up of the configured one, each said with why and how to get it back.
///
/// `serve` and `node` refuse to start without what they are configured with; `dev` is
/// the one command a newcomer runs first on whatever machine they have, so it takes what
/// the host can do and its banner says, in capitals, what an agent is not held to.
async fn best_containment(
    config: &mut Config,
) -> anyhow::Result<(runplane_sandbox::process::Containment, Vec<String>)> {
    let mut gave_up = Vec::new();
    // Each refusal gives one thing up; there are three to give.
    for _ in 0..4 {
        match local_containment_of(config).await {
            Ok(containment) => return Ok((containment, gave_up)),
            Err(ContainmentError::Network(why)) => {
                config.sandbox_reconciler.network = SandboxNetwork::Host;
                gave_up.push(format!(
                    "agents share this host's network, its loopback included ({why}; \
                     install slirp4netns and nftables and run as root for a network of \
                     their own)"
                ));
            }
            Err(ContainmentError::Limits(missing)) => {
                let named: Vec<String> = missing.0.keys().map(ToString::to_string).collect();
                config
                    .sandbox_reconciler
                    .unenforced_limits
                    .extend(missing.0.keys().copied());
                gave_up.push(format!(
                    "no {} limit ({})",
                    named.join(", "),
                    runplane_sandbox::process::limits::describe_missing(&missing.0)
                ));
            }
            // The driver the developer asked for, or nothing: no fallback to another.
            Err(e @ ContainmentError::Engine(_)) => return Err(e.into()),
            Err(ContainmentError::Isolation(why)) => {
                config.sandbox_reconciler.isolation = Isolation::None;
                gave_up.push(format!(
                    "agents run as this user and see what it sees ({}; install \
                     bubblewrap: apt-get install bubblewrap)",
                    why.0
                ));
            }
        }
    }
    Ok((local_containment_of(config).await?, gave_up))
}

async fn local_containment_of(
    config: &Config,
) -> Result<runplane_sandbox::process::Containment, ContainmentError> {
    if !config.sandbox_reconciler.local_sandboxes {
        return Ok(runplane_sandbox::process::Containment::None);
    }
    runplane_sandbox::process::Containment::probe(&config.sandbox_reconciler).await
}

fn print_banner(
    config: &Config,
    data_dir: &Path,
    services: &[&str],
    isolation: &str,
) -> anyhow::Result<()> {
    let addr = &config.server.listen;
    let mut out = std::io::stdout().lock();
    writeln!(out, "runplane dev: serving on {addr}")?;
    writeln!(
        out,
        "  data:           {} (SQLite; stream recovery store in process)",
        data_dir.display()
    )?;
    // Shown on purpose: this is the developer's own embedded instance.
    writeln!(
        out,
        "  operator token: {}  (kept in {})",
        config.auth.operator_token.expose(),
        data_dir.join(TOKEN_FILE).display()
    )?;
    writeln!(out, "  services:       {}", services.join(", "))?;
    writeln!(out, "  isolation:      {isolation}")?;
    let tls = &config.tls;
    let grpcurl = match (tls.serves_tls(), tls.requires_client_certificates()) {
        (false, _) => "grpcurl -plaintext".to_owned(),
        (true, false) => format!("grpcurl -cacert {}", tls.ca_file),
        (true, true) => format!(
            "grpcurl -cacert {} -cert {} -key {}",
            tls.ca_file, tls.cert_file, tls.key_file
        ),
    };
    writeln!(
        out,
        "  tls:            {}",
        runplane_grpc::tls::installed().server_mode()
    )?;
    writeln!(out, "try:")?;
    writeln!(out, "  {grpcurl} {addr} list")?;
    writeln!(
        out,
        "  {grpcurl} -d '{{\"service\":\"{}\"}}' {addr} grpc.health.v1.Health/Check",
        services.first().copied().unwrap_or("")
    )?;
    out.flush()?;
    Ok(())
}
