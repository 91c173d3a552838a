//! The image and the deploy docs: `deploy/Dockerfile` and `.dockerignore`, checked without
//! Docker, and `deploy/README.md`.

mod deploy_common;

use std::collections::BTreeSet;

use deploy_common::{PORT, deploy, read, repo};

#[test]
fn the_dockerfile_builds_the_binary_locked_and_runs_it_unprivileged_on_7070() {
    let dockerfile = read(&deploy().join("Dockerfile"));
    assert!(dockerfile.contains("cargo build --release -p runplane --locked"));
    assert!(
        dockerfile.contains("--mount=type=cache"),
        "cargo cache mounts"
    );
    assert!(dockerfile.contains("ENTRYPOINT [\"runplane\"]"));
    assert!(
        dockerfile
            .lines()
            .any(|l| l.trim() == format!("EXPOSE {PORT}"))
    );
    let user = dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("USER "))
        .next_back()
        .expect("the image sets a USER");
    assert!(
        !user.starts_with("root") && !user.starts_with("0"),
        "USER {user}"
    );

    let ignored: BTreeSet<&str> = [".git", "target", ".runplane"].into();
    let dockerignore = read(&repo().join(".dockerignore"));
    for entry in ignored {
        assert!(
            dockerignore
                .lines()
                .any(|l| l.trim().trim_end_matches('/') == entry),
            ".dockerignore should exclude {entry}"
        );
    }
}

#[test]
fn the_deploy_readme_points_at_the_example_config() {
    let readme = read(&deploy().join("README.md"));
    assert!(readme.contains("runplane.example.toml"));
    assert!(deploy().join("runplane.example.toml").is_file());
}
