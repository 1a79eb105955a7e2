//! Async Rust client for kvpool.
//!
//! One QUIC connection per [`Client`]; every call opens its own bidirectional stream, so a
//! cloned `Client` can be used from many tasks at once with many requests in flight. See
//! `docs/PROTOCOL.md` for the wire format.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvpool_client::ClientError> {
//! let client = kvpool_client::Client::connect(kvpool_client::ClientConfig::from_data_dir("kvpool-data")?).await?;
//! client.put("block-1", b"bytes").await?;
//! assert_eq!(client.get("block-1").await?.as_deref(), Some(&b"bytes"[..]));
//! # Ok(()) }
//! ```

mod admin;
pub mod blocking;
mod cluster;
mod config;
mod connector;
mod error;
mod events;
mod local;
mod nodes;
mod onesided;
mod shm;
#[cfg(feature = "test-hooks")]
mod testing;
pub mod tls;

pub use cluster::{ClusterClient, ServerRole};
pub use config::{parse_fingerprint, read_key_file, ClientConfig, EndpointInfo, TransportChoice, Trust};
pub use connector::LookupLease;
pub use error::{ClientError, Result};
pub use events::{SubscribeOptions, Subscription};
pub use kvpool_net::{PathReport, QuicTuning, Segmentation};
pub use kvpool_proto as proto;
pub use kvpool_proto::{
    ErrorCode, HelloOk, Limits, OpStats, PinSpec, PutMode, RemoveAllResponse, StatsReport, TierStats,
};
pub use onesided::{Grant, Located, LocatedBlock};
pub use shm::{BufSlice, Buffer};
#[cfg(feature = "test-hooks")]
pub use testing::{parse_reply, RawConnection};

use kvpool_proto::{
    frame, Hello, KeysRequest, LookupRequest, Ping, PutItem, PutRequest, RemoveAllRequest, RemoveRequest, Request,
    Response, CLIENT_MAX_FRAME, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use quinn::{RecvStream, SendStream};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Per-block metadata of a put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Key of the previous block of the prefix chain.
    pub parent: Option<Vec<u8>>,
    /// Tokens held by this block.
    pub tokens: u32,
    /// Length in tokens of the prefix this block completes (admission by `store_threshold`).
    pub seq_tokens: u64,
    pub pin: PinSpec,
}

impl Default for PutOptions {
    fn default() -> Self {
        PutOptions { parent: None, tokens: 0, seq_tokens: 0, pin: PinSpec::None }
    }
}

/// One item of [`Client::put_batch`]; the value is written to the stream straight from `value`.
#[derive(Debug, Clone)]
pub struct PutEntry<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub opts: PutOptions,
}

impl<'a> PutEntry<'a> {
    pub fn new(key: &'a [u8], value: &'a [u8]) -> Self {
        PutEntry { key, value, opts: PutOptions::default() }
    }
}

/// One item of [`Client::get_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetResult {
    /// `Ok` (then `value` is set), `NotFound` or `Corrupt` (the server dropped the block).
    pub status: ErrorCode,
    pub value: Option<Vec<u8>>,
    /// Tier the bytes came from: 0 device, 1 dram, 2 ssd.
    pub tier: u8,
    /// How long the block stays leased to readers.
    pub lease_ms: u32,
}

/// One item of [`Client::get_batch_into`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetIntoResult {
    /// `Ok` (then `size` bytes were written to the front of the buffer), `NotFound`, `Corrupt`,
    /// or `ValueTooLarge` when the value did not fit the caller's buffer (its bytes were discarded).
    pub status: ErrorCode,
    /// Size of the value on the server (also set for `ValueTooLarge`).
    pub size: u64,
    pub tier: u8,
    pub lease_ms: u32,
}

#[derive(Clone)]
struct Session {
    conn: quinn::Connection,
    hello: HelloOk,
    /// The same-host control channel of this connection, when attached.
    local: Option<Arc<local::LocalLink>>,
}

struct Inner {
    cfg: ClientConfig,
    addr: SocketAddr,
    endpoint: quinn::Endpoint,
    quic: quinn::ClientConfig,
    session: RwLock<Session>,
    /// Serialises reconnects so that a dropped connection is re-established once.
    reconnect: tokio::sync::Mutex<()>,
    nonce: AtomicU64,
    /// Shared buffers, and the shm link of the current connection when there is one.
    registry: Arc<shm::Registry>,
    /// Shared buffers that plain-slice calls stage through on a same-host connection.
    staging: shm::Staging,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(s) = self.session.read() {
            s.conn.close(kvpool_proto::close::OK.into(), b"client dropped");
        }
    }
}

