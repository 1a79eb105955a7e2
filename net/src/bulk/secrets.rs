//! The traffic secrets behind the keys, for key updates (RFC 8446 4.6.3, 7.2).
//!
//! rustls hands over a buffered connection's keys and IVs (`dangerous_extract_secrets`), not
//! the secrets they come from, and the next keys are derived from the secret. rustls 0.23's
//! `kernel::KernelConnection`, which derives them, is only given out by its unbuffered
//! connections, and the channel's handshake runs through tokio-rustls's buffered ones. So each
//! connection's config logs its secrets to a [`SecretLog`] of its own (rustls's `KeyLog`, the
//! hook behind SSLKEYLOGFILE, which it still feeds): it keeps `CLIENT_TRAFFIC_SECRET_0` and
//! `SERVER_TRAFFIC_SECRET_0`, and the layer takes for each direction the secret whose key and
//! IV are the ones rustls extracted, so a secret that does not match is never used.

use super::keys::RecordError;
use ring::hkdf::{self, KeyType as _};
use rustls::KeyLog;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Longest secret: a SHA-384 hash.
const MAX_SECRET: usize = 48;

/// An application traffic secret and its hash (the suite's).
#[derive(Clone)]
pub(super) struct Secret {
    hash: hkdf::Algorithm,
    bytes: [u8; MAX_SECRET],
}

impl Secret {
    /// `bytes` of the hash `hash` (32 bytes SHA-256, 48 SHA-384).
    pub(super) fn new(hash: hkdf::Algorithm, bytes: &[u8]) -> Result<Secret, RecordError> {
        let len = hash.len();
        if bytes.len() != len {
            return Err(RecordError::Secrets("a traffic secret of the wrong length for the suite's hash"));
        }
        let mut s = Secret { hash, bytes: [0; MAX_SECRET] };
        s.bytes[..len].copy_from_slice(bytes);
        Ok(s)
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes[..self.hash.len()]
    }

    /// `HKDF-Expand-Label(secret, label, "", out.len())` (RFC 8446 7.1).
    pub(super) fn expand_label(&self, label: &[u8], out: &mut [u8]) -> Result<(), RecordError> {
        struct Len(usize);
        impl hkdf::KeyType for Len {
            fn len(&self) -> usize {
                self.0
            }
        }
        let length = u16::try_from(out.len()).map_err(|_| RecordError::Secrets("an HKDF output too long"))?;
        let label_len = [(b"tls13 ".len() + label.len()) as u8];
        // struct { uint16 length; opaque label<7..255> = "tls13 " + label; opaque context<0..255> = "" }
        let info: [&[u8]; 5] = [&length.to_be_bytes(), &label_len, b"tls13 ", label, &[0]];
        hkdf::Prk::new_less_safe(self.hash, self.bytes())
            .expand(&info, Len(out.len()))
            .and_then(|okm| okm.fill(out))
            .map_err(|_| RecordError::Secrets("an HKDF output too long"))
    }

    /// `application_traffic_secret_N+1` (RFC 8446 7.2).
    pub(super) fn next(&self) -> Result<Secret, RecordError> {
        let mut n = Secret { hash: self.hash, bytes: [0; MAX_SECRET] };
        let len = self.hash.len();
        self.expand_label(b"traffic upd", &mut n.bytes[..len])?;
        Ok(n)
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // Best effort: the old secret does not outlive its keys in this struct.
        self.bytes = [0; MAX_SECRET];
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The first application traffic secrets of one connection, as rustls logs them: set it as
/// the `key_log` of the connection's config (a config of its own, see [`SecretLog::server`]
/// and [`SecretLog::client`]) and hand it to [`tls`](super::tls) with the extracted keys.
pub struct SecretLog {
    /// The config's own key log, which still sees every secret it asks for.
    next: Arc<dyn KeyLog>,
    caught: Mutex<Caught>,
}

#[derive(Default)]
struct Caught {
    client: Option<Vec<u8>>,
    server: Option<Vec<u8>>,
}

const CLIENT_LABEL: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_LABEL: &str = "SERVER_TRAFFIC_SECRET_0";

impl SecretLog {
    pub fn new(next: Arc<dyn KeyLog>) -> Arc<SecretLog> {
        Arc::new(SecretLog { next, caught: Mutex::new(Caught::default()) })
    }

    /// A copy of `config` whose secrets go to a new log (per connection: a log holds one
    /// connection's secrets).
    pub fn server(config: &rustls::ServerConfig) -> (Arc<rustls::ServerConfig>, Arc<SecretLog>) {
        let log = SecretLog::new(config.key_log.clone());
        let mut c = config.clone();
        c.key_log = log.clone();
        (Arc::new(c), log)
    }

    /// As [`SecretLog::server`], for a client.
    pub fn client(config: &rustls::ClientConfig) -> (Arc<rustls::ClientConfig>, Arc<SecretLog>) {
        let log = SecretLog::new(config.key_log.clone());
        let mut c = config.clone();
        c.key_log = log.clone();
        (Arc::new(c), log)
    }

    /// The client's and the server's `application_traffic_secret_0`, once logged.
    pub(super) fn take(&self) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
        let mut c = self.caught.lock().unwrap_or_else(|p| p.into_inner());
        (c.client.take(), c.server.take())
    }
}

impl KeyLog for SecretLog {
    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        if self.next.will_log(label) {
            self.next.log(label, client_random, secret);
        }
        let mut c = self.caught.lock().unwrap_or_else(|p| p.into_inner());
        match label {
            CLIENT_LABEL => c.client = Some(secret.to_vec()),
            SERVER_LABEL => c.server = Some(secret.to_vec()),
            _ => {}
        }
    }

    fn will_log(&self, label: &str) -> bool {
        label == CLIENT_LABEL || label == SERVER_LABEL || self.next.will_log(label)
    }
}

impl fmt::Debug for SecretLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretLog").field("next", &self.next).finish_non_exhaustive()
    }
}
