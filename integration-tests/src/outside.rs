//! A host outside this one, for the tests of a sandbox's network: a network namespace
//! behind a veth pair, with a server that answers `outside`.

use std::process::Stdio;
use std::time::Duration;

/// A host outside this one: a network namespace behind a veth pair, serving `outside`
/// on [`OUTSIDE_PORT`]. Removed on drop.
pub struct OutsideHost {
    netns: String,
    host_veth: String,
    /// The outside host's address, and the address this host has on the veth.
    pub address: String,
    pub host_side: String,
    server: std::process::Child,
}

pub const OUTSIDE_PORT: u16 = 8099;

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl OutsideHost {
    pub fn start() -> Self {
        let tag = std::process::id() % 100_000;
        let subnet = 1 + std::process::id() % 250;
        let netns = format!("rp-outside-{tag}");
        let (host_veth, outside_veth) = (format!("rpo{tag}a"), format!("rpo{tag}b"));
        let (host_side, address) = (format!("10.213.{subnet}.1"), format!("10.213.{subnet}.2"));
        ip(&["netns", "add", &netns]);
        ip(&[
            "link",
            "add",
            &host_veth,
            "type",
            "veth",
            "peer",
            "name",
            &outside_veth,
        ]);
        ip(&["link", "set", &outside_veth, "netns", &netns]);
        ip(&["addr", "add", &format!("{host_side}/30"), "dev", &host_veth]);
        ip(&["link", "set", &host_veth, "up"]);
        let cidr = format!("{address}/30");
        for args in [
            vec!["addr", "add", cidr.as_str(), "dev", outside_veth.as_str()],
            vec!["link", "set", outside_veth.as_str(), "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["netns", "exec", netns.as_str(), "ip"];
            full.extend(args);
            ip(&full);
        }
        let server = std::process::Command::new("ip")
            .args(["netns", "exec", &netns, "python3", "-c"])
            .arg(format!(
                "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', {OUTSIDE_PORT}))\ns.listen(16)\nwhile True:\n    c, _ = s.accept()\n    c.sendall(b'outside\\n')\n    c.close()\n"
            ))
            .stdin(Stdio::null())
            .spawn()
            .expect("start the outside host's server");
        Self {
            netns,
            host_veth,
            address,
            host_side,
            server,
        }
    }
}

impl OutsideHost {
    /// Waits until the outside host's server answers.
    pub async fn serving(&self) {
        let at: std::net::SocketAddr = format!("{}:{OUTSIDE_PORT}", self.address)
            .parse()
            .expect("an address");
        crate::wait_for(
            "the outside host's server",
            Duration::from_secs(20),
            async || std::net::TcpStream::connect_timeout(&at, Duration::from_millis(500)).is_ok(),
        )
        .await;
    }
}

impl Drop for OutsideHost {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", &self.host_veth])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .status();
    }
}