/// A connection to a kvpool server. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("server", &self.inner.cfg.server).field("tenant", &self.tenant()).finish()
    }
}

async fn resolve(server: &str) -> Result<SocketAddr> {
    let mut addrs = tokio::net::lookup_host(server)
        .await
        .map_err(|e| ClientError::Connect { addr: server.to_string(), message: format!("cannot resolve: {e}") })?;
    addrs.next().ok_or_else(|| ClientError::Connect { addr: server.to_string(), message: "no address".into() })
}

fn quic_config(cfg: &ClientConfig, addr: &SocketAddr, bufs: &kvpool_net::SocketBuffers) -> Result<quinn::ClientConfig> {
    let tls = tls::rustls_config(&cfg.trust)?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| ClientError::Tls(e.to_string()))?;
    let mut qc = quinn::ClientConfig::new(Arc::new(crypto));
    let mut t = kvpool_net::transport_config(kvpool_net::path_kind(addr.ip()), bufs, &cfg.quic);
    t.max_concurrent_bidi_streams(0u8.into());
    t.max_concurrent_uni_streams(0u8.into());
    let dead_after = cfg.dead_after.clamp(Duration::from_millis(100), Duration::from_secs(3600));
    t.keep_alive_interval(Some((dead_after / 3).min(Duration::from_secs(5))));
    t.max_idle_timeout(Some(quinn::IdleTimeout::try_from(dead_after).expect("an hour fits")));
    qc.transport_config(Arc::new(t));
    Ok(qc)
}

fn client_endpoint(
    addr: &SocketAddr,
    tuning: &kvpool_net::QuicTuning,
) -> Result<(quinn::Endpoint, kvpool_net::SocketBuffers)> {
    let bind: SocketAddr = if addr.is_ipv6() { "[::]:0".parse() } else { "0.0.0.0:0".parse() }.expect("literal");
    kvpool_net::endpoint(bind, None, tuning).map_err(|e| ClientError::Io(e.to_string()))
}

async fn handshake(
    endpoint: &quinn::Endpoint,
    quic: &quinn::ClientConfig,
    addr: SocketAddr,
    cfg: &ClientConfig,
) -> Result<quinn::Connection> {
    let connect_err = |message: String| ClientError::Connect { addr: cfg.server.clone(), message };
    let connecting =
        endpoint.connect_with(quic.clone(), addr, &cfg.server_name).map_err(|e| connect_err(e.to_string()))?;
    match tokio::time::timeout(cfg.request_timeout, connecting).await {
        Err(_) => Err(connect_err(format!("no QUIC handshake within {:?}", cfg.request_timeout))),
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => match ClientError::from(e) {
            // The pinned verifier's refusal reads as a bare enum name; say what it means.
            ClientError::Tls(m) if m.contains("ApplicationVerificationFailure") => Err(ClientError::Tls(format!(
                "the server certificate does not match the pinned SHA-256 fingerprint ({m})"
            ))),
            t @ ClientError::Tls(_) => Err(t),
            other => Err(connect_err(other.to_string())),
        },
    }
}

async fn hello(conn: &quinn::Connection, cfg: &ClientConfig, version: u16) -> Result<HelloOk> {
    let req = Request::Hello(Hello { version, api_key: cfg.api_key.clone(), client_name: cfg.client_name.clone() });
    let resp = timed(cfg.request_timeout, async {
        let (mut tx, mut rx) = conn.open_bi().await?;
        write_request(&mut tx, &req).await?;
        tx.finish()?;
        read_response(conn, &mut rx).await
    })
    .await;
    match resp {
        Ok(Response::Hello(h)) if (MIN_PROTOCOL_VERSION..=version).contains(&h.version) => Ok(h),
        Ok(Response::Hello(h)) => {
            Err(ClientError::Protocol(format!("server answered version {} to a version {version} hello", h.version)))
        }
        Ok(other) => Err(unexpected("Hello", &other)),
        Err(e) => Err(e),
    }
}

