//! The TCP bulk channel (PROTOCOL.md 11.10): puts and gets of a QUIC session carried by TCP
//! connections (TLS, or plaintext on a network both sides list as trusted), so that bulk bytes
//! ride the kernel's TCP offloads. Each connection is bound to the session by a one-time token
//! from `BulkAttach`; idle connections are kept for the next call. Everything else (hello,
//! lookups, small puts) stays on QUIC.
//!
//! rustls does the handshake and carries the token and the status byte; after that the
//! connection's TLS records are `kvpool_net::bulk`'s: a request's frame and values leave in a
//! few large writes, and a get's values are decrypted where they land in the caller's buffer.

use crate::config::BulkChoice;
use crate::error::{ClientError, Result};
use crate::{read_response, unexpected, ClientConfig};
use kvpool_net::bulk::{self, BulkRead, BulkWrite, Piece};
use kvpool_proto::frame::{encode_frame, read_message};
use kvpool_proto::{BulkAttachRequest, ErrorCode, Request, Response, CLIENT_MAX_FRAME};
use parking_lot::Mutex;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Chunk length that ends an answer.
const END: u32 = u32::MAX;
/// Connections open per session, idle or busy; a call past it goes over QUIC. Under the
/// server's 64 per QUIC connection, so a busy client is never refused a connection.
const MAX_OPEN: usize = 32;
/// After the channel failed to open, calls use QUIC for this long before trying again.
const BACK_OFF: Duration = Duration::from_secs(10);
/// Bound on opening one connection (token, TCP, TLS, bind): a dead or unreachable channel
/// costs a call at most this before it goes over QUIC.
const OPEN_BUDGET: Duration = Duration::from_millis(500);

/// One bound TCP connection; read, it yields the answer to the request last sent
/// ([`BulkConn::send`]), de-chunked: its frame and value bytes, then the end of the stream (or
/// a reset, read as an error).
pub(crate) struct BulkConn {
    rd: Box<dyn BulkRead>,
    wr: Box<dyn BulkWrite>,
    /// This connection's place among the session's [`MAX_OPEN`].
    _open: OwnedSemaphorePermit,
    state: State,
    left: u32,
    head: [u8; 5],
    have: usize,
}

/// The bulk channel of one QUIC session: how to open connections, and the idle ones.
pub(crate) struct BulkLink {
    ip: std::net::IpAddr,
    tls: Arc<rustls::ClientConfig>,
    server_name: rustls::pki_types::ServerName<'static>,
    plaintext: bool,
    /// Puts of at least this many value bytes take the channel.
    pub(crate) min_put: u64,
    idle: Mutex<Vec<BulkConn>>,
    open: Arc<Semaphore>,
    down_until: Mutex<Option<Instant>>,
    /// What the last connection opened was: `None` (none yet, or the channel is down), or
    /// whether it was TLS.
    opened: Mutex<Option<bool>>,
}

impl BulkLink {
    /// The channel for a session with the server at `addr`, when `cfg` asks for it.
    pub(crate) fn for_server(cfg: &ClientConfig, addr: SocketAddr, version: u16) -> Result<Option<Arc<BulkLink>>> {
        let wanted = match cfg.bulk {
            BulkChoice::Quic => false,
            BulkChoice::Tcp => true,
            BulkChoice::Auto => kvpool_net::path_kind(addr.ip()) == kvpool_net::PathKind::Network,
        };
        if !wanted || version < 2 {
            return Ok(None);
        }
        let mut tls = crate::tls::rustls_config(&cfg.trust)?;
        tls.alpn_protocols = vec![kvpool_proto::BULK_ALPN.to_vec()];
        // After the bind the records are ours (module docs): rustls hands over the keys.
        tls.enable_secret_extraction = true;
        let server_name = rustls::pki_types::ServerName::try_from(cfg.server_name.clone())
            .map_err(|e| ClientError::Config(format!("server name {:?}: {e}", cfg.server_name)))?;
        let ip = addr.ip().to_canonical();
        Ok(Some(Arc::new(BulkLink {
            ip,
            tls: Arc::new(tls),
            server_name,
            plaintext: cfg.trusted_networks.iter().any(|n| n.contains(&ip)),
            min_put: cfg.bulk_min_put,
            idle: Mutex::new(Vec::new()),
            open: Arc::new(Semaphore::new(MAX_OPEN)),
            down_until: Mutex::new(None),
            opened: Mutex::new(None),
        })))
    }

