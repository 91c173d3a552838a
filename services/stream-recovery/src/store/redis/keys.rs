//! The names of the store's Redis keys and channel: a run's keys share the hash tag
//! `{run:<id>}` (one cluster slot), an org's hourly counter `{org:<id>}`.

use super::connection::RedisStore;

/// Every key a run's scripts may be given.
pub(super) struct Keys {
    pub(super) lease: String,
    pub(super) meta: String,
    pub(super) frames: String,
    pub(super) times: String,
    pub(super) budget: String,
}

impl RedisStore {
    /// Every key a run's scripts are given (lease, meta, frames, times, budget): one hash
    /// tag, so one cluster slot.
    pub fn run_keys(&self, run: &str) -> [String; 5] {
        let Keys {
            lease,
            meta,
            frames,
            times,
            budget,
        } = self.keys(run);
        [lease, meta, frames, times, budget]
    }

    pub(super) fn keys(&self, run: &str) -> Keys {
        let tag = format!("{}{{run:{run}}}", self.prefix);
        Keys {
            lease: format!("{tag}:lease"),
            meta: format!("{tag}:meta"),
            frames: format!("{tag}:frames"),
            times: format!("{tag}:times"),
            budget: format!("{tag}:budget"),
        }
    }

    /// The channel every replica publishes the runs it changed on.
    pub(super) fn channel(&self) -> String {
        format!("{}changes", self.prefix)
    }

    /// The index of runs the sweep walks.
    pub(super) fn index(&self) -> String {
        format!("{}runs", self.prefix)
    }

    /// An org's byte counter for the hour `hour` (ms epoch / 3.6e6).
    pub(super) fn org_hour(&self, org: &str, hour: i64) -> String {
        format!("{}{{org:{org}}}:bytes:{hour}", self.prefix)
    }
}
