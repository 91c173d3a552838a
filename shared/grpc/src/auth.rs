//! Who is calling: the one authentication layer of every runplane server.
//!
//! Each method names its callers in the proto (`runplane.options.v1.policy.callers`), and
//! the build turns that into [`runplane_proto::METHOD_POLICIES`]. This layer runs ahead of
//! every handler and, for each call:
//!
//! - parses `authorization: Bearer <token>` once (none, or a malformed one, is
//!   UNAUTHENTICATED);
//! - hashes the token (SHA-256) and compares the hash, in constant time, with every
//!   configured token: the operator token, the shared service token, each service
//!   role's own token (or its digest) and each org token;
//! - admits a configured token only on a method that names its caller
//!   (PERMISSION_DENIED otherwise: the caller is known, the method is not theirs): a
//!   role's own token where its role is named, the shared service token where any
//!   service role is;
//! - hands any other token on as [`Caller::Presented`] when the method takes a credential
//!   only its handler can judge (a run key, a node credential, a route token), and
//!   refuses it (UNAUTHENTICATED) everywhere else.
//!
//! The handler finds the [`Caller`] in the request's extensions ([`caller`]). Health and
//! reflection stay open; a path that is not a runplane method is passed on (tonic answers
//! UNIMPLEMENTED). Tokens are never logged; only the caller's kind is.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

pub use runplane_config::ServiceRole;
use runplane_proto::{Caller as Kind, Callers};
use sha2::{Digest, Sha256};
use tonic::Code;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::{ErrorReason, status_with_reason};
use crate::method::{OPEN_SERVICES, service_of};

/// The longest bearer token accepted; every runplane token and key is far shorter.
const MAX_BEARER_LEN: usize = 4096;

/// The SHA-256 of a secret, as every runplane token and key is stored and compared.
pub fn sha256(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Equality of two hashes in time that does not depend on where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A bearer token the layer could not judge, for the handler to check: its SHA-256 and
/// the token itself (a route token is verified by its signature). `Debug` shows neither.
#[derive(Clone, PartialEq, Eq)]
pub struct Presented {
    token: Arc<str>,
    sha256: [u8; 32],
}

impl Presented {
    /// The token itself. Never log it.
    pub fn expose(&self) -> &str {
        &self.token
    }

    pub fn sha256(&self) -> &[u8; 32] {
        &self.sha256
    }
}

impl std::fmt::Debug for Presented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Presented(<redacted>)")
    }
}

/// Which service token a service's call came with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The shared `auth.service_token`: admitted wherever any service role is named.
    Any,
    /// A role's own token (`auth.service_tokens.<role>`, or its digest): admitted only
    /// where that role is named.
    Only(ServiceRole),
}

impl Role {
    /// Whether a method that names `callers` admits this role's token.
    pub fn is_admitted_by(self, callers: Callers) -> bool {
        match self {
            Role::Any => callers.admits_a_service(),
            Role::Only(role) => callers.admits(kind_of(role)),
        }
    }

    /// How a refusal names the token: `shared service`, `run_store service`, ….
    fn token_name(self) -> &'static str {
        match self {
            Role::Any => "shared service",
            Role::Only(ServiceRole::RunStore) => "run_store service",
            Role::Only(ServiceRole::SandboxReconciler) => "sandbox_reconciler service",
            Role::Only(ServiceRole::StreamRecovery) => "stream_recovery service",
            Role::Only(ServiceRole::CredentialHealth) => "credential_health service",
        }
    }
}

/// The caller a method names for a service role.
pub fn kind_of(role: ServiceRole) -> Kind {
    match role {
        ServiceRole::RunStore => Kind::RunStore,
        ServiceRole::SandboxReconciler => Kind::SandboxReconciler,
        ServiceRole::StreamRecovery => Kind::StreamRecovery,
        ServiceRole::CredentialHealth => Kind::CredentialHealth,
    }
}

/// The authenticated caller of a call, in its request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator token: any org.
    Operator,
    /// A service token, the shared one or a role's own: any org.
    Service(Role),
    /// An org token: only its org.
    Org(String),
    /// A token no configuration names, on a method whose handler checks it (a run key,
    /// a node credential, a route token).
    Presented(Presented),
}

impl Caller {
    /// The orgs the caller may act in: every org for the operator and any service token,
    /// its own for an org token; `None` for a presented token (a run key, a node
    /// credential, a route token), which acts in no org. The one answer every service
    /// asks of a caller's org.
    pub fn org_scope(&self) -> Option<runplane_ids::OrgScope> {
        match self {
            Caller::Operator | Caller::Service(_) => Some(runplane_ids::OrgScope::Any),
            Caller::Org(org) => Some(runplane_ids::OrgScope::Only(org.clone())),
            Caller::Presented(_) => None,
        }
    }