    /// An idle connection, or a new one; `None` (use QUIC) while the channel is down or all
    /// of the session's connections are busy.
    pub(crate) async fn take(&self, conn: &quinn::Connection) -> Option<BulkConn> {
        loop {
            let Some(mut c) = self.idle.lock().pop() else { break };
            // One the server closed while it sat idle (restart, the session ended) is dropped.
            if c.rd.idle() {
                return Some(c);
            }
        }
        if self.down_until.lock().is_some_and(|t| Instant::now() < t) {
            return None;
        }
        let permit = self.open.clone().try_acquire_owned().ok()?;
        match tokio::time::timeout(OPEN_BUDGET, self.open(conn, permit)).await {
            Ok(Ok(c)) => Some(c),
            // The server is there but has no room for this one now (its token or connection
            // limits): this call goes over QUIC, the next tries again.
            Ok(Err(ClientError::Status { code: ErrorCode::Rejected, .. })) => None,
            Ok(Err(e)) => {
                self.fail(&e);
                None
            }
            Err(_) => {
                self.fail(&ClientError::Timeout(OPEN_BUDGET));
                None
            }
        }
    }

    fn fail(&self, e: &ClientError) {
        if e.code() == ErrorCode::Unsupported {
            tracing::debug!("the server offers no bulk channel; bulk bytes go over QUIC");
        } else {
            tracing::warn!(error = %e, "TCP bulk channel not available; bulk bytes go over QUIC for {BACK_OFF:?}");
        }
        *self.down_until.lock() = Some(Instant::now() + BACK_OFF);
        *self.opened.lock() = None;
    }

    /// `"tls"` or `"tcp"` once a connection of the channel is open, else `None`.
    pub(crate) fn in_use(&self) -> Option<&'static str> {
        self.opened.lock().map(|tls| if tls { "tls" } else { "tcp" })
    }

    /// Keep a connection for the next call when its last answer was read to its end (and,
    /// for a put, its values all sent); drop it otherwise.
    pub(crate) fn keep(&self, c: BulkConn) {
        let mut idle = self.idle.lock();
        if c.state == State::Done && idle.len() < MAX_OPEN {
            idle.push(c);
        }
    }

    async fn open(&self, conn: &quinn::Connection, permit: OwnedSemaphorePermit) -> Result<BulkConn> {
        let (mut tx, mut rx) = conn.open_bi().await?;
        let ask = Request::BulkAttach(BulkAttachRequest { plaintext: self.plaintext });
        tx.write_all(&encode_frame(&ask)?).await?;
        tx.finish()?;
        let offer = match read_response(conn, &mut rx).await? {
            Response::BulkOffer(o) => o,
            other => return Err(unexpected("BulkOffer", &other)),
        };
        if !offer.tls && !self.plaintext {
            return Err(ClientError::Protocol("the server offered plaintext that was not asked for".into()));
        }
        let addr = SocketAddr::new(self.ip, offer.port);
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| ClientError::Connect { addr: addr.to_string(), message: format!("bulk channel: {e}") })?;
        tcp.set_nodelay(true).map_err(io_err)?;
        let (rd, wr): (Box<dyn BulkRead>, Box<dyn BulkWrite>) = if offer.tls {
            // A config of its own, whose key log keeps the connection's traffic secrets: the
            // record layer derives its next keys from them (key updates).
            let (config, secrets_log) = bulk::SecretLog::client(&self.tls);
            let mut s = tokio_rustls::TlsConnector::from(config)
                .connect(self.server_name.clone(), tcp)
                .await
                .map_err(|e| ClientError::Tls(e.to_string()))?;
            bind(&mut s, &offer.token).await?;
            // The server sends nothing after the status byte until it has a request: rustls
            // holds nothing more, and the records from here on are ours.
            let (tcp, mut conn) = s.into_inner();
            // Whatever rustls still holds would be lost to our records: refuse rather than
            // read a stream that starts mid-record.
            let unread =
                conn.process_new_packets().map_err(|e| ClientError::Tls(e.to_string()))?.plaintext_bytes_to_read();
            if unread > 0 {
                return Err(ClientError::Protocol(format!(
                    "the bulk channel sent {unread} bytes after its status byte, before any request"
                )));
            }
            let secrets = conn.dangerous_extract_secrets().map_err(|e| ClientError::Tls(e.to_string()))?;
            let (r, w) = bulk::tls(tcp, secrets, &secrets_log).map_err(|e| ClientError::Tls(e.to_string()))?;
            (Box::new(r), Box::new(w))
        } else {
            let mut tcp = tcp;
            bind(&mut tcp, &offer.token).await?;
            let (r, w) = bulk::plain(tcp);
            (Box::new(r), Box::new(w))
        };
        *self.opened.lock() = Some(offer.tls);
        Ok(BulkConn { rd, wr, _open: permit, state: State::Done, left: 0, head: [0; 5], have: 0 })
    }
}

/// Present the token and read the status byte (and a refusal's error frame).
async fn bind<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S, token: &[u8]) -> Result<()> {
    io.write_all(token).await.map_err(io_err)?;
    io.flush().await.map_err(io_err)?;
    let mut status = [0u8; 1];
    io.read_exact(&mut status).await.map_err(io_err)?;
    if status[0] != 0 {
        return Err(match read_message::<_, Response>(io, CLIENT_MAX_FRAME).await? {
            Response::Error(b) => ClientError::Status { code: b.code, message: b.message },
            other => unexpected("Error", &other),
        });
    }
    Ok(())
}

