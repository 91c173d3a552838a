//! Every method the runner calls is classified, and every call goes through the
//! retrying transport. The list of methods is derived from the runner's source, not
//! written down here, so a new call cannot slip past.

use std::path::Path;

use prost_reflect::DescriptorPool;

fn runner_source() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![dir];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push((
                    path.display().to_string(),
                    std::fs::read_to_string(&path).unwrap(),
                ));
            }
        }
    }
    files
}

fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// `/package.Service/Method` of every RPC runplane defines, with its client method name.
fn all_methods() -> Vec<(String, String)> {
    let pool = DescriptorPool::decode(runplane_proto::FILE_DESCRIPTOR_SET).unwrap();
    pool.services()
        .filter(|s| s.full_name().starts_with("runplane."))
        .flat_map(|s| {
            s.methods()
                .map(|m| (format!("/{}/{}", s.full_name(), m.name()), snake(m.name())))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn every_method_the_runner_calls_is_classified() {
    let source = runner_source();
    let called: Vec<(String, String)> = all_methods()
        .into_iter()
        .filter(|(_, rust_name)| {
            source
                .iter()
                .any(|(_, text)| text.contains(&format!(".{rust_name}(")))
        })
        .collect();
    let names: Vec<&str> = called.iter().map(|(p, _)| p.as_str()).collect();
    assert!(
        names.contains(&"/runplane.runstore.v1.RunnerService/Hello")
            && names.contains(&"/runplane.runstore.v1.RunnerService/AppendEvents")
            && names.contains(&"/runplane.runstore.v1.RunnerService/PollSteering")
            && names.contains(&"/runplane.runstore.v1.RunnerService/SubmitResult"),
        "the derivation finds the runner's calls: {names:?}"
    );
    for (path, _) in &called {
        let policy = runplane_proto::policy_for(path)
            .unwrap_or_else(|| panic!("{path} is called by the runner but has no policy"));
        assert!(
            policy.replay_safety.is_replay_safe(),
            "{path} is not replay-safe: the runner could not retry it through an outage"
        );
    }
}

#[test]
fn no_runner_call_goes_around_the_transport() {
    for (file, text) in runner_source() {
        for forbidden in [
            "tonic::transport",
            "Endpoint::",
            "Channel::",
            "runplane_grpc::client::connect",
            "ServiceClient::new(",
            "ServiceClient::connect(",
        ] {
            assert!(
                !text.contains(forbidden),
                "{file} uses `{forbidden}`: runner clients must be built on runplane_transport"
            );
        }
        // The one way a client is built: on a channel from the retrying transport.
        for (at, _) in text.match_indices("ServiceClient::with_interceptor(") {
            let statement_start = text[..at].rfind(';').unwrap_or(0);
            let before = &text[statement_start..at];
            let channel_from_transport = text[..at].contains("runplane_transport::connect_lazy(");
            assert!(
                channel_from_transport && before.contains("Client"),
                "{file}: a client built on a channel that did not come from runplane_transport"
            );
        }
    }
}