async fn establish(
    endpoint: &quinn::Endpoint,
    quic: &quinn::ClientConfig,
    addr: SocketAddr,
    cfg: &ClientConfig,
) -> Result<Session> {
    let conn = handshake(endpoint, quic, addr, cfg).await?;
    let hello = match hello(&conn, cfg, PROTOCOL_VERSION).await {
        // A server older than this client: speak its version (it closed that connection).
        Err(ClientError::Status { code: ErrorCode::UnsupportedVersion, .. }) if PROTOCOL_VERSION > 1 => {
            conn.close(kvpool_proto::close::OK.into(), b"retry with version 1");
            let conn = handshake(endpoint, quic, addr, cfg).await?;
            let h = hello(&conn, cfg, 1).await;
            return finish_session(conn, h);
        }
        h => h,
    };
    finish_session(conn, hello)
}

fn finish_session(conn: quinn::Connection, hello: Result<HelloOk>) -> Result<Session> {
    match hello {
        Ok(hello) => {
            tracing::debug!(tenant = %hello.tenant, server = %hello.server, version = hello.version, "connected to kvpool");
            Ok(Session { conn, hello, local: None })
        }
        Err(e) => {
            conn.close(kvpool_proto::close::OK.into(), b"hello failed");
            Err(e)
        }
    }
}

/// Set up the same-host transport on a fresh connection when the configuration allows it and the
/// server offers it: ask for a token, attach on the shm socket, share every live buffer.
async fn attach_shm(
    session: &mut Session,
    cfg: &ClientConfig,
    addr: SocketAddr,
    registry: &Arc<shm::Registry>,
) -> Result<()> {
    let wanted = match cfg.transport {
        TransportChoice::Quic => false,
        TransportChoice::Shm => true,
        TransportChoice::Auto => kvpool_net::path_kind(addr.ip()) == kvpool_net::PathKind::SameHost,
    };
    let attempt = async {
        if !wanted {
            return Ok(None);
        }
        if session.hello.version < 2 {
            return Err(ClientError::status(ErrorCode::Unsupported, "the server speaks protocol version 1 only"));
        }
        let offer = timed(cfg.request_timeout, async {
            let (mut tx, mut rx) = session.conn.open_bi().await?;
            write_request(&mut tx, &Request::ShmAttach).await?;
            tx.finish()?;
            match read_response(&session.conn, &mut rx).await? {
                Response::ShmOffer(o) => Ok(o),
                other => Err(unexpected("ShmOffer", &other)),
            }
        })
        .await?;
        let link = tokio::task::spawn_blocking(move || {
            kvpool_transport::shm::ShmClient::connect(std::path::Path::new(&offer.socket_path), &offer.token)
        })
        .await
        .map_err(|e| ClientError::Io(e.to_string()))?
        .map_err(|e| ClientError::Io(format!("attaching to the shm socket: {e}")))?;
        Ok(Some(link))
    };
    let attached = match attempt.await {
        Ok(link) => {
            let on = link.is_some();
            registry.relink(link)?;
            on
        }
        Err(e) if cfg.transport == TransportChoice::Shm => return Err(e),
        Err(e) => {
            tracing::debug!(error = %e, "same-host transport not available; using QUIC");
            return registry.relink(None);
        }
    };
    if attached && cfg.local_control {
        session.local = attach_local(session, cfg).await;
    }
    Ok(())
}

/// The same-host control channel, or `None` (requests then go over QUIC) when the server does
/// not offer it or it cannot be bound.
async fn attach_local(session: &Session, cfg: &ClientConfig) -> Option<Arc<local::LocalLink>> {
    let attempt = timed(cfg.request_timeout, async {
        let (mut tx, mut rx) = session.conn.open_bi().await?;
        write_request(&mut tx, &Request::LocalAttach).await?;
        tx.finish()?;
        let offer = match read_response(&session.conn, &mut rx).await? {
            Response::LocalOffer(o) => o,
            other => return Err(unexpected("LocalOffer", &other)),
        };
        local::LocalLink::open(offer).await
    });
    match attempt.await {
        Ok(link) => Some(Arc::new(link)),
        Err(e) if local::not_offered(&e) => None,
        Err(e) => {
            tracing::warn!(error = %e, "same-host control channel not available; requests go over QUIC");
            None
        }
    }
}

