//! `[node]`: a node agent of the direct substrate.

use serde::Deserialize;

/// A node agent (`runplane node`) of the direct substrate.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// The node's id; stable across restarts.
    pub id: String,
    /// `host:port` where sessions reach this node, as registered.
    pub endpoint: String,
    /// `host:port` its session endpoint listens on; empty: `endpoint`'s.
    pub listen: String,
    /// Sandboxes this node runs at once.
    pub capacity: u32,
    /// Where the node keeps its sandboxes' pid, exit status and runner log.
    pub state_dir: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            id: "node-1".to_owned(),
            endpoint: "127.0.0.1:7443".to_owned(),
            listen: String::new(),
            capacity: 8,
            state_dir: ".runplane/node-sandboxes".to_owned(),
        }
    }
}
