//! TLS material: the configured certificate and key, or on first start of the embedded default
//! a self-signed certificate generated into the data directory. Clients pin its SHA-256
//! fingerprint or trust the PEM file as a CA.

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("tls file {0}: no certificate found")]
    NoCert(PathBuf),
    #[error("tls file {0}: no private key found")]
    NoKey(PathBuf),
    #[error("cannot generate a self-signed certificate: {0}")]
    Generate(String),
    #[error("tls configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

pub struct TlsMaterial {
    pub certs: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub cert_path: PathBuf,
    /// Hex SHA-256 of the end-entity certificate (DER).
    pub fingerprint: String,
    pub generated: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io { path: path.to_owned(), source }
}

pub fn fingerprint(der: &[u8]) -> String {
    hex::encode(Sha256::digest(der))
}

fn load_pem(
    cert_path: &Path,
    key_path: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let cert_pem = std::fs::read(cert_path).map_err(io(cert_path))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut cert_pem.as_slice()).filter_map(Result::ok).collect();
    if certs.is_empty() {
        return Err(TlsError::NoCert(cert_path.to_owned()));
    }
    let key_pem = std::fs::read(key_path).map_err(io(key_path))?;
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(io(key_path))?
        .ok_or_else(|| TlsError::NoKey(key_path.to_owned()))?;
    Ok((certs, key))
}

/// Load the configured pair, or the generated one under `<data_dir>/tls/` (creating it).
pub fn load_or_generate(
    cert: Option<&Path>,
    key: Option<&Path>,
    data_dir: &Path,
    server_name: &str,
) -> Result<TlsMaterial, TlsError> {
    let (cert_path, key_path, mut generated) = match (cert, key) {
        (Some(c), Some(k)) => (c.to_owned(), k.to_owned(), false),
        _ => {
            let dir = data_dir.join("tls");
            (dir.join("cert.pem"), dir.join("key.pem"), true)
        }
    };
    if generated && !(cert_path.exists() && key_path.exists()) {
        let dir = cert_path.parent().unwrap_or(data_dir);
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut names = vec![server_name.to_string(), "localhost".into(), "127.0.0.1".into(), "::1".into()];
        names.dedup();
        let ck = rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Generate(e.to_string()))?;
        write_private(&key_path, ck.key_pair.serialize_pem().as_bytes())?;
        std::fs::write(&cert_path, ck.cert.pem()).map_err(io(&cert_path))?;
    } else if generated {
        // Reusing an earlier generated pair.
        generated = false;
    }
    let (certs, key) = load_pem(&cert_path, &key_path)?;
    let fingerprint = fingerprint(&certs[0]);
    Ok(TlsMaterial { certs, key, cert_path, fingerprint, generated })
}

/// Write a secret file readable by its owner only.
pub fn write_private(path: &Path, data: &[u8]) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f =
        std::fs::OpenOptions::new().create(true).write(true).truncate(true).mode(0o600).open(path).map_err(io(path))?;
    f.write_all(data).map_err(io(path))
}
