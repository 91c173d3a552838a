//! A contained agent's network when it is `outbound` (the default): a network namespace
//! of the sandbox's own, reaching out through slirp4netns (user-mode networking: the
//! agent's connections leave as ordinary sockets of the host) with the host's loopback
//! disabled, and an nftables filter inside the namespace that refuses the host's own
//! addresses and the control plane's. The agent has no capability there, so it cannot
//! lift the filter; the filter sits in the agent's namespace, not the host's, so nothing
//! of the host's own firewall changes.
//!
//! Each sandbox's namespace is `/run/netns/runplane-<sandbox id>` (made with `ip netns`),
//! its slirp4netns a process of its own session, recorded in the sandbox's directory so
//! a restarted driver finds it again and destroy stops it.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use super::tools::{find, path_of, run};
use crate::driver::DriverError;

/// slirp4netns's fixed addresses inside the namespace: the gateway (the host) and DNS.
const SLIRP_GATEWAY: &str = "10.0.2.2";
const SLIRP_DNS: &str = "10.0.2.3";
/// The agent's address inside its namespace, once slirp4netns has configured `tap0`.
const SLIRP_GUEST: &str = "10.0.2.100";
/// The pid file of a sandbox's slirp4netns, in its directory.
const SLIRP_PID: &str = "slirp.pid";
/// The resolver a sandbox with outbound network is given: slirp4netns's DNS forwarder,
/// since the host's own resolver may sit on its loopback, which the agent cannot reach.
pub const RESOLV_CONF: &str = "resolv.conf";

/// The network namespace of sandbox `id`.
pub fn netns_name(id: &str) -> String {
    format!("runplane-{id}")
}

pub fn netns_path(id: &str) -> PathBuf {
    Path::new("/run/netns").join(netns_name(id))
}

/// Whether this host can give sandboxes outbound network: root, `ip netns`, nft and
/// slirp4netns, tried on a probe namespace that is removed at once.
pub async fn probe() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("a network namespace per sandbox is made as root".into());
    }
    for tool in ["slirp4netns", "nft", "ip"] {
        if find(tool).is_none() {
            return Err(format!(
                "{tool} is not installed (Debian: apt-get install slirp4netns nftables iproute2)"
            ));
        }
    }
    let name = format!("runplane-probe-{}", uuid::Uuid::new_v4().simple());
    let made = run("ip", &["netns", "add", name.as_str()], None).await;
    let filtered = match &made {
        Ok(()) => filter(&name, &BTreeSet::new()).await,
        Err(e) => Err(e.clone()),
    };
    let _ = run("ip", &["netns", "delete", name.as_str()], None).await;
    made.and(filtered)
}

