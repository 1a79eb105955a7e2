//! TLS client configuration: webpki against a root store, or a pinned certificate digest.

use crate::config::Trust;
use crate::error::{ClientError, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub(crate) fn provider() -> Arc<CryptoProvider> {
    kvpool_net::crypto_provider()
}

/// A rustls client config for `trust`, TLS 1.3 only, ALPN `kvpool/1`.
pub fn rustls_config(trust: &Trust) -> Result<rustls::ClientConfig> {
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let mut cfg = match trust {
        Trust::CaFile(path) => {
            let pem = std::fs::read(path)
                .map_err(|e| ClientError::Config(format!("cannot read CA file {}: {e}", path.display())))?;
            builder.with_root_certificates(root_store(&pem)?).with_no_client_auth()
        }
        Trust::CaPem(pem) => builder.with_root_certificates(root_store(pem)?).with_no_client_auth(),
        Trust::Fingerprint(fp) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedCertVerifier::new(*fp, provider)))
            .with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![kvpool_proto::ALPN.to_vec()];
    Ok(cfg)
}

fn root_store(pem: &[u8]) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let mut n = 0;
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        let cert = cert.map_err(|e| ClientError::Config(format!("bad PEM certificate: {e}")))?;
        roots.add(cert).map_err(|e| ClientError::Config(format!("unusable CA certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(ClientError::Config("the CA file holds no PEM certificate".into()));
    }
    Ok(roots)
}

/// Accepts exactly one end-entity certificate, identified by the SHA-256 of its DER encoding.
/// Unlike an "accept anything" verifier it still checks the handshake signatures, so a peer must
/// hold that certificate's private key.
#[derive(Debug)]
pub struct PinnedCertVerifier {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl PinnedCertVerifier {
    pub fn new(fingerprint: [u8; 32], provider: Arc<CryptoProvider>) -> Self {
        PinnedCertVerifier { fingerprint, provider }
    }
}

/// SHA-256 of a certificate's DER bytes, as pinned by `Trust::Fingerprint`.
pub fn cert_fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

impl ServerCertVerifier for PinnedCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = cert_fingerprint(end_entity.as_ref());
        if got == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            tracing::warn!(expected = %hex::encode(self.fingerprint), got = %hex::encode(got), "server certificate fingerprint mismatch");
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}
