//! Who is calling: the one authentication layer of every runplane server.
//!
//! Each method names its callers in the proto (`runplane.options.v1.policy.callers`), and
//! the build turns that into [`runplane_proto::METHOD_POLICIES`]. This layer runs ahead of
//! every handler and, for each call:
//!
//! - parses `authorization: Bearer <token>` once (none, or a malformed one, is
//!   UNAUTHENTICATED);
//! - hashes the token (SHA-256) and compares the hash, in constant time, with every
//!   configured token: the operator token, the service token and each org token;
//! - admits a configured token only on a method that names its caller
//!   (PERMISSION_DENIED otherwise: the caller is known, the method is not theirs);
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

/// The authenticated caller of a call, in its request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator token: any org.
    Operator,
    /// The service token: any org.
    Service,
    /// An org token: only its org.
    Org(String),
    /// A token no configuration names, on a method whose handler checks it (a run key,
    /// a node credential, a route token).
    Presented(Presented),
}

impl Caller {
    /// The orgs the caller may act in: every org for the operator and service tokens,
    /// its own for an org token; `None` for a presented token (a run key, a node
    /// credential, a route token), which acts in no org. The one answer every service
    /// asks of a caller's org.
    pub fn org_scope(&self) -> Option<runplane_ids::OrgScope> {
        match self {
            Caller::Operator | Caller::Service => Some(runplane_ids::OrgScope::Any),
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
    orgs: Vec<([u8; 32], String)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("operator", &self.operator.is_some())
            .field("service", &self.service.is_some())
            .field(
                "orgs",
                &self.orgs.iter().map(|(_, o)| o).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tokens {
    /// `[auth]`'s operator, service and org tokens; an empty one matches nothing.
    /// A token given by its digest (`operator_token_sha256`, `org_token_sha256`) is
    /// admitted the same: only the digest is ever compared.
    pub fn from_config(auth: &runplane_config::AuthConfig) -> Self {
        let hash = |s: &runplane_config::Secret| (!s.is_empty()).then(|| sha256(s.expose()));
        Self {
            operator: hash(&auth.operator_token)
                .or_else(|| runplane_config::parse_sha256(&auth.operator_token_sha256)),
            service: hash(&auth.service_token),
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
            found = Some(Caller::Service);
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
            let kind = match caller {
                Caller::Operator => Kind::Operator,
                Caller::Service => Kind::Service,
                Caller::Org(_) => Kind::Org,
                Caller::Presented(_) => unreachable!("a configured token is never presented"),
            };
            if policy.callers.admits(kind) {
                Decision::Admit(caller)
            } else {
                Decision::Refuse(
                    Code::PermissionDenied,
                    ErrorReason::PermissionDenied,
                    format!(
                        "the {} token may not call {path} (its callers: {})",
                        kind.as_str(),
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
        assert_eq!(decided(FAIL_RUN, &s), Decision::Admit(Caller::Service));
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
