//! The replay-safety classification of every runplane RPC, and who may call it.
//!
//! The types here are what the generated table in `runplane-proto` is made of; the
//! `check` module holds the build-time half that reads `runplane.options.v1.policy`
//! from a descriptor pool, refuses unclassified or inconsistent methods, and renders
//! the table.

pub mod check;

/// Whether a request whose outcome is unknown may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplaySafety {
    /// Reads only.
    ReadOnly,
    /// Applying it twice equals applying it once.
    Idempotent,
    /// The server dedupes on the request field named by [`MethodPolicy::key_field`].
    Keyed,
    /// May not be sent again once it may have reached the handler.
    Unsafe,
}

impl ReplaySafety {
    /// True when a request that may already have been processed can be sent again.
    pub const fn is_replay_safe(self) -> bool {
        !matches!(self, ReplaySafety::Unsafe)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            ReplaySafety::ReadOnly => "read_only",
            ReplaySafety::Idempotent => "idempotent",
            ReplaySafety::Keyed => "keyed",
            ReplaySafety::Unsafe => "unsafe",
        }
    }
}

/// How long a client keeps retrying through an outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutageBudget {
    /// 3 minutes.
    Ordinary,
    /// 5 minutes: calls that end a run.
    Terminal,
}

impl OutageBudget {
    /// The outage budget in seconds, as DESIGN.md "Runner transport" fixes it.
    pub const fn seconds(self) -> u64 {
        match self {
            OutageBudget::Ordinary => 180,
            OutageBudget::Terminal => 300,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            OutageBudget::Ordinary => "ordinary",
            OutageBudget::Terminal => "terminal",
        }
    }
}

/// Who presents a call's bearer credential (`runplane.options.v1.Caller`).
/// `CALLER_SERVICE`, the shared service token, is not among them: the build refuses a
/// method that names it, and the shared token is admitted wherever a service role is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The operator token: humans, the CLI, grpcurl. Any org.
    Operator,
    /// An org token; the handler confines it to its org.
    Org,
    /// A run key, checked by the handler against the run it names.
    Runner,
    /// A node credential, checked by the handler against the node it names.
    Node,
    /// A route token, checked by the node it names.
    Route,
    /// The run store's service token. Any org.
    RunStore,
    /// The sandbox reconciler's service token. Any org.
    SandboxReconciler,
    /// The stream recovery coordinator's service token. Any org.
    StreamRecovery,
    /// Credential health's service token. Any org.
    CredentialHealth,
}

impl Caller {
    pub const ALL: [Caller; 9] = [
        Caller::Operator,
        Caller::Org,
        Caller::Runner,
        Caller::Node,
        Caller::Route,
        Caller::RunStore,
        Caller::SandboxReconciler,
        Caller::StreamRecovery,
        Caller::CredentialHealth,
    ];

    /// The service roles: runplane's services calling each other, each with its own
    /// token (or the shared one, admitted wherever any of them is named).
    pub const SERVICE_ROLES: [Caller; 4] = [
        Caller::RunStore,
        Caller::SandboxReconciler,
        Caller::StreamRecovery,
        Caller::CredentialHealth,
    ];

    const fn bit(self) -> u16 {
        1 << self as u16
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Caller::Operator => "operator",
            Caller::Org => "org",
            Caller::Runner => "runner",
            Caller::Node => "node",
            Caller::Route => "route",
            Caller::RunStore => "run_store",
            Caller::SandboxReconciler => "sandbox_reconciler",
            Caller::StreamRecovery => "stream_recovery",
            Caller::CredentialHealth => "credential_health",
        }
    }
}

/// The callers a method admits, as a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Callers(u16);

impl Callers {
    pub const fn of(callers: &[Caller]) -> Self {
        let mut bits = 0;
        let mut i = 0;
        while i < callers.len() {
            bits |= callers[i].bit();
            i += 1;
        }
        Self(bits)
    }

    pub const fn admits(self, caller: Caller) -> bool {
        self.0 & caller.bit() != 0
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether the set names any service role (where the shared service token is
    /// admitted).
    pub const fn admits_a_service(self) -> bool {
        let mut i = 0;
        while i < Caller::SERVICE_ROLES.len() {
            if self.admits(Caller::SERVICE_ROLES[i]) {
                return true;
            }
            i += 1;
        }
        false
    }

    /// The callers in the set, in [`Caller::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Caller> {
        Caller::ALL.into_iter().filter(move |c| self.admits(*c))
    }
}

/// The policy of one RPC, generated from its `runplane.options.v1.policy` option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodPolicy {
    /// Full method path as it appears on the wire: `/package.Service/Method`.
    pub path: &'static str,
    pub replay_safety: ReplaySafety,
    /// The request field the server dedupes on, for [`ReplaySafety::Keyed`].
    pub key_field: Option<&'static str>,
    pub outage_budget: OutageBudget,
    pub justification: &'static str,
    pub client_streaming: bool,
    pub server_streaming: bool,
    /// A long poll: the field number of the request's `google.protobuf.Duration wait`,
    /// for a unary method that has one. Its attempts get the wait plus a margin as their
    /// deadline instead of an ordinary call's.
    pub long_poll_wait_field: Option<u32>,
    /// Who may call it; never empty.
    pub callers: Callers,
}

/// How a client bounds one attempt of a method, derived from its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallClass {
    /// An ordinary unary call: the ordinary attempt deadline.
    Unary,
    /// A unary call that waits for a change: the request's wait plus a margin.
    LongPoll { wait_field: u32 },
    /// A server stream: no deadline, but a stream silent past its heartbeat is broken.
    Stream,
}

impl MethodPolicy {
    pub const fn call_class(&self) -> CallClass {
        if self.server_streaming {
            CallClass::Stream
        } else if let Some(wait_field) = self.long_poll_wait_field {
            CallClass::LongPoll { wait_field }
        } else {
            CallClass::Unary
        }
    }
}

/// Looks a path up in a table sorted by path (the generated table is).
pub fn lookup<'a>(table: &'a [MethodPolicy], path: &str) -> Option<&'a MethodPolicy> {
    table
        .binary_search_by(|p| p.path.cmp(path))
        .ok()
        .map(|i| &table[i])
}