/// Brings up sandbox `id`'s namespace (idempotently: one whose slirp4netns lives is
/// left as it is), refusing `refused` besides the host's own addresses. The namespace is
/// a new one, or with `join` the one process `join` is in (a warm container's holder),
/// named for the sandbox all the same.
pub async fn up(
    dir: &Path,
    id: &str,
    refused: &BTreeSet<IpAddr>,
    join: Option<u32>,
) -> Result<(), DriverError> {
    let name = netns_name(id);
    // Inside the namespace by full path: `ip netns exec` looks commands up in a PATH
    // that may lack sbin.
    let ip = path_of("ip").to_string_lossy().into_owned();
    let start = |what: &str, e: String| DriverError::Start(format!("{what}: {e}"));
    if netns_path(id).exists() && slirp_pid(dir, id).is_some() {
        return Ok(());
    }
    if !netns_path(id).exists() {
        let pid = join.map(|pid| pid.to_string());
        let made = match &pid {
            Some(pid) => run("ip", &["netns", "attach", name.as_str(), pid], None).await,
            None => run("ip", &["netns", "add", name.as_str()], None).await,
        };
        made.map_err(|e| start("making the sandbox's network namespace", e))?;
    }
    run(
        "ip",
        &[
            "netns",
            "exec",
            name.as_str(),
            &ip,
            "link",
            "set",
            "lo",
            "up",
        ],
        None,
    )
    .await
    .map_err(|e| start("raising the sandbox's loopback", e))?;
    let mut refused = refused.clone();
    refused.extend(host_addresses().await);
    filter(&name, &refused)
        .await
        .map_err(|e| start("filtering the sandbox's network", e))?;
    std::fs::write(dir.join(RESOLV_CONF), format!("nameserver {SLIRP_DNS}\n"))
        .map_err(|e| start("writing the sandbox's resolv.conf", e.to_string()))?;

    let log = std::fs::File::create(dir.join("slirp.log"))
        .map_err(|e| start("creating slirp.log", e.to_string()))?;
    let slirp = path_of("slirp4netns");
    let netns = netns_path(id);
    let mut command = tokio::process::Command::new("setsid");
    command
        .arg(&slirp)
        .args([
            "--configure",
            "--mtu=65520",
            "--disable-host-loopback",
            "--netns-type=path",
        ])
        .arg(&netns)
        .arg("tap0")
        .stdin(Stdio::null())
        .stdout(
            log.try_clone()
                .map_err(|e| start("slirp.log", e.to_string()))?,
        )
        .stderr(log)
        .kill_on_drop(false);
    let mut child = command
        .spawn()
        .map_err(|e| start("starting slirp4netns", e.to_string()))?;
    let pid = child.id().unwrap_or_default();
    std::fs::write(dir.join(SLIRP_PID), pid.to_string())
        .map_err(|e| start("recording slirp4netns's pid", e.to_string()))?;
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    // Ready once tap0 holds the guest's address; the agent must not start before.
    for _ in 0..250 {
        let mut show = tokio::process::Command::new(path_of("ip"));
        show.args([
            "netns", "exec", &name, &ip, "-o", "-4", "addr", "show", "dev", "tap0",
        ]);
        if let Ok(out) = show.stdin(Stdio::null()).output().await
            && String::from_utf8_lossy(&out.stdout).contains(SLIRP_GUEST)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(DriverError::Start(format!(
        "slirp4netns did not configure the sandbox's network within 5 s: {}",
        std::fs::read_to_string(dir.join("slirp.log"))
            .unwrap_or_default()
            .trim()
    )))
}

/// Stops sandbox `id`'s slirp4netns and removes its namespace; nothing of either left.
pub async fn down(dir: &Path, id: &str) {
    if let Some(pid) = slirp_pid(dir, id) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let _ = std::fs::remove_file(dir.join(SLIRP_PID));
    if netns_path(id).exists() {
        let _ = run("ip", &["netns", "delete", netns_name(id).as_str()], None).await;
    }
}

/// The pid of sandbox `id`'s slirp4netns, when that process lives and is still it.
fn slirp_pid(dir: &Path, id: &str) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(dir.join(SLIRP_PID))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    String::from_utf8_lossy(&cmdline)
        .contains(&netns_name(id))
        .then_some(pid)
}

/// The filter inside namespace `name`: everything out, but to `refused` and slirp's
/// gateway (the host) nothing. Replaces any filter it had.
async fn filter(name: &str, refused: &BTreeSet<IpAddr>) -> Result<(), String> {
    let v4: Vec<String> = refused
        .iter()
        .filter(|a| a.is_ipv4())
        .map(ToString::to_string)
        .chain([SLIRP_GATEWAY.to_owned()])
        .collect();
    let v6: Vec<String> = refused
        .iter()
        .filter(|a| a.is_ipv6())
        .map(ToString::to_string)
        .collect();
    let mut rules = format!(
        "table inet runplane\ndelete table inet runplane\ntable inet runplane {{\n  chain output {{\n    type filter hook output priority 0; policy accept;\n    ip daddr {{ {} }} reject\n",
        v4.join(", ")
    );
    if !v6.is_empty() {
        rules.push_str(&format!("    ip6 daddr {{ {} }} reject\n", v6.join(", ")));
    }
    rules.push_str("  }\n}\n");
    run(
        "ip",
        &["netns", "exec", name, "nft", "-f", "-"],
        Some(&rules),
    )
    .await
}

/// Every address of this host, loopback aside (the agent's own loopback is its own).
async fn host_addresses() -> BTreeSet<IpAddr> {
    let Ok(out) = tokio::process::Command::new(path_of("ip"))
        .args(["-o", "addr", "show"])
        .stdin(Stdio::null())
        .output()
        .await
    else {
        return BTreeSet::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(2);
            match fields.next()? {
                "inet" | "inet6" => fields.next()?.split('/').next()?.parse().ok(),
                _ => None,
            }
        })
        .filter(|addr: &IpAddr| !addr.is_loopback())
        .collect()
}

/// The addresses `endpoint` (a URL, or several separated by commas) resolves to.
pub async fn endpoint_addresses(endpoint: &str) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    for url in endpoint.split(',') {
        let rest = url.trim().split_once("://").map_or(url.trim(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or_default();
        let host_port = if authority.contains(':') {
            authority.to_owned()
        } else {
            format!("{authority}:443")
        };
        if let Ok(addrs) = tokio::net::lookup_host(host_port).await {
            out.extend(addrs.map(|a| a.ip()).filter(|ip| !ip.is_loopback()));
        }
    }
    out
}
