//! The same-host transport's handshake: a client that has authenticated over QUIC receives a
//! one-time token there, connects to the server's Unix socket, presents the token, and hands over
//! its buffers as sealed memfds (SCM_RIGHTS). The server checks the peer's credentials, imports
//! and maps the buffers, and from then on copies between its segment and them with a
//! [`CopyEngine`]. The server never maps its own memory into a client.
//!
//! Socket protocol (strict request/reply, one message at a time): a u32 little-endian length,
//! then a [`ShmMsg`] in kvpool's codec, with any file descriptors of an `Add` attached to the
//! same `sendmsg`; the server answers each message with a [`ShmReply`] framed the same way.

use crate::copy::CopyEngine;
use crate::memfd::{Mapping, SharedBuffer};
use crate::{PeerId, RegionId};
use kvpool_proto::codec;
use parking_lot::Mutex;
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most buffers one `Add` may carry.
pub const MAX_FDS: usize = 64;
/// Largest message on the socket.
const MAX_MSG: u32 = 64 << 10;
/// A client must present its token this soon after connecting.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// A message from the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShmMsg {
    /// The token the client got over its authenticated QUIC connection.
    Attach { token: Vec<u8> },
    /// Buffers to share: (region id chosen by the client, length); one memfd each, in order.
    Add { regions: Vec<(u64, u64)> },
    /// Stop sharing these buffers.
    Remove { ids: Vec<u64> },
}

/// The server's answer to one message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShmReply {
    Ok,
    Err(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("shm socket: {0}")]
    Io(#[from] io::Error),
    #[error("shm protocol: {0}")]
    Protocol(String),
    #[error("the server refused: {0}")]
    Refused(String),
}

fn send(stream: &UnixStream, body: &[u8], fds: &[rustix::fd::BorrowedFd<'_>]) -> io::Result<()> {
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(body);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one message"));
    }
    let sent = rustix::net::sendmsg(stream, &[IoSlice::new(&frame)], &mut anc, SendFlags::NOSIGNAL)?;
    // Descriptors went with the first bytes; the rest, if any, goes plainly.
    (&*stream).write_all(&frame[sent..])
}

/// A message body and the descriptors that came with it.
type Received = (Vec<u8>, Vec<OwnedFd>);

/// One message; `None` at a clean end of stream.
fn recv(stream: &UnixStream) -> Result<Option<Received>, ShmError> {
    let mut buf = vec![0u8; 4096];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(stream, &mut [IoSliceMut::new(&mut buf)], &mut anc, RecvFlags::CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    for msg in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = msg {
            fds.extend(it);
        }
    }
    if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        return Err(ShmError::Protocol(format!("more than {MAX_FDS} descriptors in one message")));
    }
    if r.bytes == 0 {
        return Ok(None);
    }
    let mut have = r.bytes;
    while have < 4 {
        let n = (&*stream).read(&mut buf[have..4])?;
        if n == 0 {
            return Err(ShmError::Protocol("stream ended inside a frame".into()));
        }
        have += n;
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len > MAX_MSG {
        return Err(ShmError::Protocol(format!("message of {len} bytes; the limit is {MAX_MSG}")));
    }
    let total = 4 + len as usize;
    if buf.len() < total {
        buf.resize(total, 0);
    }
    if have > total {
        return Err(ShmError::Protocol("bytes after a message; wait for each reply".into()));
    }
    (&*stream).read_exact(&mut buf[have..total])?;
    buf.truncate(total);
    buf.drain(..4);
    Ok(Some((buf, fds)))
}

fn reply(stream: &UnixStream, r: &ShmReply) -> io::Result<()> {
    let body = codec::encode(r).map_err(io::Error::other)?;
    send(stream, &body, &[])
}

struct ServerInner {
    transport: Arc<CopyEngine>,
    /// Tokens issued and not yet presented.
    tickets: Mutex<HashMap<[u8; 32], PeerId>>,
    allowed_uids: Vec<u32>,
}

/// The server's Unix socket for same-host clients.
pub struct ShmServer {
    path: PathBuf,
    inner: Arc<ServerInner>,
}

/// A session's right to share buffers: its token, and the peer its buffers join. Dropping it
/// disconnects the peer (buffers in use by a transfer are released when the transfer ends).
pub struct Ticket {
    pub token: [u8; 32],
    pub peer: PeerId,
    inner: Arc<ServerInner>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.inner.tickets.lock().remove(&self.token);
        let _ = crate::Transport::disconnect(&*self.inner.transport, self.peer);
    }
}