    /// The org an org token is confined to.
    pub fn org(&self) -> Option<&str> {
        match self {
            Caller::Org(org) => Some(org),
            _ => None,
        }
    }

    /// The presented token of a run key, node credential or route token.
    pub fn presented(&self) -> Option<&Presented> {
        match self {
            Caller::Presented(p) => Some(p),
            _ => None,
        }
    }
}

/// The caller this layer put on `request`. A request that did not come through the layer
/// (which every server has) has none, and its handler must refuse it.
pub fn caller<T>(request: &tonic::Request<T>) -> Option<&Caller> {
    request.extensions().get::<Caller>()
}

/// The configured tokens, hashed.
#[derive(Clone, Default)]
pub struct Tokens {
    operator: Option<[u8; 32]>,
    service: Option<[u8; 32]>,
    roles: Vec<([u8; 32], ServiceRole)>,
    orgs: Vec<([u8; 32], String)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("operator", &self.operator.is_some())
            .field("service", &self.service.is_some())
            .field(
                "roles",
                &self.roles.iter().map(|(_, r)| r.key()).collect::<Vec<_>>(),
            )
            .field(
                "orgs",
                &self.orgs.iter().map(|(_, o)| o).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tokens {
    /// `[auth]`'s operator, service (shared and per role) and org tokens; an empty one
    /// matches nothing. A token given by its digest (`operator_token_sha256`,
    /// `service_token_sha256`, `org_token_sha256`) is admitted the same: only the digest
    /// is ever compared.
    pub fn from_config(auth: &runplane_config::AuthConfig) -> Self {
        let hash = |s: &runplane_config::Secret| (!s.is_empty()).then(|| sha256(s.expose()));
        Self {
            operator: hash(&auth.operator_token)
                .or_else(|| runplane_config::parse_sha256(&auth.operator_token_sha256)),
            service: hash(&auth.service_token),
            roles: auth
                .service_tokens
                .iter()
                .filter_map(|(role, token)| hash(token).map(|h| (h, role)))
                .chain(
                    auth.service_token_sha256
                        .iter()
                        .filter_map(|(role, digest)| {
                            runplane_config::parse_sha256(digest).map(|d| (d, role))
                        }),
                )
                .collect(),
            orgs: auth
                .org_tokens
                .iter()
                .map(|(org, token)| (sha256(token.expose()), org.clone()))
                .chain(auth.org_token_sha256.iter().filter_map(|(org, digest)| {
                    runplane_config::parse_sha256(digest).map(|d| (d, org.clone()))
                }))
                .collect(),
        }
    }

    /// The configured caller whose token hashes to `hash`. Every configured hash is
    /// compared, whichever matches.
    fn configured(&self, hash: &[u8; 32]) -> Option<Caller> {
        let mut found = None;
        if self.operator.is_some_and(|h| same(&h, hash)) {
            found = Some(Caller::Operator);
        }
        if self.service.is_some_and(|h| same(&h, hash)) {
            found = Some(Caller::Service(Role::Any));
        }
        for (h, role) in &self.roles {
            if same(h, hash) {
                found = Some(Caller::Service(Role::Only(*role)));
            }
        }
        for (h, org) in &self.orgs {
            if same(h, hash) {
                found = Some(Caller::Org(org.clone()));
            }
        }
        found
    }
}

/// What the layer decides about one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not a runplane method, or an open one: passed on untouched.
    PassOn,
    Admit(Caller),
    Refuse(Code, ErrorReason, String),
}

/// Judges a call to `path` with `authorization` metadata against `tokens`.
pub fn decide(tokens: &Tokens, path: &str, authorization: Option<&http::HeaderValue>) -> Decision {
    let service = service_of(path);
    if OPEN_SERVICES.iter().any(|p| service.starts_with(p)) {
        return Decision::PassOn;
    }
    let Some(policy) = runplane_proto::policy_for(path) else {
        return Decision::PassOn;
    };
    let Some(token) = bearer(authorization) else {
        return unauthenticated("missing or malformed authorization: Bearer metadata");
    };
    let hash = sha256(token);
    match tokens.configured(&hash) {
        Some(caller) => {
            let (admitted, name) = match &caller {
                Caller::Operator => (policy.callers.admits(Kind::Operator), "operator"),
                Caller::Service(role) => (role.is_admitted_by(policy.callers), role.token_name()),
                Caller::Org(_) => (policy.callers.admits(Kind::Org), "org"),
                Caller::Presented(_) => unreachable!("a configured token is never presented"),
            };
            if admitted {
                Decision::Admit(caller)
            } else {
                Decision::Refuse(
                    Code::PermissionDenied,
                    ErrorReason::PermissionDenied,
                    format!(
                        "the {name} token may not call {path} (its callers: {})",
                        names(policy.callers)
                    ),
                )
            }
        }
        None if [Kind::Runner, Kind::Node, Kind::Route]
            .into_iter()
            .any(|k| policy.callers.admits(k)) =>
        {
            Decision::Admit(Caller::Presented(Presented {
                token: token.into(),
                sha256: hash,
            }))
        }
        None => unauthenticated("unknown bearer token"),
    }
}

fn names(callers: Callers) -> String {
    callers
        .iter()
        .map(Kind::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

fn unauthenticated(message: &str) -> Decision {
    Decision::Refuse(
        Code::Unauthenticated,
        ErrorReason::Unauthenticated,
        message.to_owned(),
    )
}

/// The token of `Bearer <token>` (scheme case-insensitive, token trimmed), if well formed.
fn bearer(value: Option<&http::HeaderValue>) -> Option<&str> {
    let value = value?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && token_is_well_formed(token)).then_some(token)
}

/// Whether `token` has a form some service could accept: short, printable, no spaces.
pub(crate) fn token_is_well_formed(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= MAX_BEARER_LEN
        && token.bytes().all(|b| b.is_ascii_graphic())
}

/// Layer of [`Authenticate`].
#[derive(Debug, Clone)]
pub struct AuthLayer {
    tokens: Arc<Tokens>,
}

impl AuthLayer {
    pub fn new(tokens: Tokens) -> Self {
        Self {
            tokens: Arc::new(tokens),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Authenticate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticate {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

/// Admits each call as [`decide`] says, with its [`Caller`] in the request's extensions.
#[derive(Debug, Clone)]
pub struct Authenticate<S> {
    inner: S,
    tokens: Arc<Tokens>,
}

type BoxFuture<T, E> = Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody> Service<http::Request<ReqBody>> for Authenticate<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<Body>> + Send,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let decision = decide(
            &self.tokens,
            request.uri().path(),
            request.headers().get(http::header::AUTHORIZATION),
        );
        match decision {
            Decision::PassOn => {}
            Decision::Admit(caller) => {
                request.extensions_mut().insert(caller);
            }
            Decision::Refuse(code, reason, message) => {
                tracing::debug!(
                    ?code,
                    path = request.uri().path(),
                    "call refused: {message}"
                );
                let status = status_with_reason(
                    code,
                    reason,
                    message,
                    std::iter::empty::<(String, String)>(),
                );
                return Box::pin(async move { Ok(status.into_http()) });
            }
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> Tokens {
        let mut auth = runplane_config::AuthConfig {
            operator_token: runplane_config::Secret::new("o".repeat(40)),
            service_token: runplane_config::Secret::new("s".repeat(40)),
            ..Default::default()
        };
        auth.org_tokens
            .insert("acme".into(), runplane_config::Secret::new("a".repeat(40)));
        Tokens::from_config(&auth)
    }

    fn header(token: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(&format!("Bearer {token}")).unwrap()
    }

    fn decided(path: &str, token: &str) -> Decision {
        decide(&tokens(), path, Some(&header(token)))
    }

    fn refused(decision: Decision) -> (Code, ErrorReason) {
        match decision {
            Decision::Refuse(code, reason, _) => (code, reason),
            other => panic!("admitted: {other:?}"),
        }
    }

    const CREATE_RUN: &str = "/runplane.runstore.v1.RunService/CreateRun";
    const FAIL_RUN: &str = "/runplane.runstore.v1.RunService/FailRun";
    const HELLO: &str = "/runplane.runstore.v1.RunnerService/Hello";
    const HEARTBEAT: &str = "/runplane.reconciler.v1.NodeService/Heartbeat";
    const MINT: &str = "/runplane.reconciler.v1.NodeCredentialService/CreateNodeCredential";

    #[test]
    fn each_configured_token_is_admitted_only_where_its_method_names_it() {
        let (o, s, a) = ("o".repeat(40), "s".repeat(40), "a".repeat(40));
        assert_eq!(decided(CREATE_RUN, &o), Decision::Admit(Caller::Operator));
        assert_eq!(
            decided(CREATE_RUN, &a),
            Decision::Admit(Caller::Org("acme".into()))
        );
        assert_eq!(
            decided(FAIL_RUN, &s),
            Decision::Admit(Caller::Service(Role::Any))
        );
        let denied = (Code::PermissionDenied, ErrorReason::PermissionDenied);
        assert_eq!(
            refused(decided(CREATE_RUN, &s)),
            denied,
            "a service creates no runs"
        );
        assert_eq!(
            refused(decided(FAIL_RUN, &a)),
            denied,
            "an org fails no runs"
        );
        assert_eq!(
            refused(decided(MINT, &s)),
            denied,
            "a service mints no node credentials"
        );
        for token in [&o, &s, &a] {
            assert_eq!(
                refused(decided(HEARTBEAT, token)),
                denied,
                "NodeService: nodes only"
            );
            assert_eq!(
                refused(decided(HELLO, token)),
                denied,
                "RunnerService: run keys only"
            );
        }
    }

    /// The tokens of a split deployment: the shared one, three roles' own tokens in full
    /// and credential health's by its digest, as a server holding none of them has it.
    fn role_tokens() -> Tokens {
        let mut auth = runplane_config::AuthConfig {
            operator_token: runplane_config::Secret::new("o".repeat(40)),
            service_token: runplane_config::Secret::new("s".repeat(40)),
            ..Default::default()
        };
        for role in ServiceRole::ALL {
            if role != ServiceRole::CredentialHealth {
                *auth.service_tokens.get_mut(role) = runplane_config::Secret::new(token_of(role));
            }
        }
        auth.service_token_sha256.credential_health =
            sha256(&token_of(ServiceRole::CredentialHealth))
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
        Tokens::from_config(&auth)
    }

    fn token_of(role: ServiceRole) -> String {
        format!("{}-own-service-token-0123456789abcdef", role.key())
    }

    fn decided_by_role(path: &str, token: &str) -> Decision {
        decide(&role_tokens(), path, Some(&header(token)))
    }

    const ISSUE_RUN_KEY: &str = "/runplane.runstore.v1.RunService/IssueRunKey";
    const CHECK_RUN_KEY: &str = "/runplane.runstore.v1.RunService/CheckRunKey";
    const MARK_BACKEND_ERROR: &str = "/runplane.runstore.v1.RunService/MarkBackendError";
    const CHECK_ADMISSION: &str = "/runplane.credentials.v1.CredentialHealthService/CheckAdmission";
    const PARK_STREAM: &str = "/runplane.recovery.v1.StreamRecoveryService/ParkStream";

    #[test]
    fn each_roles_token_calls_what_its_service_calls_and_nothing_else() {
        let own = |role| Decision::Admit(Caller::Service(Role::Only(role)));
        let admitted = [
            (ServiceRole::SandboxReconciler, ISSUE_RUN_KEY),
            (ServiceRole::SandboxReconciler, FAIL_RUN),
            (ServiceRole::SandboxReconciler, PARK_STREAM),
            (ServiceRole::StreamRecovery, CHECK_RUN_KEY),
            (ServiceRole::StreamRecovery, FAIL_RUN),
            (ServiceRole::RunStore, CHECK_ADMISSION),
            (ServiceRole::CredentialHealth, MARK_BACKEND_ERROR),
        ];
        for (role, path) in admitted {
            assert_eq!(
                decided_by_role(path, &token_of(role)),
                own(role),
                "{} on {path}",
                role.key()
            );
        }
        let denied = (Code::PermissionDenied, ErrorReason::PermissionDenied);
        let refused_ones = [
            (ServiceRole::StreamRecovery, ISSUE_RUN_KEY),
            (ServiceRole::StreamRecovery, MINT),
            (ServiceRole::CredentialHealth, FAIL_RUN),
            (ServiceRole::CredentialHealth, ISSUE_RUN_KEY),
            (ServiceRole::RunStore, FAIL_RUN),
            (ServiceRole::RunStore, CHECK_RUN_KEY),
            (ServiceRole::SandboxReconciler, CHECK_ADMISSION),
            (ServiceRole::SandboxReconciler, CREATE_RUN),
        ];
        for (role, path) in refused_ones {
            assert_eq!(
                refused(decided_by_role(path, &token_of(role))),
                denied,
                "{} on {path}",
                role.key()
            );
        }
        let Decision::Refuse(_, _, message) =
            decided_by_role(ISSUE_RUN_KEY, &token_of(ServiceRole::StreamRecovery))
        else {
            panic!("admitted");
        };
        assert_eq!(
            message,
            format!(
                "the stream_recovery service token may not call {ISSUE_RUN_KEY} (its callers: \
                 operator, sandbox_reconciler)"
            )
        );
        assert!(!message.contains(&token_of(ServiceRole::StreamRecovery)));
    }

    #[test]
    fn every_method_admits_a_roles_token_exactly_where_it_names_the_role() {
        for policy in runplane_proto::METHOD_POLICIES {
            for role in ServiceRole::ALL {
                let decision = decided_by_role(policy.path, &token_of(role));
                if policy.callers.admits(kind_of(role)) {
                    assert_eq!(
                        decision,
                        Decision::Admit(Caller::Service(Role::Only(role))),
                        "{}",
                        policy.path
                    );
                } else {
                    assert!(
                        matches!(decision, Decision::Refuse(Code::PermissionDenied, _, _)),
                        "{} on {}: {decision:?}",
                        role.key(),
                        policy.path
                    );
                }
            }
        }
    }

    #[test]
    fn the_shared_token_is_admitted_wherever_any_service_role_is_named() {
        let shared = "s".repeat(40);
        let mut named = 0;
        for policy in runplane_proto::METHOD_POLICIES {
            let decision = decided_by_role(policy.path, &shared);
            if Kind::SERVICE_ROLES
                .iter()
                .any(|k| policy.callers.admits(*k))
            {
                named += 1;
                assert_eq!(
                    decision,
                    Decision::Admit(Caller::Service(Role::Any)),
                    "{}",
                    policy.path
                );
                assert_eq!(
                    Caller::Service(Role::Any).org_scope(),
                    Some(runplane_ids::OrgScope::Any)
                );
            } else {
                assert!(
                    matches!(decision, Decision::Refuse(Code::PermissionDenied, _, _)),
                    "{}: {decision:?}",
                    policy.path
                );
            }
        }
        assert!(named >= 10, "only {named} methods name a service role");
        for role in ServiceRole::ALL {
            assert_eq!(
                Caller::Service(Role::Only(role)).org_scope(),
                Some(runplane_ids::OrgScope::Any)
            );
        }
    }

    #[test]
    fn a_role_token_given_by_its_digest_authenticates_as_the_full_token_does() {
        let token = token_of(ServiceRole::CredentialHealth);
        let mut full = runplane_config::AuthConfig::default();
        full.service_tokens.credential_health = runplane_config::Secret::new(token.clone());
        let full = Tokens::from_config(&full);
        for policy in runplane_proto::METHOD_POLICIES {
            assert_eq!(
                decide(&full, policy.path, Some(&header(&token))),
                decided_by_role(policy.path, &token),
                "{}",
                policy.path
            );
        }
        assert_eq!(
            decided_by_role(MARK_BACKEND_ERROR, &token),
            Decision::Admit(Caller::Service(Role::Only(ServiceRole::CredentialHealth)))
        );
        let debug = format!("{:?}", role_tokens());
        assert!(!debug.contains(&token), "{debug}");
    }

    #[test]
    fn an_unknown_token_reaches_only_a_handler_that_checks_its_own() {
        let unauthenticated = (Code::Unauthenticated, ErrorReason::Unauthenticated);
        let Decision::Admit(Caller::Presented(p)) = decided(HELLO, "rk_somekey") else {
            panic!("a run key is for the run store to judge");
        };
        assert_eq!(p.expose(), "rk_somekey");
        assert_eq!(p.sha256(), &sha256("rk_somekey"));
        assert_eq!(format!("{p:?}"), "Presented(<redacted>)");
        assert!(matches!(
            decided(HEARTBEAT, "rpnode_x"),
            Decision::Admit(Caller::Presented(_))
        ));
        assert_eq!(refused(decided(CREATE_RUN, "rk_somekey")), unauthenticated);
        assert_eq!(refused(decided(MINT, "rpnode_x")), unauthenticated);
        for bad in ["", "Basic abc", "Bearer ", "Bearer a b"] {
            let value = http::HeaderValue::from_str(bad).unwrap();
            assert_eq!(
                refused(decide(&tokens(), CREATE_RUN, Some(&value))),
                unauthenticated
            );
        }
        assert_eq!(
            refused(decide(&tokens(), CREATE_RUN, None)),
            unauthenticated
        );
    }

    #[test]
    fn open_and_foreign_paths_are_passed_on() {
        assert_eq!(
            decide(&tokens(), "/grpc.health.v1.Health/Check", None),
            Decision::PassOn
        );
        assert_eq!(
            decide(&tokens(), "/elsewhere.v1.X/Y", None),
            Decision::PassOn
        );
    }

    #[test]
    fn the_table_names_callers_for_every_method() {
        for policy in runplane_proto::METHOD_POLICIES {
            assert!(!policy.callers.is_empty(), "{}", policy.path);
        }
    }
}
