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
mod bulk;
mod cluster;
mod config;
mod connect;
mod connector;
mod error;
mod events;
mod get;
mod local;
mod nodes;
mod onesided;
mod put;
mod shm;
#[cfg(feature = "test-hooks")]
mod testing;
pub mod tls;

pub use cluster::{ClusterClient, ServerRole};
pub use config::{parse_fingerprint, read_key_file, BulkChoice, ClientConfig, EndpointInfo, TransportChoice, Trust};
pub use connector::LookupLease;
pub use error::{ClientError, Result};
pub use events::{SubscribeOptions, Subscription};
pub use kvpool_net::{udp_stats, PathReport, QuicTuning, Segmentation, UdpStats};
pub use kvpool_proto as proto;
pub use kvpool_proto::{
    ErrorCode, HelloOk, Limits, OpStats, PinSpec, PutMode, RemoveAllResponse, StatsReport, TierStats,
};
pub use onesided::{Grant, Located, LocatedBlock};
pub use put::{PutEntry, PutOptions};
pub use shm::{BufSlice, Buffer};
#[cfg(feature = "test-hooks")]
pub use testing::{parse_reply, RawConnection};

use connect::{attach_shm, client_endpoint, establish, quic_config, resolve};
use kvpool_proto::{
    frame, KeysRequest, LookupRequest, Ping, RemoveAllRequest, RemoveRequest, Request, Response, CLIENT_MAX_FRAME,
};
use quinn::{RecvStream, SendStream};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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
    /// The TCP bulk channel of this connection, when the configuration asks for it.
    bulk: Option<Arc<bulk::BulkLink>>,
    /// Closes the connection when the server's port answers unreachable; ends with the session.
    refusal_watch: Option<Arc<connect::WatchTask>>,
}