async fn timed<T>(limit: Duration, fut: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(limit, fut).await.map_err(|_| ClientError::Timeout(limit))?
}

fn unexpected(want: &str, got: &Response) -> ClientError {
    let name = format!("{got:?}");
    let name = name.split(['(', ' ', '{']).next().unwrap_or("?").to_string();
    ClientError::Protocol(format!("expected a {want} response, got {name}"))
}

async fn write_request(tx: &mut SendStream, req: &Request) -> Result<()> {
    let frame = frame::encode_frame(req)?;
    tx.write_all(&frame).await?;
    Ok(())
}

/// Read the response frame; a typed error becomes `ClientError::Status`. When the stream broke
/// because the whole connection went away, report the connection's reason instead.
async fn read_response(conn: &quinn::Connection, rx: &mut RecvStream) -> Result<Response> {
    match frame::read_message::<_, Response>(rx, CLIENT_MAX_FRAME).await {
        Ok(Response::Error(body)) => Err(ClientError::Status { code: body.code, message: body.message }),
        Ok(r) => Ok(r),
        Err(e) => match conn.close_reason() {
            Some(reason) => Err(reason.into()),
            None => Err(e.into()),
        },
    }
}

/// After the last declared byte the server must finish the stream.
async fn expect_end(rx: &mut RecvStream) -> Result<()> {
    let mut probe = [0u8; 1];
    match rx.read(&mut probe).await? {
        None => Ok(()),
        Some(_) => Err(ClientError::Protocol("bytes after the last declared value".into())),
    }
}

fn key_text(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(s) if !s.chars().any(char::is_control) => s.to_string(),
        _ => format!("0x{}", hex::encode(key)),
    }
}

impl Client {
    /// Connect, verify the server certificate, and say hello with the API key.
    pub async fn connect(cfg: ClientConfig) -> Result<Client> {
        let addr = resolve(&cfg.server).await?;
        let (endpoint, bufs) = client_endpoint(&addr, &cfg.quic)?;
        let quic = quic_config(&cfg, &addr, &bufs)?;
        let mut session = establish(&endpoint, &quic, addr, &cfg).await?;
        let registry = Arc::new(shm::Registry::default());
        attach_shm(&mut session, &cfg, addr, &registry).await?;
        Ok(Client {
            inner: Arc::new(Inner {
                cfg,
                addr,
                endpoint,
                quic,
                session: RwLock::new(session),
                reconnect: tokio::sync::Mutex::new(()),
                nonce: AtomicU64::new(1),
                registry,
                staging: shm::Staging::default(),
            }),
        })
    }

