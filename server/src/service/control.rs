//! The state of the same-host control channel: its socket, who may connect, and the tokens
//! that bind a socket connection to a QUIC connection's session. The front door that serves
//! it is `local.rs`.

use super::session::Session;
use kvpool_proto::LocalOffer;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Bytes of a token.
pub const TOKEN_LEN: usize = 32;
/// Time a new socket connection has to present its token.
pub(super) const BIND_TIMEOUT: Duration = Duration::from_secs(5);
/// Socket connections one QUIC connection may bind at once.
pub const MAX_SOCKETS_PER_CONNECTION: usize = 64;
/// Raw bytes a request or response envelope may carry beyond one frame: small values travel in
/// band; bulk bytes go through shared buffers (`PutFrom` / `GetInto`) or over QUIC.
const RAW_ALLOWANCE: u32 = 64 << 10;

pub(super) type Tokens = Arc<Mutex<HashMap<[u8; TOKEN_LEN], Binding>>>;

#[derive(Clone)]
pub(super) struct Binding {
    pub(super) session: Weak<Session>,
    /// Closed (sender dropped) when the ticket is dropped.
    pub(super) alive: tokio::sync::watch::Receiver<()>,
    pub(super) sockets: Arc<AtomicUsize>,
}

/// A session's right to bind control sockets. Dropping it (the QUIC connection ended, or it
/// attached again) forgets the token and closes the sockets bound with it.
pub struct LocalTicket {
    token: [u8; TOKEN_LEN],
    tokens: Tokens,
    _alive: tokio::sync::watch::Sender<()>,
}

impl Drop for LocalTicket {
    fn drop(&mut self) {
        self.tokens.lock().remove(&self.token);
    }
}

/// The control socket of a server: its path, who may connect, and the live tokens.
pub struct LocalControl {
    pub(super) path: PathBuf,
    pub(super) allowed_uids: Vec<u32>,
    pub(super) tokens: Tokens,
    pub(super) max_request: u32,
    pub(super) max_response: u32,
    pub(super) listener: Mutex<Option<std::os::unix::net::UnixListener>>,
}

impl LocalControl {
    /// Bind `path` (a stale socket there is replaced). Users other than the server's own and
    /// `allowed_uids` are refused. Nothing is served until `local::serve` runs.
    pub fn bind(path: &Path, allowed_uids: Vec<u32>, max_frame: u32) -> io::Result<LocalControl> {
        let _ = std::fs::remove_file(path);
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        // The server's own user always, and the listed ones.
        let mut allowed_uids = allowed_uids;
        allowed_uids.push(rustix::process::getuid().as_raw());
        let max_request = max_frame.saturating_add(4).saturating_add(RAW_ALLOWANCE);
        // An answer is at most about as long as its request's frame (keys in, a status or a
        // location per key out); twice that leaves room, so that a request whose effects took
        // place is not answered with an overflow.
        let max_response = max_frame.saturating_mul(2).saturating_add(4).saturating_add(RAW_ALLOWANCE);
        Ok(LocalControl {
            path: path.to_owned(),
            allowed_uids,
            tokens: Arc::default(),
            max_request,
            max_response,
            listener: Mutex::new(Some(listener)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A token binding sockets to `session`, and the offer that carries it to the client.
    pub fn issue(&self, session: &Arc<Session>) -> io::Result<(LocalTicket, LocalOffer)> {
        let mut token = [0u8; TOKEN_LEN];
        getrandom::getrandom(&mut token).map_err(|e| io::Error::other(e.to_string()))?;
        let (tx, rx) = tokio::sync::watch::channel(());
        let binding = Binding { session: Arc::downgrade(session), alive: rx, sockets: Arc::default() };
        self.tokens.lock().insert(token, binding);
        let offer = LocalOffer {
            socket_path: self.path.display().to_string(),
            token: token.to_vec(),
            max_request: self.max_request,
            max_response: self.max_response,
        };
        Ok((LocalTicket { token, tokens: self.tokens.clone(), _alive: tx }, offer))
    }
}

impl Drop for LocalControl {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