struct Inner {
    cfg: ClientConfig,
    addr: SocketAddr,
    endpoint: quinn::Endpoint,
    /// ICMP port unreachable seen on the endpoint's socket (the server's process is gone).
    refusals: kvpool_net::Refusals,
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

/// A connection to a kvpool pool: a server that holds blocks, or a cluster master (found out
/// at connect, [`Client::role`]), through which block calls go to the storage nodes
/// ([`ClusterClient`]'s logic). Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    /// Set when the server is a cluster master: block calls go through it.
    cluster: Option<ClusterClient>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.inner.cfg.server)
            .field("tenant", &self.tenant())
            .field("cluster", &self.cluster.is_some())
            .finish()
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
    /// Connect, verify the server certificate, say hello with the API key, and ask the server
    /// what it is (one round trip more): on a cluster master, block calls are routed through
    /// it to the storage nodes.
    pub async fn connect(cfg: ClientConfig) -> Result<Client> {
        // A master offers no shared memory (its nodes may): asked for shm, find out what the
        // server is first.
        let mut first = cfg.clone();
        if cfg.transport == TransportChoice::Shm {
            first.transport = TransportChoice::Auto;
        }
        let c = Client::connect_direct(first).await?;
        match c.role().await? {
            ServerRole::Server if cfg.transport == TransportChoice::Shm && c.transport_in_use() != "shm" => {
                // Again as asked, for the reason shm is refused.
                c.close().await;
                Client::connect_direct(cfg).await
            }
            ServerRole::Server => Ok(c),
            ServerRole::Master => {
                Ok(Client { inner: c.inner.clone(), cluster: Some(ClusterClient::from_master_as(c, cfg)) })
            }
        }
    }

    /// Connect to the cluster whose leading master etcd names (see
    /// [`ClusterClient::connect_etcd`]); block calls are routed through it.
    pub async fn connect_etcd(endpoints: &str, prefix: &str, template: ClientConfig) -> Result<Client> {
        let cc = ClusterClient::connect_etcd(endpoints, prefix, template).await?;
        Ok(Client { inner: cc.master().inner, cluster: Some(cc) })
    }

    /// The cluster block calls go through, when the server is a master.
    pub fn cluster(&self) -> Option<&ClusterClient> {
        self.cluster.as_ref()
    }

    /// Whether block calls go through a cluster master.
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Where requests that are not about blocks go: this server, or on a cluster the master
    /// (with etcd, the current leader).
    fn control(&self) -> std::borrow::Cow<'_, Client> {
        match &self.cluster {
            Some(cc) => std::borrow::Cow::Owned(cc.master()),
            None => std::borrow::Cow::Borrowed(self),
        }
    }

    /// Connect as [`Client::connect`] does, without asking the server's role: every call goes
    /// to this server as it is (a master then refuses block calls with `unsupported`). For
    /// storage nodes and cluster clients, which know what they talk to.
    pub async fn connect_direct(cfg: ClientConfig) -> Result<Client> {
        let addr = resolve(&cfg.server).await?;
        let (endpoint, bufs, refusals) = client_endpoint(&addr, &cfg.quic)?;
        let quic = quic_config(&cfg, &addr, &bufs)?;
        let mut session = establish(&endpoint, &refusals, &quic, addr, &cfg).await?;
        let registry = Arc::new(shm::Registry::default());
        attach_shm(&mut session, &cfg, addr, &registry).await?;
        session.bulk = bulk::BulkLink::for_server(&cfg, addr, session.hello.version)?;
        Ok(Client {
            inner: Arc::new(Inner {
                cfg,
                addr,
                endpoint,
                refusals,
                quic,
                session: RwLock::new(session),
                reconnect: tokio::sync::Mutex::new(()),
                nonce: AtomicU64::new(1),
                registry,
                staging: shm::Staging::default(),
            }),
            cluster: None,
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
        let i = &self.inner;
        let mut fresh = establish(&i.endpoint, &i.refusals, &i.quic, i.addr, &i.cfg).await?;
        attach_shm(&mut fresh, &self.inner.cfg, self.inner.addr, &self.inner.registry).await?;
        fresh.bulk = bulk::BulkLink::for_server(&self.inner.cfg, self.inner.addr, fresh.hello.version)?;
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

    /// A bulk connection when this call should take the channel (`bytes` of values to put,
    /// `u64::MAX` for a get); `None`: it goes over QUIC. Give it back with `BulkLink::keep`.
    async fn bulk_conn(&self, bytes: u64) -> Option<(Arc<bulk::BulkLink>, bulk::BulkConn)> {
        let s = self.session().await.ok()?;
        let link = s.bulk.clone().filter(|l| bytes >= l.min_put)?;
        let c = link.take(&s.conn).await?;
        Some((link, c))
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

    // ---- queries and removal ------------------------------------------------------------

    /// Number of leading blocks of `chain` (root first) that are resident. Does not lease or
    /// touch recency.
    pub async fn lookup<K: AsRef<[u8]>>(&self, chain: &[K]) -> Result<usize> {
        if let Some(cc) = &self.cluster {
            return cc.lookup(chain).await;
        }
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
        if let Some(cc) = &self.cluster {
            return cc.exists(keys).await;
        }
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
        if let Some(cc) = &self.cluster {
            return cc.remove_batch(keys, force).await;
        }
        self.remove_batch_direct(keys, force).await
    }

    /// [`Client::remove_batch`] on this server itself.
    pub(crate) async fn remove_batch_direct<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<ErrorCode>> {
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

    /// Remove every block of this tenant (leased ones only with `force`; on a cluster: on every
    /// live storage node, summed).
    pub async fn remove_all(&self, force: bool) -> Result<RemoveAllResponse> {
        if let Some(cc) = &self.cluster {
            return cc.remove_all(force).await;
        }
        self.remove_all_direct(force).await
    }

    /// [`Client::remove_all`] on this server itself.
    pub(crate) async fn remove_all_direct(&self, force: bool) -> Result<RemoveAllResponse> {
        match self.call(Request::RemoveAll(RemoveAllRequest { force })).await? {
            Response::RemoveAll(r) => Ok(r),
            other => Err(unexpected("RemoveAll", &other)),
        }
    }

    /// The server's statistics (on a cluster: the master's, which holds no blocks; per node
    /// statistics come from [`ClusterClient::stats`]).
    pub async fn stats(&self) -> Result<StatsReport> {
        match self.control().call(Request::Stats).await? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected("Stats", &other)),
        }
    }

    /// Round-trip time of one request on its own stream.
    pub async fn ping(&self) -> Result<Duration> {
        let c = self.control();
        let nonce = c.inner.nonce.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        match c.call(Request::Ping(Ping { nonce })).await? {
            Response::Pong(p) if p.nonce == nonce => Ok(start.elapsed()),
            Response::Pong(p) => Err(ClientError::Protocol(format!("pong carries nonce {}, sent {nonce}", p.nonce))),
            other => Err(unexpected("Pong", &other)),
        }
    }
}