fn io_err(e: io::Error) -> ClientError {
    ClientError::Io(format!("bulk channel: {e}"))
}

impl BulkConn {
    /// Send one request: its frame, then `values`, in as few writes as the connection takes.
    /// The server reads values as they come and answers after the last (or early, with an
    /// error, reading the rest), so the answer is read after this returns.
    pub(crate) async fn send(&mut self, frame: &[u8], values: &[&[u8]]) -> Result<()> {
        // Until the answer is read to its end, the connection is not kept.
        self.state = State::Head;
        let len = frame.len() as u64 + values.iter().map(|v| v.len() as u64).sum::<u64>();
        let mut head = Vec::with_capacity(8 + frame.len());
        head.extend_from_slice(&len.to_le_bytes());
        head.extend_from_slice(frame);
        let pieces: Vec<Piece<'_>> =
            std::iter::once(Piece::Small(&head[..])).chain(values.iter().map(|v| Piece::Value(v))).collect();
        bulk::send_all(&mut *self.wr, &pieces).await.map_err(io_err)
    }

    /// Fill `dst` with the next value bytes of the answer (under TLS decrypted where they
    /// land), `landed` seeing each part as it is final.
    pub(crate) async fn read_value(
        &mut self,
        dst: &mut [u8],
        landed: &mut (dyn FnMut(&[u8]) + Send),
    ) -> io::Result<()> {
        let mut filled = 0;
        while filled < dst.len() {
            std::future::poll_fn(|cx| self.poll_body(cx)).await?;
            let n = (self.left as usize).min(dst.len() - filled);
            self.rd.fill(&mut dst[filled..filled + n], landed).await?;
            self.left -= n as u32;
            filled += n;
        }
        Ok(())
    }
}

impl Drop for BulkConn {
    /// A connection given up on the server's bad records tells it why (a TLS alert): one
    /// write that does not wait.
    fn drop(&mut self) {
        bulk::try_alert(&mut *self.wr);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Body,
    Tail,
    Done,
    Reset(u32),
}

impl BulkConn {
    /// Read up to `n` bytes of a chunk header or tail into `head`.
    fn poll_head(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<io::Result<()>> {
        while self.have < n {
            let mut b = [0u8; 5];
            let mut rb = ReadBuf::new(&mut b[..n - self.have]);
            ready!(Pin::new(&mut self.rd).poll_read(cx, &mut rb))?;
            let got = rb.filled().len();
            if got == 0 {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "bulk connection closed")));
            }
            self.head[self.have..self.have + got].copy_from_slice(rb.filled());
            self.have += got;
        }
        self.have = 0;
        Poll::Ready(Ok(()))
    }

    /// Through chunk headers to value bytes: `Ready(Ok)` inside a chunk with bytes left; an
    /// answer that ends (or is reset) first is an error.
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match self.state {
                State::Body if self.left > 0 => return Poll::Ready(Ok(())),
                State::Body => self.state = State::Head,
                State::Done => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the answer ended before its declared value bytes",
                    )))
                }
                State::Reset(code) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("the server reset the answer (code {code})"),
                    )))
                }
                State::Head => {
                    ready!(self.poll_head(cx, 4))?;
                    let n = u32::from_le_bytes(self.head[..4].try_into().expect("4 bytes"));
                    if n == END {
                        self.state = State::Tail;
                    } else if n > END >> 1 {
                        return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, "bad bulk chunk length")));
                    } else {
                        self.left = n;
                        self.state = State::Body;
                    }
                }
                State::Tail => {
                    ready!(self.poll_head(cx, 5))?;
                    let code = u32::from_le_bytes(self.head[1..5].try_into().expect("4 bytes"));
                    self.state = if self.head[0] == 0 { State::Done } else { State::Reset(code) };
                }
            }
        }
    }
}

impl AsyncRead for BulkConn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        match ready!(me.poll_body(cx)) {
            Ok(()) => {}
            // The end of the answer is the end of the stream.
            Err(_) if me.state == State::Done => return Poll::Ready(Ok(())),
            Err(e) => return Poll::Ready(Err(e)),
        }
        let want = buf.remaining().min(me.left as usize);
        let mut part = buf.take(want);
        ready!(Pin::new(&mut me.rd).poll_read(cx, &mut part))?;
        let n = part.filled().len();
        if n == 0 {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "bulk connection closed")));
        }
        // SAFETY: `part` filled these bytes of `buf`'s unfilled part.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        me.left -= n as u32;
        Poll::Ready(Ok(()))
    }
}

/// Read the answer's frame; a typed error becomes `ClientError::Status`.
pub(crate) async fn read_answer(rx: &mut BulkConn) -> Result<Response> {
    match read_message::<_, Response>(rx, CLIENT_MAX_FRAME).await {
        Ok(Response::Error(body)) => Err(ClientError::Status { code: body.code, message: body.message }),
        Ok(r) => Ok(r),
        Err(e) => Err(e.into()),
    }
}