impl ShmServer {
    /// Listen on `path` (a stale socket there is replaced). Connections from users other than
    /// the server's own and `allowed_uids` are refused.
    pub fn start(path: &Path, transport: Arc<CopyEngine>, allowed_uids: Vec<u32>) -> io::Result<ShmServer> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        // The server's own user always, and the listed ones.
        let mut allowed_uids = allowed_uids;
        allowed_uids.push(rustix::process::getuid().as_raw());
        let inner = Arc::new(ServerInner { transport, tickets: Mutex::new(HashMap::new()), allowed_uids });
        let acc = inner.clone();
        std::thread::Builder::new().name("kvpool-shm".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let inner = acc.clone();
                let _ = std::thread::Builder::new().name("kvpool-shm-conn".into()).spawn(move || {
                    if let Err(e) = serve(&inner, &conn) {
                        tracing::info!(error = %e, "shm client ended");
                    }
                });
            }
        })?;
        Ok(ShmServer { path: path.to_owned(), inner })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn transport(&self) -> &Arc<CopyEngine> {
        &self.inner.transport
    }

    /// A token for an authenticated session, and the peer its buffers will join.
    pub fn issue(&self) -> io::Result<Ticket> {
        let mut token = [0u8; 32];
        getrandom::getrandom(&mut token).map_err(|e| io::Error::other(e.to_string()))?;
        let peer = self.inner.transport.new_peer();
        self.inner.tickets.lock().insert(token, peer);
        Ok(Ticket { token, peer, inner: self.inner.clone() })
    }
}

impl Drop for ShmServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One client connection: credentials, token, then buffer messages until it hangs up.
fn serve(inner: &ServerInner, conn: &UnixStream) -> Result<(), ShmError> {
    let cred = rustix::net::sockopt::socket_peercred(conn).map_err(io::Error::from)?;
    if !inner.allowed_uids.contains(&cred.uid.as_raw()) {
        let _ = reply(conn, &ShmReply::Err(format!("user {} may not use shared memory here", cred.uid.as_raw())));
        return Err(ShmError::Refused(format!(
            "uid {} (pid {}) not allowed",
            cred.uid.as_raw(),
            cred.pid.as_raw_nonzero()
        )));
    }
    conn.set_read_timeout(Some(ATTACH_TIMEOUT))?;
    let peer = match recv(conn)? {
        Some((body, fds)) if fds.is_empty() => match codec::decode::<ShmMsg>(&body) {
            Ok(ShmMsg::Attach { token }) => {
                let peer = <[u8; 32]>::try_from(token.as_slice()).ok().and_then(|t| inner.tickets.lock().remove(&t));
                match peer {
                    Some(p) => p,
                    None => {
                        reply(conn, &ShmReply::Err("unknown or used token".into()))?;
                        return Err(ShmError::Refused("unknown token".into()));
                    }
                }
            }
            _ => {
                reply(conn, &ShmReply::Err("the first message must be an attach".into()))?;
                return Err(ShmError::Protocol("no attach".into()));
            }
        },
        Some(_) => return Err(ShmError::Protocol("descriptors before the attach".into())),
        None => return Ok(()),
    };
    reply(conn, &ShmReply::Ok)?;
    conn.set_read_timeout(None)?;
    tracing::debug!(pid = cred.pid.as_raw_nonzero().get(), ?peer, "shm client attached");
    let t = &inner.transport;
    let result = loop {
        let Some((body, fds)) = recv(conn)? else { break Ok(()) };
        let answer = match codec::decode::<ShmMsg>(&body) {
            Ok(ShmMsg::Add { regions }) if regions.len() == fds.len() => add(t, peer, &regions, fds),
            Ok(ShmMsg::Add { regions }) => Err(format!("{} regions but {} descriptors", regions.len(), fds.len())),
            Ok(ShmMsg::Remove { ids }) => {
                for id in ids {
                    let _ = t.remove_peer_region(peer, RegionId(id));
                }
                Ok(())
            }
            Ok(ShmMsg::Attach { .. }) => Err("already attached".into()),
            Err(e) => Err(format!("undecodable message: {e}")),
        };
        let r = match answer {
            Ok(()) => ShmReply::Ok,
            Err(m) => ShmReply::Err(m),
        };
        if let Err(e) = reply(conn, &r) {
            break Err(e.into());
        }
    };
    // The client hung up (or broke the protocol): its buffers are no longer offered.
    for (id, _) in t.peer_regions(peer) {
        let _ = t.remove_peer_region(peer, id);
    }
    result
}

