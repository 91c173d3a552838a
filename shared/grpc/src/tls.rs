//! TLS (rustls, ring) for every runplane server and client, from `[tls]`.
//!
//! [`install`] reads the configured PEM files once and keeps the result for the whole
//! process. From then on [`crate::serve`] serves TLS when `tls.cert_file` is set (and
//! requires a client certificate signed by `tls.client_ca_file` when that is set), and
//! every channel [`crate::client`] opens to an `https://` URI speaks TLS: it trusts the
//! servers `tls.ca_file` signed and presents `tls.cert_file` when a server asks for a
//! client certificate. `http://` URIs stay plaintext.
//!
//! Code that needs plain and TLS side by side in one process (tests) passes
//! [`ServerTls`] and [`ClientTls`] explicitly instead:
//! [`crate::server::serve_with_tls`], [`crate::client::endpoint_with_tls`].
//!
//! Key material is never logged and never part of an error.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use runplane_config::TlsConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Longest a TLS handshake may take, on either side; a peer that stalls it is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Environment variables a child process (a sandbox's runner) reads its TLS from.
pub const ENV_CA_FILE: &str = "RUNPLANE_TLS__CA_FILE";
pub const ENV_CERT_FILE: &str = "RUNPLANE_TLS__CERT_FILE";
pub const ENV_KEY_FILE: &str = "RUNPLANE_TLS__KEY_FILE";

/// A `[tls]` file that cannot be used. Every variant names the field, as config errors do.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("invalid config: {field}: cannot read {path}: {reason}")]
    Read {
        field: &'static str,
        path: String,
        reason: String,
    },
    #[error("invalid config: {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// Checks `pem` holds at least one certificate and nothing unparsable.
fn check_certificates(field: &'static str, what: &str, pem: &[u8]) -> Result<(), TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(field, format!("{what} is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(
            field,
            format!("{what} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
        ));
    }
    Ok(())
}

/// Checks `pem` holds a private key. The parser's detail is left out: it could quote
/// part of the key.
fn check_key(field: &'static str, what: &str, pem: &[u8]) -> Result<(), TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map(drop).map_err(|_| {
        invalid(
            field,
            format!("{what} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)"),
        )
    })
}

/// What a server serves with: its certificate and key, and whether (and by which CA)
/// clients must present a certificate.
#[derive(Clone)]
pub struct ServerTls {
    config: ServerTlsConfig,
    mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// From PEM: the certificate chain served (leaf first), its key, and the CA client
    /// certificates must be signed by (`None`: no client certificate is asked for).
    /// Checks that they parse and that the key belongs to the certificate.
    pub fn from_pem(
        cert: impl AsRef<[u8]>,
        key: impl AsRef<[u8]>,
        client_ca: Option<&[u8]>,
    ) -> Result<Self, TlsError> {
        Self::from_named_pem(
            ("the certificate", cert.as_ref()),
            ("the key", key.as_ref()),
            client_ca.map(|ca| ("the client CA", ca)),
        )
    }