    fn current(&self) -> Session {
        self.inner.session.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The tenant the API key is bound to.
    pub fn tenant(&self) -> String {
        self.current().hello.tenant
    }

    pub fn is_admin(&self) -> bool {
        self.current().hello.admin
    }

    /// Limits announced by the server; requests beyond them fail locally with `LimitExceeded`.
    pub fn limits(&self) -> Limits {
        self.current().hello.limits
    }

    /// The server's hello answer (version, server identification, tenant, limits).
    pub fn hello(&self) -> HelloOk {
        self.current().hello
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// Whether `other` is a clone of this client (the same connection).
    pub(crate) fn same_connection(&self, other: &Client) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// What the QUIC path of the current connection looks like: MTU reached, losses,
    /// congestion events, black holes.
    pub fn path_report(&self) -> PathReport {
        PathReport::of(&self.current().conn)
    }

    /// Close the connection politely and wait briefly for the close to reach the server.
    pub async fn close(&self) {
        self.current().conn.close(kvpool_proto::close::OK.into(), b"bye");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }

    /// A live session; a connection that died (server restart, idle timeout) is re-established
    /// once, with a new hello, before the next request.
    async fn session(&self) -> Result<Session> {
        let s = self.current();
        if s.conn.close_reason().is_none() {
            return Ok(s);
        }
        let _guard = self.inner.reconnect.lock().await;
        let s = self.current();
        if s.conn.close_reason().is_none() {
            return Ok(s);
        }
        tracing::info!(server = %self.inner.cfg.server, "connection lost, reconnecting");
        let mut fresh = establish(&self.inner.endpoint, &self.inner.quic, self.inner.addr, &self.inner.cfg).await?;
        attach_shm(&mut fresh, &self.inner.cfg, self.inner.addr, &self.inner.registry).await?;
        *self.inner.session.write().unwrap_or_else(|p| p.into_inner()) = fresh.clone();
        Ok(fresh)
    }

    async fn open(&self) -> Result<(quinn::Connection, SendStream, RecvStream)> {
        let s = self.session().await?;
        let (tx, rx) = s.conn.open_bi().await?;
        Ok((s.conn, tx, rx))
    }

    async fn timed<T>(&self, fut: impl Future<Output = Result<T>>) -> Result<T> {
        timed(self.inner.cfg.request_timeout, fut).await
    }

    /// One request without bulk bytes either way.
    async fn call(&self, req: Request) -> Result<Response> {
        let frame = self.encode_checked(&req)?;
        self.timed(async {
            let s = self.session().await?;
            if let Some(link) = s.local.as_ref().filter(|l| l.usable() && l.fits(frame.len())) {
                if let Some(resp) = link.call(&frame).await? {
                    return Ok(resp);
                }
            }
            let (conn, mut tx, mut rx) = self.open().await?;
            tx.write_all(&frame).await?;
            tx.finish()?;
            let resp = read_response(&conn, &mut rx).await?;
            expect_end(&mut rx).await?;
            Ok(resp)
        })
        .await
    }

    fn encode_checked(&self, req: &Request) -> Result<Vec<u8>> {
        let frame = frame::encode_frame(req)?;
        let max = self.limits().max_frame;
        let body = (frame.len() - 4) as u64;
        if body > max as u64 {
            return Err(ClientError::LimitExceeded {
                code: ErrorCode::FrameTooLarge,
                what: "request frame size",
                value: body,
                limit: max as u64,
            });
        }
        Ok(frame)
    }

    fn check_keys<'k>(&self, keys: impl ExactSizeIterator<Item = &'k [u8]>) -> Result<()> {
        let limits = self.limits();
        if keys.len() as u64 > limits.max_batch as u64 {
            return Err(ClientError::LimitExceeded {
                code: ErrorCode::BatchTooLarge,
                what: "batch size",
                value: keys.len() as u64,
                limit: limits.max_batch as u64,
            });
        }
        for k in keys {
            if k.len() as u64 > limits.max_key_len as u64 {
                return Err(ClientError::LimitExceeded {
                    code: ErrorCode::KeyTooLong,
                    what: "key length",
                    value: k.len() as u64,
                    limit: limits.max_key_len as u64,
                });
            }
        }
        Ok(())
    }

    // ---- put ----------------------------------------------------------------------------

    /// Insert one block. An existing key fails with `AlreadyExists` and keeps its value.
    pub async fn put(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.put_one(key.as_ref(), value, PutOptions::default(), PutMode::Insert).await
    }

    /// Insert one block with chain metadata and pinning.
    pub async fn put_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Insert).await
    }

    /// Insert or replace one block (fails with `Leased` while the old value is being read).
    pub async fn upsert(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.put_one(key.as_ref(), value, PutOptions::default(), PutMode::Upsert).await
    }

    /// Insert or replace one block, with metadata.
    pub async fn upsert_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Upsert).await
    }

    async fn put_one(&self, key: &[u8], value: &[u8], opts: PutOptions, mode: PutMode) -> Result<()> {
        let st = self.put_batch(&[PutEntry { key, value, opts }], mode).await?;
        match st[0] {
            ErrorCode::Ok => Ok(()),
            code => Err(ClientError::status(code, format!("put of key {}", key_text(key)))),
        }
    }

    /// Check put items against the server's limits and build their wire form.
    fn put_items<'k>(
        &self,
        entries: impl ExactSizeIterator<Item = (&'k [u8], u64, &'k PutOptions)> + Clone,
    ) -> Result<Vec<PutItem>> {
        self.check_keys(entries.clone().map(|(k, _, _)| k))?;
        let limits = self.limits();
        entries
            .map(|(key, size, opts)| {
                if let Some(p) = opts.parent.as_ref().filter(|p| p.len() as u64 > limits.max_key_len as u64) {
                    return Err(ClientError::LimitExceeded {
                        code: ErrorCode::KeyTooLong,
                        what: "parent key length",
                        value: p.len() as u64,
                        limit: limits.max_key_len as u64,
                    });
                }
                if size > limits.max_value_size {
                    return Err(ClientError::LimitExceeded {
                        code: ErrorCode::ValueTooLarge,
                        what: "value size",
                        value: size,
                        limit: limits.max_value_size,
                    });
                }
                Ok(PutItem {
                    key: key.to_vec(),
                    size,
                    parent: opts.parent.clone(),
                    tokens: opts.tokens,
                    seq_tokens: opts.seq_tokens,
                    pin: opts.pin,
                })
            })
            .collect()
    }

    /// Put many blocks on one stream; one status per entry, in order (`Ok`, `AlreadyExists`,
    /// `Rejected`, `NoSpace`, `Leased`, ...). A request-level failure is an `Err`.
    /// On a same-host connection the values are staged through shared buffers (one copy here,
    /// one in the server), otherwise sent over QUIC.
    pub async fn put_batch(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        if self.inner.registry.linked() {
            return self.put_batch_staged(entries, mode).await;
        }
        self.put_batch_inband(entries, mode).await
    }

    /// Storage nodes (admin key): put blocks of `tenant` into this node, as `put_batch` does
    /// for the caller's own tenant. The values go over QUIC.
    pub async fn node_put(&self, tenant: &str, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let items = self.put_items(entries.iter().map(|e| (e.key, e.value.len() as u64, &e.opts)))?;
        let req = Request::NodePut(kvpool_proto::NodePutRequest { tenant: tenant.to_string(), mode, items });
        self.put_request_inband(req, entries).await
    }

    /// `put_batch` over QUIC: the values follow the request frame on its stream.
    async fn put_batch_inband(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        let items = self.put_items(entries.iter().map(|e| (e.key, e.value.len() as u64, &e.opts)))?;
        self.put_request_inband(Request::Put(PutRequest { mode, items }), entries).await
    }

    /// A put request, then the entries' values, on one QUIC stream.
    async fn put_request_inband(&self, req: Request, entries: &[PutEntry<'_>]) -> Result<Vec<ErrorCode>> {
        let frame = self.encode_checked(&req)?;
        let resp = self
            .timed(async {
                let (conn, mut tx, mut rx) = self.open().await?;
                let sent = async {
                    tx.write_all(&frame).await?;
                    for e in entries {
                        tx.write_all(e.value).await?;
                    }
                    tx.finish()?;
                    Ok::<_, ClientError>(())
                }
                .await;
                // If the server refused early and stopped our stream, its typed answer explains why.
                let resp = read_response(&conn, &mut rx).await;
                match (resp, sent) {
                    (Ok(r), Ok(())) => {
                        expect_end(&mut rx).await?;
                        Ok(r)
                    }
                    (Ok(r @ Response::Put(_)), Err(e)) => {
                        Err(ClientError::Protocol(format!("server answered {r:?} but stopped reading the values: {e}")))
                    }
                    (Ok(r), Err(_)) => Ok(r),
                    (Err(e @ ClientError::Status { .. }), _) => Err(e),
                    (Err(_), Err(e)) => Err(e),
                    (Err(e), Ok(())) => Err(e),
                }
            })
            .await?;
        match resp {
            Response::Put(list) if list.results.len() == entries.len() => Ok(list.results),
            Response::Put(list) => Err(ClientError::Protocol(format!(
                "put of {} items answered with {} statuses",
                entries.len(),
                list.results.len()
            ))),
            other => Err(unexpected("Put", &other)),
        }
    }

    // ---- get ----------------------------------------------------------------------------

    /// Read one block; `None` when it is not in the pool. A `Corrupt` answer is an error.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        let mut r = self.get_batch(&[key]).await?;
        let r = r.pop().expect("one item checked by get_batch");
        match r.status {
            ErrorCode::Ok => Ok(r.value),
            ErrorCode::NotFound => Ok(None),
            code => Err(ClientError::status(code, format!("get of key {}", key_text(key)))),
        }
    }

    /// Read many blocks on one stream. Every value is checked against the server's xxh3-64;
    /// a mismatch fails the whole call with `ClientError::Checksum`.
    pub async fn get_batch<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<GetResult>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let max_value = self.limits().max_value_size;
        let frame = self.get_frame(keys)?;
        self.timed(async {
            let (items, mut rx) = self.get_open(&frame, keys.len()).await?;
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let mut value = None;
                if item.status == ErrorCode::Ok {
                    if item.size > max_value {
                        return Err(ClientError::Protocol(format!(
                            "server announced a value of {} bytes, above its own limit of {max_value}",
                            item.size
                        )));
                    }
                    let mut buf = vec![0u8; item.size as usize];
                    read_verified(&mut rx, keys[i].as_ref(), item.checksum, &mut buf).await?;
                    value = Some(buf);
                }
                out.push(GetResult { status: item.status, value, tier: item.tier, lease_ms: item.lease_ms });
            }
            expect_end(&mut rx).await?;
            Ok(out)
        })
        .await
    }

    /// Read one block into `buf`; `Some(len)` when found, `None` when not in the pool. A value
    /// larger than `buf` fails with `ValueTooLarge`.
    pub async fn get_into(&self, key: impl AsRef<[u8]>, buf: &mut [u8]) -> Result<Option<usize>> {
        let key = key.as_ref();
        let have = buf.len();
        let r = self.get_batch_into(&[key], &mut [buf]).await?[0];
        match r.status {
            ErrorCode::Ok => Ok(Some(r.size as usize)),
            ErrorCode::NotFound => Ok(None),
            ErrorCode::ValueTooLarge => Err(ClientError::status(
                ErrorCode::ValueTooLarge,
                format!("value of key {} has {} bytes, the buffer only {have}", key_text(key), r.size),
            )),
            code => Err(ClientError::status(code, format!("get of key {}", key_text(key)))),
        }
    }

    /// Read many blocks straight into caller buffers (`bufs[i]` for `keys[i]`), the way a
    /// connector fills registered memory. Checksums are verified as for `get_batch`.
    pub async fn get_batch_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetIntoResult>> {
        if keys.len() != bufs.len() {
            return Err(ClientError::Config(format!("{} keys but {} buffers", keys.len(), bufs.len())));
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.inner.registry.linked() {
            return self.get_batch_into_staged(keys, bufs).await;
        }
        self.get_batch_into_inband(keys, bufs).await
    }

    /// `get_batch_into` over QUIC: values come back on the request's stream.
    async fn get_batch_into_inband<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetIntoResult>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let frame = self.get_frame(keys)?;
        self.timed(async {
            let (items, mut rx) = self.get_open(&frame, keys.len()).await?;
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let buf: &mut [u8] = bufs[i];
                let mut status = item.status;
                if status == ErrorCode::Ok {
                    if item.size > buf.len() as u64 {
                        discard(&mut rx, item.size).await?;
                        status = ErrorCode::ValueTooLarge;
                    } else {
                        let dst = &mut buf[..item.size as usize];
                        read_verified(&mut rx, keys[i].as_ref(), item.checksum, dst).await?;
                    }
                }
                out.push(GetIntoResult { status, size: item.size, tier: item.tier, lease_ms: item.lease_ms });
            }
            expect_end(&mut rx).await?;
            Ok(out)
        })
        .await
    }

    fn get_frame<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<u8>> {
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        self.encode_checked(&Request::Get(KeysRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect() }))
    }

    /// Send a Get frame; return the item headers with the stream positioned at the first value.
    async fn get_open(&self, frame: &[u8], n: usize) -> Result<(Vec<kvpool_proto::GetItem>, RecvStream)> {
        let (conn, mut tx, mut rx) = self.open().await?;
        tx.write_all(frame).await?;
        tx.finish()?;
        match read_response(&conn, &mut rx).await? {
            Response::Get(g) if g.items.len() == n => Ok((g.items, rx)),
            Response::Get(g) => {
                Err(ClientError::Protocol(format!("get of {n} keys answered with {} items", g.items.len())))
            }
            other => Err(unexpected("Get", &other)),
        }
    }

    // ---- queries and removal ------------------------------------------------------------

    /// Number of leading blocks of `chain` (root first) that are resident. Does not lease or
    /// touch recency.
    pub async fn lookup<K: AsRef<[u8]>>(&self, chain: &[K]) -> Result<usize> {
        if chain.is_empty() {
            return Ok(0);
        }
        self.check_keys(chain.iter().map(|k| k.as_ref()))?;
        let req = Request::Lookup(LookupRequest { chain: chain.iter().map(|k| k.as_ref().to_vec()).collect() });
        match self.call(req).await? {
            Response::Lookup(l) if (l.resident as usize) <= chain.len() => Ok(l.resident as usize),
            Response::Lookup(l) => {
                Err(ClientError::Protocol(format!("lookup of {} keys answered {} resident", chain.len(), l.resident)))
            }
            other => Err(unexpected("Lookup", &other)),
        }
    }

    /// Presence of each key; does not lease or touch recency.
    pub async fn exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        let req = Request::Exists(KeysRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect() });
        match self.call(req).await? {
            Response::Exists(e) if e.present.len() == keys.len() => Ok(e.present),
            Response::Exists(e) => {
                Err(ClientError::Protocol(format!("exists of {} keys answered {} flags", keys.len(), e.present.len())))
            }
            other => Err(unexpected("Exists", &other)),
        }
    }

    /// Remove one block: `NotFound` and `Leased` (without `force`) are errors.
    pub async fn remove(&self, key: impl AsRef<[u8]>, force: bool) -> Result<()> {
        let key = key.as_ref();
        match self.remove_batch(&[key], force).await?[0] {
            ErrorCode::Ok => Ok(()),
            code => Err(ClientError::status(code, format!("remove of key {}", key_text(key)))),
        }
    }

    /// Remove many blocks; one status per key (`Ok`, `NotFound`, `Leased`).
    pub async fn remove_batch<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<ErrorCode>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        let req = Request::Remove(RemoveRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect(), force });
        match self.call(req).await? {
            Response::Remove(l) if l.results.len() == keys.len() => Ok(l.results),
            Response::Remove(l) => Err(ClientError::Protocol(format!(
                "remove of {} keys answered {} statuses",
                keys.len(),
                l.results.len()
            ))),
            other => Err(unexpected("Remove", &other)),
        }
    }

    /// Remove every block of this tenant (leased ones only with `force`).
    pub async fn remove_all(&self, force: bool) -> Result<RemoveAllResponse> {
        match self.call(Request::RemoveAll(RemoveAllRequest { force })).await? {
            Response::RemoveAll(r) => Ok(r),
            other => Err(unexpected("RemoveAll", &other)),
        }
    }

    pub async fn stats(&self) -> Result<StatsReport> {
        match self.call(Request::Stats).await? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected("Stats", &other)),
        }
    }

    /// Round-trip time of one request on its own stream.
    pub async fn ping(&self) -> Result<Duration> {
        let nonce = self.inner.nonce.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        match self.call(Request::Ping(Ping { nonce })).await? {
            Response::Pong(p) if p.nonce == nonce => Ok(start.elapsed()),
            Response::Pong(p) => Err(ClientError::Protocol(format!("pong carries nonce {}, sent {nonce}", p.nonce))),
            other => Err(unexpected("Pong", &other)),
        }
    }
}

