//! Throwaway certificates for TLS tests: a CA, a server certificate for `localhost` and
//! `127.0.0.1`, a client certificate that CA signed, and a client certificate of an
//! unrelated CA. Generated fresh (ECDSA P-256) for every call; nothing is kept.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

/// The certificates of one TLS test.
pub struct TestPki {
    /// The CA that signed `server` and `client`.
    pub ca: Pem,
    /// SANs `localhost` and `127.0.0.1`; server and client use.
    pub server: Pem,
    /// Client use, signed by `ca`.
    pub client: Pem,
    /// A CA nothing else trusts.
    pub rogue_ca: Pem,
    /// Client use, signed by `rogue_ca`; SANs as `client`'s.
    pub rogue_client: Pem,
}

/// Where [`TestPki::write_to`] put the files.
pub struct PkiFiles {
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub rogue_client_cert: PathBuf,
    pub rogue_client_key: PathBuf,
}

fn new_ca(name: &str) -> (Pem, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("generate a CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).expect("self-sign the CA");
    let pem = Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    };
    (pem, Issuer::new(params, key))
}

fn leaf(name: &str, usages: Vec<ExtendedKeyUsagePurpose>, issuer: &Issuer<'_, KeyPair>) -> Pem {
    let key = KeyPair::generate().expect("generate a key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("leaf params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages;
    let cert = params.signed_by(&key, issuer).expect("sign a leaf");
    Pem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

impl TestPki {
    pub fn generate() -> Self {
        let (ca, issuer) = new_ca("runplane test CA");
        let (rogue_ca, rogue_issuer) = new_ca("unrelated test CA");
        let both = || {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        };
        TestPki {
            server: leaf("runplane test server", both(), &issuer),
            client: leaf(
                "runplane test client",
                vec![ExtendedKeyUsagePurpose::ClientAuth],
                &issuer,
            ),
            rogue_client: leaf(
                "unrelated test client",
                vec![ExtendedKeyUsagePurpose::ClientAuth],
                &rogue_issuer,
            ),
            ca,
            rogue_ca,
        }
    }

    /// Writes every certificate and key as PEM files into `dir`.
    pub fn write_to(&self, dir: &Path) -> PkiFiles {
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            path
        };
        PkiFiles {
            ca_cert: write("ca.pem", &self.ca.cert),
            server_cert: write("server.pem", &self.server.cert),
            server_key: write("server.key", &self.server.key),
            client_cert: write("client.pem", &self.client.cert),
            client_key: write("client.key", &self.client.key),
            rogue_client_cert: write("rogue-client.pem", &self.rogue_client.cert),
            rogue_client_key: write("rogue-client.key", &self.rogue_client.key),
        }
    }
}