    fn from_named_pem(
        (cert_name, cert): (&str, &[u8]),
        (key_name, key): (&str, &[u8]),
        client_ca: Option<(&str, &[u8])>,
    ) -> Result<Self, TlsError> {
        check_certificates("tls.cert_file", cert_name, cert)?;
        check_key("tls.key_file", key_name, key)?;
        let mut config = ServerTlsConfig::new()
            .identity(Identity::from_pem(cert, key))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some((ca_name, ca)) = client_ca {
            check_certificates("tls.client_ca_file", ca_name, ca)?;
            config = config.client_ca_root(Certificate::from_pem(ca));
        }
        // Builds the rustls server config now, so a key that does not belong to the
        // certificate stops the start instead of the first connection.
        tonic::transport::Server::builder()
            .tls_config(config.clone())
            .map_err(|e| {
                invalid(
                    "tls.key_file",
                    format!(
                        "{key_name} and {cert_name} cannot serve together: {}",
                        crate::error::error_chain(&e)
                    ),
                )
            })?;
        Ok(Self {
            config,
            mutual: client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate (mutual TLS).
    pub fn requires_client_certificates(&self) -> bool {
        self.mutual
    }

    /// For logs: `mutual` or `tls`.
    pub fn mode(&self) -> &'static str {
        if self.mutual { "mutual" } else { "tls" }
    }

    /// tonic's server settings.
    pub fn config(&self) -> ServerTlsConfig {
        self.config.clone()
    }
}

/// What a client trusts for `https://` URIs, and the certificate it presents when a
/// server asks for one.
#[derive(Clone)]
pub struct ClientTls {
    config: ClientTlsConfig,
    presents_certificate: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("presents_certificate", &self.presents_certificate)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// From PEM: the CA servers must be signed by, and optionally the certificate chain
    /// and key presented to servers that ask for a client certificate. The server's
    /// name is checked against the URI's host (an IP host needs an IP SAN).
    pub fn from_pem(
        ca: impl AsRef<[u8]>,
        identity: Option<(&[u8], &[u8])>,
    ) -> Result<Self, TlsError> {
        Self::from_named_pem(
            ("the CA", ca.as_ref()),
            identity.map(|(cert, key)| (("the certificate", cert), ("the key", key))),
        )
    }

    #[allow(clippy::type_complexity)]
    fn from_named_pem(
        (ca_name, ca): (&str, &[u8]),
        identity: Option<((&str, &[u8]), (&str, &[u8]))>,
    ) -> Result<Self, TlsError> {
        check_certificates("tls.ca_file", ca_name, ca)?;
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(((cert_name, cert), (key_name, key))) = identity {
            check_certificates("tls.cert_file", cert_name, cert)?;
            check_key("tls.key_file", key_name, key)?;
            config = config.identity(Identity::from_pem(cert, key));
        }
        Ok(Self {
            config,
            presents_certificate: identity.is_some(),
        })
    }

    /// Whether a certificate is presented to servers that ask for one.
    pub fn presents_certificate(&self) -> bool {
        self.presents_certificate
    }

    /// tonic's client settings; the server name comes from the endpoint's URI.
    pub fn config(&self) -> ClientTlsConfig {
        self.config.clone()
    }
}

/// A process's TLS settings, as read from `[tls]`.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    server: Option<ServerTls>,
    client: Option<ClientTls>,
    /// The files as absolute paths, for a child process's environment.
    child_env: Vec<(&'static str, String)>,
}

impl Tls {
    /// Reads and checks the files `config` names; nothing set gives plaintext.
    pub fn load(config: &TlsConfig) -> Result<Self, TlsError> {
        let read =
            |field: &'static str, path: &str| -> Result<Option<(String, Vec<u8>)>, TlsError> {
                if path.is_empty() {
                    return Ok(None);
                }
                let bytes = std::fs::read(path).map_err(|e| TlsError::Read {
                    field,
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
                let absolute = std::path::absolute(Path::new(path))
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| path.to_owned());
                Ok(Some((absolute, bytes)))
            };
        let cert = read("tls.cert_file", &config.cert_file)?;
        let key = read("tls.key_file", &config.key_file)?;
        let client_ca = read("tls.client_ca_file", &config.client_ca_file)?;
        let ca = read("tls.ca_file", &config.ca_file)?;

        let identity = match (&cert, &key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(invalid(
                    "tls.key_file",
                    "required when tls.cert_file is set: the private key of that certificate",
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "tls.cert_file",
                    "required when tls.key_file is set: the certificate of that key",
                ));
            }
        };
        let server = match identity {
            Some(((cert_path, cert), (key_path, key))) => Some(ServerTls::from_named_pem(
                (cert_path, cert),
                (key_path, key),
                client_ca
                    .as_ref()
                    .map(|(path, ca)| (path.as_str(), ca.as_slice())),
            )?),
            None if client_ca.is_some() => {
                return Err(invalid(
                    "tls.cert_file",
                    "required when tls.client_ca_file is set: asking for client certificates \
                     needs a TLS server, which needs a certificate and key",
                ));
            }
            None => None,
        };
        let client = match &ca {
            Some((ca_path, ca)) => Some(ClientTls::from_named_pem(
                (ca_path, ca),
                identity.map(|((cert_path, cert), (key_path, key))| {
                    (
                        (cert_path.as_str(), cert.as_slice()),
                        (key_path.as_str(), key.as_slice()),
                    )
                }),
            )?),
            None => None,
        };
        let mut child_env = Vec::new();
        if let Some((ca_path, _)) = &ca {
            child_env.push((ENV_CA_FILE, ca_path.clone()));
            if let Some(((cert_path, _), (key_path, _))) = identity {
                child_env.push((ENV_CERT_FILE, cert_path.clone()));
                child_env.push((ENV_KEY_FILE, key_path.clone()));
            }
        }
        Ok(Self {
            server,
            client,
            child_env,
        })
    }

    /// What servers serve with; `None` serves plaintext.
    pub fn server(&self) -> Option<&ServerTls> {
        self.server.as_ref()
    }

    /// What `https://` channels use; `None` refuses `https://` URIs.
    pub fn client(&self) -> Option<&ClientTls> {
        self.client.as_ref()
    }

    /// `RUNPLANE_TLS__*` variables that give a child process (a sandbox's runner, which
    /// reads no config file) this process's client side: its CA and, when it has one,
    /// its certificate and key, as absolute paths.
    pub fn child_env(&self) -> &[(&'static str, String)] {
        &self.child_env
    }

    /// For logs: `off`, `tls` or `mutual` for the server side.
    pub fn server_mode(&self) -> &'static str {
        self.server.as_ref().map_or("off", ServerTls::mode)
    }
}

static INSTALLED: RwLock<Option<Arc<Tls>>> = RwLock::new(None);

/// Reads `[tls]` and makes it this process's TLS (replacing any installed before).
/// Call it right after loading the config, before any server or channel is made.
pub fn install(config: &TlsConfig) -> Result<(), TlsError> {
    let tls = Tls::load(config)?;
    tracing::info!(
        server = tls.server_mode(),
        client = match tls.client() {
            None => "plaintext only (no tls.ca_file)",
            Some(c) if c.presents_certificate() => "https with a client certificate",
            Some(_) => "https",
        },
        "tls"
    );
    set(tls);
    Ok(())
}

/// Makes `tls` this process's TLS, replacing what was installed.
pub fn set(tls: Tls) {
    *INSTALLED.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(tls));
}

/// The installed settings (plaintext when nothing was installed).
pub fn installed() -> Arc<Tls> {
    INSTALLED
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default()
}

/// The installed server side, if any.
pub fn server() -> Option<ServerTls> {
    installed().server().cloned()
}

/// The installed client side, if any.
pub fn client() -> Option<ClientTls> {
    installed().client().cloned()
}

/// The installed settings' [`Tls::child_env`].
pub fn child_env() -> Vec<(&'static str, String)> {
    installed().child_env().to_vec()
}
