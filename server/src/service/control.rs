//! The state of the same-host control channel: its socket, who may connect, and the standing
//! tokens that bind socket connections to a QUIC connection's session. The front door that
//! serves it is `local.rs`; what it shares with the bulk channel is in `doors`.

use super::doors::{Caps, Gate, IssueError, Tokens};
use super::session::Session;
use kvpool_proto::LocalOffer;
use parking_lot::Mutex;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Raw bytes a request or response envelope may carry beyond one frame: small values travel in
/// band; bulk bytes go through shared buffers (`PutFrom` / `GetInto`) or over QUIC.
const RAW_ALLOWANCE: u32 = 64 << 10;

/// One standing token per QUIC connection (a later `LocalAttach` replaces it), so the table is
/// bounded by the server's connection limit and no tenant can take another's place in it.
const CAPS: Caps = Caps { total: usize::MAX, per_session: 1, per_tenant: usize::MAX };

/// The control socket of a server: its path, who may connect, the live tokens and the places of
/// sockets that have not shown one yet.
pub struct LocalControl {
    pub(super) path: PathBuf,
    pub(super) allowed_uids: Vec<u32>,
    pub(super) tokens: Tokens<Session>,
    pub(super) gate: Gate,
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
            tokens: Tokens::new(CAPS),
            gate: Gate::default(),
            max_request,
            max_response,
            listener: Mutex::new(Some(listener)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A token binding sockets to `session` (its sockets bound with an earlier one close), and
    /// the offer that carries it to the client.
    pub(super) fn issue(&self, session: &Arc<Session>) -> Result<LocalOffer, IssueError> {
        session.replace_control(|| {
            let (token, ticket) = self.tokens.issue_standing(session)?;
            let offer = LocalOffer {
                socket_path: self.path.display().to_string(),
                token: token.to_vec(),
                max_request: self.max_request,
                max_response: self.max_response,
            };
            Ok((offer, ticket))
        })
    }
}

impl Drop for LocalControl {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