/// Import every buffer of an `Add`, or none of them.
fn add(t: &CopyEngine, peer: PeerId, regions: &[(u64, u64)], fds: Vec<OwnedFd>) -> Result<(), String> {
    let mut maps = Vec::with_capacity(regions.len());
    for (&(id, len), fd) in regions.iter().zip(fds) {
        let m = Mapping::import(fd, len).map_err(|e| format!("region {id}: {e}"))?;
        maps.push((id, m));
    }
    for (id, m) in maps {
        let (addr, len) = (m.addr(), m.len());
        t.add_peer_region(peer, RegionId(id), addr, len, Arc::new(m)).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The client side: a connection on which buffers are shared with one server.
pub struct ShmClient {
    stream: UnixStream,
}

impl ShmClient {
    /// Connect to the server's socket and present the session's token.
    pub fn connect(path: &Path, token: &[u8]) -> Result<ShmClient, ShmError> {
        let stream = UnixStream::connect(path)?;
        let c = ShmClient { stream };
        c.call(&ShmMsg::Attach { token: token.to_vec() }, &[])?;
        Ok(c)
    }

    fn call(&self, msg: &ShmMsg, fds: &[rustix::fd::BorrowedFd<'_>]) -> Result<(), ShmError> {
        let body = codec::encode(msg).map_err(|e| ShmError::Protocol(e.to_string()))?;
        send(&self.stream, &body, fds)?;
        let (body, _) = recv(&self.stream)?.ok_or_else(|| ShmError::Protocol("server hung up".into()))?;
        match codec::decode::<ShmReply>(&body).map_err(|e| ShmError::Protocol(e.to_string()))? {
            ShmReply::Ok => Ok(()),
            ShmReply::Err(m) => Err(ShmError::Refused(m)),
        }
    }

    /// Share buffers under the given region ids (at most [`MAX_FDS`] per call).
    pub fn add(&self, regions: &[(RegionId, &SharedBuffer)]) -> Result<(), ShmError> {
        for chunk in regions.chunks(MAX_FDS) {
            let list = chunk.iter().map(|(id, b)| (id.0, b.len() as u64)).collect();
            let fds: Vec<_> = chunk.iter().map(|(_, b)| b.fd()).collect();
            self.call(&ShmMsg::Add { regions: list }, &fds)?;
        }
        Ok(())
    }

    /// Stop sharing buffers; transfers already running on them finish first on the server.
    pub fn remove(&self, ids: &[RegionId]) -> Result<(), ShmError> {
        self.call(&ShmMsg::Remove { ids: ids.iter().map(|r| r.0).collect() }, &[])
    }

    /// The connection, for a caller that polls it.
    pub fn as_fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemKind, Op, Region, Transport, Xfer};

    #[tokio::test]
    async fn a_client_shares_buffers_and_the_server_copies_into_them() {
        let dir = tempfile::tempdir().unwrap();
        let t = Arc::new(CopyEngine::new(2));
        let server = ShmServer::start(&dir.path().join("shm.sock"), t.clone(), vec![]).unwrap();
        let mut seg = vec![0u8; 1 << 20];
        // SAFETY: `seg` outlives the transfers below.
        let seg_id =
            unsafe { t.register(Region { addr: seg.as_mut_ptr() as usize, len: seg.len(), kind: MemKind::Host }) }
                .unwrap();
        let ticket = server.issue().unwrap();
        // A wrong token is refused; the right one works once.
        assert!(matches!(ShmClient::connect(server.path(), &[0u8; 32]), Err(ShmError::Refused(_))));
        let client = ShmClient::connect(server.path(), &ticket.token).unwrap();
        assert!(ShmClient::connect(server.path(), &ticket.token).is_err());
        let mut buf = SharedBuffer::new(4096, "test").unwrap();
        buf.as_mut_slice()[..5].copy_from_slice(b"hello");
        client.add(&[(RegionId(3), &buf)]).unwrap();
        let x = Xfer { local: seg_id, local_offset: 10, remote: RegionId(3), remote_offset: 0, len: 5 };
        let id = t.post(ticket.peer, Op::Read, &[x]).unwrap();
        crate::wait(&*t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&seg[10..15], b"hello");
        seg[0..3].copy_from_slice(b"abc");
        let x = Xfer { local: seg_id, local_offset: 0, remote: RegionId(3), remote_offset: 4000, len: 3 };
        let id = t.post(ticket.peer, Op::Write, &[x]).unwrap();
        crate::wait(&*t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&buf.as_slice()[4000..4003], b"abc");
        // An unsealed file is refused with a reason; nothing is added.
        let raw = rustix::fs::memfd_create("raw", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&raw, 4096).unwrap();
        let body = codec::encode(&ShmMsg::Add { regions: vec![(4, 4096)] }).unwrap();
        send(&client.stream, &body, &[raw.as_fd()]).unwrap();
        let (r, _) = recv(&client.stream).unwrap().unwrap();
        assert!(matches!(codec::decode::<ShmReply>(&r).unwrap(), ShmReply::Err(m) if m.contains("sealed")));
        assert_eq!(t.peer_regions(ticket.peer).len(), 1);
        // Removing, then the client hanging up, leaves the peer with nothing.
        client.remove(&[RegionId(3)]).unwrap();
        assert!(t.peer_regions(ticket.peer).is_empty());
        drop(client);
        drop(ticket);
    }
}