/// Read exactly `dst.len()` value bytes and check them against `expected`, hashing each piece
/// as it lands (while it is still in cache) rather than in a second pass over the value.
async fn read_verified(rx: &mut RecvStream, key: &[u8], expected: u64, dst: &mut [u8]) -> Result<()> {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    let mut filled = 0;
    while filled < dst.len() {
        // Pieces small enough to be hashed from L2.
        let end = dst.len().min(filled + (128 << 10));
        match rx.read(&mut dst[filled..end]).await? {
            Some(n) => {
                h.update(&dst[filled..filled + n]);
                filled += n;
            }
            None => {
                return Err(ClientError::Protocol(format!(
                    "stream ended early, {} bytes short of a declared value size",
                    dst.len() - filled
                )))
            }
        }
    }
    let actual = h.digest();
    if actual != expected {
        return Err(ClientError::Checksum { key: key_text(key), expected, actual });
    }
    Ok(())
}

fn verify(key: &[u8], expected: u64, bytes: &[u8]) -> Result<()> {
    let actual = xxhash_rust::xxh3::xxh3_64(bytes);
    if actual != expected {
        return Err(ClientError::Checksum { key: key_text(key), expected, actual });
    }
    Ok(())
}

async fn discard(rx: &mut RecvStream, mut n: u64) -> Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    while n > 0 {
        let take = n.min(scratch.len() as u64) as usize;
        rx.read_exact(&mut scratch[..take]).await?;
        n -= take as u64;
    }
    Ok(())
}
