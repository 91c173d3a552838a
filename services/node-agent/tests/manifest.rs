//! The node agent sits beside untrusted agents and holds only its own node credential:
//! its manifest names no database or Redis crate and no service that owns a store, so
//! nothing here can reach one.

/// Crates that reach a store, directly or by owning one.
const STORE_CRATES: [&str; 7] = [
    "sea-orm",
    "sea-orm-migration",
    "sqlx",
    "redis",
    "runplane-db",
    "runplane-sandbox-reconciler",
    "runplane-run-store",
];

#[test]
fn the_node_agent_depends_on_no_store() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("the node agent's Cargo.toml");
    let mut section = String::new();
    let mut dependencies_seen = false;
    let mut named = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_owned();
            continue;
        }
        if section != "[dependencies]" {
            continue;
        }
        dependencies_seen = true;
        let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
        if STORE_CRATES.contains(&name) {
            named.push(name.to_owned());
        }
    }
    assert!(dependencies_seen, "the manifest lists its [dependencies]");
    assert!(named.is_empty(), "the node agent depends on {named:?}");
}
