//! A contained agent's default network (`outbound`) reaches out but never the host: on
//! `runplane dev`, a hostile agent tries the control plane's own port, PostgreSQL and
//! Redis on the host's loopback, a listener on every address of the host, and a host
//! of its own outside this one (a network namespace joined by a veth pair). Only the
//! outside host answers. The agent also resolves names and reads the host's trust store,
//! which an agent with a uid of its own needs to call a model API.

use runplane_integration_tests::outside::{OUTSIDE_PORT, OutsideHost};
use runplane_integration_tests::{host_address, run_script, start_dev};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbound_agent_reaches_out_but_never_the_host_or_the_control_plane() {
    let outside = OutsideHost::start();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let data = dir.path().join("data");
    let dev = start_dev(&data).await;
    let port = dev.address.rsplit(':').next().unwrap().to_owned();
    // A listener on every address of the host, as a control plane serving 0.0.0.0 has.
    let everywhere = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let everywhere_port = everywhere.local_addr().unwrap().port().to_string();
    let host = host_address();

    let mut targets = vec![
        ("the control plane on loopback", format!("127.0.0.1/{port}")),
        ("PostgreSQL on loopback", "127.0.0.1/5432".to_owned()),
        ("Redis on loopback", "127.0.0.1/6379".to_owned()),
        ("the host's address", format!("{host}/{everywhere_port}")),
        (
            "the control plane on the host's address",
            format!("{host}/{port}"),
        ),
        (
            "the host's side of the veth",
            format!("{}/{everywhere_port}", outside.host_side),
        ),
        ("slirp's gateway (the host)", format!("10.0.2.2/{port}")),
    ];
    let outside_target = format!("{}/{OUTSIDE_PORT}", outside.address);
    outside.serving().await;
    targets.push(("the outside host", outside_target.clone()));

    let script = targets
        .iter()
        .map(|(_, t)| {
            format!(
                "if timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>/dev/null; then echo \"reached {t} $(timeout 2 bash -c 'exec 3<>/dev/tcp/{host}/{port}; head -n 1 <&3')\"; else echo \"refused {t}\"; fi",
                host = t.split('/').next().unwrap(),
                port = t.split('/').nth(1).unwrap(),
            )
        })
        .chain([
            "getent hosts localhost >/dev/null && echo 'resolves names'".to_owned(),
            "test -r /etc/resolv.conf && ls /etc/ssl/certs | grep -q . && echo 'trust store readable'".to_owned(),
        ])
        .collect::<Vec<_>>()
        .join("\n");
    let (status, stdout, stderr) = run_script(&dev, &data, &script).await;
    assert!(status.success(), "{stdout}\n{stderr}");
    for (what, target) in &targets[..targets.len() - 1] {
        assert!(
            stdout.contains(&format!("refused {target}")),
            "the agent reached {what} ({target}):\n{stdout}"
        );
    }
    assert!(
        stdout.contains(&format!("reached {outside_target} outside")),
        "the agent could not reach a host outside this one:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("resolves names"), "{stdout}");
    assert!(stdout.contains("trust store readable"), "{stdout}");
    drop(everywhere);
}
