//! `[tls]`: certificates of every gRPC server and client of this process.

use serde::Deserialize;

use crate::error::ConfigError;

/// TLS of every gRPC server and client of this process (rustls). All fields are paths
/// to PEM files; empty means unset. Files are read once at start-up
/// (`runplane_grpc::tls::install`), where an unreadable or unparsable one is an error
/// naming its field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain this process serves with, and presents as a client when a
    /// server asks for one (mutual TLS). Set: servers speak TLS only.
    pub cert_file: String,
    /// Private key of `cert_file`.
    pub key_file: String,
    /// Servers require a client certificate signed by this CA (mutual TLS). Empty: no
    /// client certificate is asked for.
    pub client_ca_file: String,
    /// Clients trust servers of `https://` endpoints signed by this CA. Required for any
    /// `https://` endpoint (no system roots are used).
    pub ca_file: String,
}

impl TlsConfig {
    /// Whether servers speak TLS.
    pub fn serves_tls(&self) -> bool {
        !self.cert_file.is_empty()
    }

    /// Whether servers require client certificates.
    pub fn requires_client_certificates(&self) -> bool {
        !self.client_ca_file.is_empty()
    }

    /// Pairs the TLS fields must come in; that the files are readable PEM is checked
    /// when they are read (`runplane_grpc::tls::install`).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if !self.cert_file.is_empty() && self.key_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.key_file",
                "required when tls.cert_file is set: the private key of that certificate",
            ));
        }
        if !self.key_file.is_empty() && self.cert_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.cert_file",
                "required when tls.key_file is set: the certificate of that key",
            ));
        }
        if !self.client_ca_file.is_empty() && self.cert_file.is_empty() {
            return Err(ConfigError::invalid(
                "tls.cert_file",
                "required when tls.client_ca_file is set: asking for client certificates \
                 needs a TLS server, which needs a certificate and key",
            ));
        }
        Ok(())
    }
}
