//! The request service: hello/auth on a connection's first stream, then one request per stream.
//!
//! A request is exactly one frame, the value bytes it declares (put, policy load), then the end of
//! the stream. Every wait on the client has a deadline ([`Timeouts`]): a stalled or slow client
//! is answered `timeout`, its stream is stopped, and everything the request held (DRAM
//! reservations, leased blocks) is released when the handler returns. A client that resets its
//! stream or loses its connection cancels the request quietly.
//!
//! The handler is generic over the two halves of a stream ([`RequestRecv`], [`RequestSend`]), so
//! the in-tree fuzz driver and unit tests run it in memory with no QUIC.

use crate::auth::{Auth, Principal};
use crate::metrics::Metrics;
use crate::store::{DramBlock, GetPlan, PutPlan, Served, Store};
use kvpool_proto::frame::{encode_frame, read_frame};
use kvpool_proto::{
    close, codec, message_tag, ErrorBody, ErrorCode, ExistsResponse, GetItem, GetResponse, HelloOk, Limits,
    LookupResponse, OpStats, PolicyListResponse, Pong, ProtoError, PutRequest, RemoveAllResponse, Request, Response,
    StatsReport, StatusList, TierStats, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, REQUEST_TAGS,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant as Deadline;
use tracing::{debug, info, warn, Instrument};

mod cluster;
mod connector;
pub mod local;
pub mod memory;
mod session;
mod subscribe;
#[cfg(test)]
mod tests;
mod v2;

pub use session::Session;
pub use v2::DataPath;

/// A boxed future that can move between threads.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The receiving half of a request stream.
pub trait RequestRecv: AsyncRead + Unpin + Send {
    /// Stop reading: the peer's further writes fail (QUIC STOP_SENDING with `code`).
    fn stop(&mut self, code: u32);
    /// What carries the stream, for the transfer metrics.
    fn transport(&self) -> &'static str;
}

/// The sending half of a request stream.
pub trait RequestSend: AsyncWrite + Unpin + Send {
    /// Send bytes the stream may keep (QUIC sends them from where they are, without a copy).
    fn write_owned(&mut self, bytes: bytes::Bytes) -> BoxFuture<'_, std::io::Result<()>>;
    /// End the response (QUIC FIN).
    fn finish(&mut self);
    /// Abandon the response; bytes not yet delivered are dropped (QUIC RESET_STREAM).
    fn reset(&mut self, code: u32);
    /// What carries the stream, for the transfer metrics.
    fn transport(&self) -> &'static str;
    /// Resolves when the peer no longer wants the response (QUIC STOP_SENDING, or the
    /// connection is gone); a long-lived response (a subscription) waits on it between writes.
    fn stopped(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::pending())
    }
}

impl RequestRecv for quinn::RecvStream {
    fn stop(&mut self, code: u32) {
        let _ = quinn::RecvStream::stop(self, code.into());
    }
    fn transport(&self) -> &'static str {
        "quic"
    }
}

impl RequestSend for quinn::SendStream {
    fn write_owned(&mut self, bytes: bytes::Bytes) -> BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move { self.write_chunk(bytes).await.map_err(std::io::Error::from) })
    }
    fn finish(&mut self) {
        let _ = quinn::SendStream::finish(self);
    }
    fn reset(&mut self, code: u32) {
        let _ = quinn::SendStream::reset(self, code.into());
    }
    fn transport(&self) -> &'static str {
        "quic"
    }
    fn stopped(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = quinn::SendStream::stopped(self).await;
        })
    }
}

/// How long the server waits on a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From stream open to the whole request frame (and, for requests without value bytes, its
    /// end of stream); also the fixed part of every transfer deadline.
    pub request: Duration,
    /// Slowest transfer waited for, bytes per second.
    pub min_rate: u64,
}

impl Timeouts {
    /// Time allowed to move `bytes` of values (either way), on top of the request time.
    pub fn transfer(&self, bytes: u64) -> Duration {
        self.request + Duration::from_secs_f64(bytes as f64 / self.min_rate.max(1) as f64)
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { request: Duration::from_secs(10), min_rate: 8 << 20 }
    }
}

pub struct Shared {
    pub store: Arc<Store>,
    pub auth: Auth,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub timeouts: Timeouts,
    pub server_name: String,
    pub started: Instant,
    pub max_connections: u32,
    pub policies: Arc<crate::policy::PolicyManager>,
    pub max_module_size: u64,
    pub paths: parking_lot::Mutex<PathTally>,
    /// The copy engine and shm socket for same-host clients (version 2).
    pub data_path: Option<DataPath>,
    /// The KV event log subscriptions read (`None`: events are off).
    pub events: Option<Arc<crate::events::EventLog>>,
    /// This node's name, as KV events give it.
    pub node: String,
    /// The master's view of the cluster (`cluster.role = "master"` only).
    pub master: Option<Arc<crate::cluster::Master>>,
}

impl Shared {
    /// The Prometheus text of `/metrics`, with gauges brought up to date.
    pub fn render_metrics(&self) -> String {
        self.store.update_gauges();
        if let Some(m) = &self.master {
            let nodes = m.nodes().nodes;
            let live = nodes.iter().filter(|n| n.live).count() as i64;
            self.metrics.cluster_nodes.with_label_values(&["live"]).set(live);
            self.metrics.cluster_nodes.with_label_values(&["dead"]).set(nodes.len() as i64 - live);
            for n in &nodes {
                self.metrics.cluster_node_copies.with_label_values(&[&n.name]).set(n.copies as i64);
                for t in &n.tiers {
                    let tier = match t.tier {
                        0 => "device",
                        1 => "dram",
                        _ => "ssd",
                    };
                    let g = &self.metrics.cluster_node_bytes;
                    g.with_label_values(&[&n.name, tier, "used"]).set(t.used as i64);
                    g.with_label_values(&[&n.name, tier, "capacity"]).set(t.capacity as i64);
                }
            }
        }
        self.policies.export_metrics(&self.metrics);
        let (t, mtu) = self.paths.lock().totals();
        self.metrics.set_path_stats(&t, mtu);
        self.metrics.render()
    }
}

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>, configs: Arc<crate::QuicServerConfigs>) {
    while let Some(incoming) = endpoint.accept().await {
        if shared.metrics.connections.get() >= shared.max_connections as i64 {
            warn!("connection limit reached; refusing");
            incoming.refuse();
            continue;
        }
        let shared = shared.clone();
        let remote = incoming.remote_address();
        let config = configs.for_peer(remote.ip());
        tokio::spawn(
            async move {
                let connecting = match incoming.accept_with(config) {
                    Ok(c) => c,
                    Err(e) => return debug!(error = %e, "connection refused"),
                };
                if let Err(e) = handle_connection(connecting, shared).await {
                    debug!(error = %e, "connection ended");
                }
            }
            .instrument(tracing::info_span!("conn", %remote)),
        );
    }
}

/// QUIC path statistics of every connection, live and closed, for `/metrics`.
#[derive(Default)]
pub struct PathTally {
    live: std::collections::HashMap<u64, quinn::Connection>,
    next: u64,
    closed: kvpool_net::PathReport,
}

impl PathTally {
    /// Totals over all connections so far, and the (min, max) path MTU of the live ones.
    pub fn totals(&self) -> (kvpool_net::PathReport, Option<(u16, u16)>) {
        let mut t = self.closed;
        let mut mtu: Option<(u16, u16)> = None;
        for c in self.live.values() {
            let r = kvpool_net::PathReport::of(c);
            t.add_counters(&r);
            mtu = Some(mtu.map_or((r.mtu, r.mtu), |(lo, hi)| (lo.min(r.mtu), hi.max(r.mtu))));
        }
        (t, mtu)
    }
}

/// Counts a connection while it lives and folds its path statistics into the totals at the end.
struct ConnGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl ConnGuard {
    fn new(shared: Arc<Shared>, conn: &quinn::Connection) -> ConnGuard {
        shared.metrics.connections.inc();
        let mut t = shared.paths.lock();
        let id = t.next;
        t.next += 1;
        t.live.insert(id, conn.clone());
        drop(t);
        ConnGuard { shared, id }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.metrics.connections.dec();
        let mut t = self.shared.paths.lock();
        if let Some(c) = t.live.remove(&self.id) {
            let r = kvpool_net::PathReport::of(&c);
            t.closed.add_counters(&r);
        }
    }
}

async fn handle_connection(connecting: quinn::Connecting, shared: Arc<Shared>) -> Result<(), quinn::ConnectionError> {
    let conn = connecting.await?;
    let _guard = ConnGuard::new(shared.clone(), &conn);
    let session = match tokio::time::timeout(HELLO_TIMEOUT, hello(&conn, &shared)).await {
        Ok(Some((p, version))) => Session::new(p, version, Some(conn.remote_address().ip())),
        Ok(None) => return Ok(()),
        Err(_) => {
            conn.close(close::UNAUTHORIZED.into(), b"no hello in time");
            return Ok(());
        }
    };
    debug!(tenant = %session.principal.tenant, version = session.version, "authenticated");
    // However the loop ends, what the connection lent out ends with it.
    struct Ending(Arc<Session>);
    impl Drop for Ending {
        fn drop(&mut self) {
            self.0.end();
        }
    }
    let _ending = Ending(session.clone());
    loop {
        let (mut send, mut recv) = conn.accept_bi().await?;
        let (session, s) = (session.clone(), shared.clone());
        let mut request = Box::pin(async move { handle_stream(&mut recv, &mut send, &session, &s).await });
        // A small request (a lookup, a stats) is usually whole on arrival and answered in one
        // poll: run that poll here and spare a task spawn and the wake-up of another worker.
        // Anything that has to wait goes on as a task of its own.
        let first = std::future::poll_fn(|cx| {
            let poll = std::panic::AssertUnwindSafe(|| std::future::Future::poll(request.as_mut(), cx));
            std::task::Poll::Ready(std::panic::catch_unwind(poll))
        })
        .await;
        match first {
            Ok(std::task::Poll::Pending) => {
                tokio::spawn(request);
            }
            Ok(std::task::Poll::Ready(())) => {}
            // As a spawned request's panic ends its task only: the connection serves on.
            Err(_) => warn!("a request handler panicked; the request is dropped"),
        }
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody { code, message: message.into() }
}

/// Why a request ended without its normal answer.
#[derive(Debug)]
enum Fail {
    /// Answer this typed error, then stop reading the stream.
    Reply(ErrorBody),
    /// The client reset the stream or the connection went away: nothing to answer.
    Cancelled,
    /// The client did not deliver the request in time: answer `timeout`, stop reading.
    Timeout(String),
    /// The client did not read the response in time: abandon (reset) the stream.
    Stalled,
}

fn malformed(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::Malformed, message))
}

fn read_fail(e: std::io::Error, what: &str) -> Fail {
    match ProtoError::from(e) {
        ProtoError::Truncated => malformed(format!("stream ended before {what}")),
        ProtoError::Cancelled(_) => Fail::Cancelled,
        other => Fail::Reply(error(ErrorCode::Internal, other.to_string())),
    }
}

/// Fill `buf` from the stream by `deadline`.
async fn read_exact_by<R: RequestRecv>(r: &mut R, buf: &mut [u8], deadline: Deadline, what: &str) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, r.read_exact(buf)).await {
        Err(_) => Err(Fail::Timeout(format!("{what} did not arrive in time"))),
        Ok(Err(e)) => Err(read_fail(e, what)),
        Ok(Ok(_)) => Ok(()),
    }
}

/// As [`read_exact_by`], and return the xxh3-64 of the bytes, hashed piece by piece as they
/// land (while they are in cache) rather than in a second pass over the value.
async fn read_hashed_by<R: RequestRecv>(
    r: &mut R,
    buf: &mut [u8],
    deadline: Deadline,
    what: &str,
) -> Result<u64, Fail> {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    let mut filled = 0;
    while filled < buf.len() {
        let end = buf.len().min(filled + (128 << 10));
        match tokio::time::timeout_at(deadline, r.read(&mut buf[filled..end])).await {
            Err(_) => return Err(Fail::Timeout(format!("{what} did not arrive in time"))),
            Ok(Err(e)) => return Err(read_fail(e, what)),
            Ok(Ok(0)) => {
                return Err(read_fail(std::io::Error::from(std::io::ErrorKind::UnexpectedEof), what));
            }
            Ok(Ok(n)) => {
                h.update(&buf[filled..filled + n]);
                filled += n;
            }
        }
    }
    Ok(h.digest())
}

/// Read and drop `n` bytes of a value that will not be stored.
async fn discard<R: RequestRecv>(r: &mut R, mut n: u64, deadline: Deadline) -> Result<(), Fail> {
    let mut buf = [0u8; 16 * 1024];
    while n > 0 {
        let want = n.min(buf.len() as u64) as usize;
        read_exact_by(r, &mut buf[..want], deadline, "the declared value bytes").await?;
        n -= want as u64;
    }
    Ok(())
}

/// The request must end here: anything more is malformed (and nothing of it takes effect).
async fn expect_end<R: RequestRecv>(r: &mut R, deadline: Deadline) -> Result<(), Fail> {
    let mut probe = [0u8; 64];
    match tokio::time::timeout_at(deadline, r.read(&mut probe)).await {
        Err(_) => Err(Fail::Timeout("the request stream was not finished (no FIN) in time".into())),
        Ok(Ok(0)) => Ok(()),
        Ok(Ok(_)) => Err(malformed(
            "bytes after the end of the request: a request is one frame, then exactly the declared value \
             bytes (put, policy load), then the end of the stream",
        )),
        Ok(Err(e)) => Err(read_fail(e, "the end of the stream")),
    }
}

async fn write_owned_by<W: RequestSend>(w: &mut W, bytes: bytes::Bytes, deadline: Deadline) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, w.write_owned(bytes)).await {
        Err(_) => Err(Fail::Stalled),
        Ok(Err(_)) => Err(Fail::Cancelled),
        Ok(Ok(())) => Ok(()),
    }
}

async fn write_by<W: RequestSend>(w: &mut W, bytes: &[u8], deadline: Deadline) -> Result<(), Fail> {
    match tokio::time::timeout_at(deadline, w.write_all(bytes)).await {
        Err(_) => Err(Fail::Stalled),
        // Stopped by the peer or connection lost: the client no longer wants the answer.
        Ok(Err(_)) => Err(Fail::Cancelled),
        Ok(Ok(())) => Ok(()),
    }
}

/// Write one response frame and end the stream.
async fn reply<W: RequestSend>(w: &mut W, resp: &Response, deadline: Deadline) -> Result<(), Fail> {
    let frame = encode_frame(resp).map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    write_by(w, &frame, deadline).await?;
    w.finish();
    Ok(())
}

/// Read and decode a request frame. `Ok(None)`: the stream ended before any byte.
async fn read_request<R: RequestRecv>(r: &mut R, max_frame: u32, deadline: Deadline) -> Result<Option<Request>, Fail> {
    let body = match tokio::time::timeout_at(deadline, read_frame(r, max_frame)).await {
        Err(_) => return Err(Fail::Timeout("no complete request frame in time".into())),
        Ok(Ok(Some(b))) => b,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(ProtoError::Cancelled(_))) => return Err(Fail::Cancelled),
        Ok(Err(e)) => return Err(Fail::Reply(error(e.code(), e.to_string()))),
    };
    match codec::decode::<Request>(&body) {
        Ok(r) => Ok(Some(r)),
        Err(e) => match message_tag(&body) {
            Some(tag) if tag >= REQUEST_TAGS => {
                Err(Fail::Reply(error(ErrorCode::UnknownMessage, format!("unknown request type {tag}"))))
            }
            _ => Err(malformed(e.to_string())),
        },
    }
}

/// End a failed request the way its failure asks; returns the error code counted, if any.
async fn conclude<R: RequestRecv, W: RequestSend>(
    fail: Fail,
    recv: &mut R,
    send: &mut W,
    timeouts: &Timeouts,
) -> Option<ErrorCode> {
    let deadline = Deadline::now() + timeouts.request;
    match fail {
        Fail::Reply(body) => {
            let code = body.code;
            if reply(send, &Response::Error(body), deadline).await.is_err() {
                send.reset(close::TIMEOUT);
            }
            recv.stop(close::PROTOCOL);
            Some(code)
        }
        Fail::Timeout(message) => {
            if reply(send, &Response::Error(error(ErrorCode::Timeout, message)), deadline).await.is_err() {
                send.reset(close::TIMEOUT);
            }
            recv.stop(close::TIMEOUT);
            Some(ErrorCode::Timeout)
        }
        Fail::Stalled => {
            send.reset(close::TIMEOUT);
            recv.stop(close::TIMEOUT);
            Some(ErrorCode::Timeout)
        }
        Fail::Cancelled => {
            send.reset(close::OK);
            recv.stop(close::OK);
            None
        }
    }
}

/// The hello on a connection's first stream: the principal and the negotiated version; `None`
/// when it failed (the connection is closed).
async fn hello(conn: &quinn::Connection, shared: &Shared) -> Option<(Principal, u16)> {
    let (mut send, mut recv) = conn.accept_bi().await.ok()?;
    let start = Instant::now();
    let deadline = Deadline::now() + shared.timeouts.request;
    let outcome = match read_request(&mut recv, shared.limits.max_frame, deadline).await {
        Ok(None) => {
            conn.close(close::PROTOCOL.into(), b"empty hello stream");
            return None;
        }
        Ok(Some(req)) => match expect_end(&mut recv, deadline).await {
            Ok(()) => check_hello(req, shared),
            Err(f) => Err(f),
        },
        Err(f) => Err(f),
    };
    match outcome {
        Ok((p, ok)) => {
            let version = ok.version;
            if reply(&mut send, &Response::Hello(ok), deadline).await.is_err() {
                return None;
            }
            shared.metrics.op_seconds.with_label_values(&["hello"]).observe(start.elapsed().as_secs_f64());
            Some((p, version))
        }
        Err(f) => {
            shared.metrics.auth_failures.inc();
            if let Some(code) = conclude(f, &mut recv, &mut send, &shared.timeouts).await {
                shared.metrics.errors.with_label_values(&[code.name()]).inc();
                // Let the typed answer reach the client before the connection goes.
                let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
            }
            conn.close(close::UNAUTHORIZED.into(), b"hello failed");
            None
        }
    }
}

fn check_hello(req: Request, shared: &Shared) -> Result<(Principal, HelloOk), Fail> {
    let Request::Hello(h) = req else {
        return Err(Fail::Reply(error(ErrorCode::HelloRequired, "the first request of a connection must be a hello")));
    };
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&h.version) {
        let msg = format!(
            "protocol version {} is not supported; this server speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}",
            h.version
        );
        return Err(Fail::Reply(error(ErrorCode::UnsupportedVersion, msg)));
    }
    let Some(p) = shared.auth.check(&h.api_key) else {
        info!(client = %h.client_name, "hello refused: unknown api key");
        return Err(Fail::Reply(error(ErrorCode::Unauthorized, "unknown api key")));
    };
    let ok = HelloOk {
        version: h.version,
        server: shared.server_name.clone(),
        tenant: p.tenant.clone(),
        admin: p.admin,
        limits: shared.limits,
    };
    Ok((p, ok))
}

fn op_name(r: &Request) -> &'static str {
    match r {
        Request::Hello(_) => "hello",
        Request::Put(_) => "put",
        Request::Get(_) => "get",
        Request::Lookup(_) => "lookup",
        Request::Exists(_) => "exists",
        Request::Remove(_) => "remove",
        Request::RemoveAll(_) => "remove_all",
        Request::Stats => "stats",
        Request::Ping(_) => "ping",
        Request::PolicyLoad(_) => "policy_load",
        Request::PolicyList => "policy_list",
        Request::PolicyRollback(_) => "policy_rollback",
        Request::ShmAttach => "shm_attach",
        Request::LocalAttach => "local_attach",
        Request::Subscribe(_) => "subscribe",
        Request::PutIntent(_) => "put_intent",
        Request::PutDone(_) => "put_done",
        Request::GetLocate(_) => "get_locate",
        Request::Release(_) => "release",
        Request::PutFrom(_) => "put_from",
        Request::GetInto(_) => "get_into",
        Request::Write(_) => "write",
        Request::Read(_) => "read",
        Request::NodeJoin(_) => "node_join",
        Request::NodeReport(_) => "node_report",
        Request::Nodes => "nodes",
        Request::Route(_) => "route",
        Request::Place(_) => "place",
        Request::NodePut(_) => "node_put",
        Request::LookupLease(_) => "lookup_lease",
        Request::RemoveMatching(_) => "remove_matching",
    }
}

/// Serve one request stream of an authenticated connection, start to end.
pub async fn handle_stream<R: RequestRecv, W: RequestSend>(
    recv: &mut R,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
) {
    let p = &session.principal;
    let start = Instant::now();
    let deadline = Deadline::now() + s.timeouts.request;
    let (op, result) = match read_request(recv, s.limits.max_frame, deadline).await {
        Ok(None) => return,
        Err(f) => (None, Err(f)),
        Ok(Some(req)) => {
            let op = op_name(&req);
            (Some(op), dispatch(req, recv, send, session, s, deadline).await)
        }
    };
    let failed = match result {
        Ok(()) => None,
        Err(Fail::Cancelled) => {
            // Counted as cancelled: not an error, not a latency sample.
            s.metrics.cancelled.with_label_values(&[op.unwrap_or("unknown")]).inc();
            conclude(Fail::Cancelled, recv, send, &s.timeouts).await;
            return;
        }
        Err(f) => {
            debug!(?f, "request failed");
            conclude(f, recv, send, &s.timeouts).await
        }
    };
    // A client asks `Nodes` at connect to learn whether this is a master: a server's
    // `unsupported` is the expected answer to that probe, not an error to count.
    let failed = failed.filter(|&c| !(op == Some("nodes") && c == ErrorCode::Unsupported));
    if let Some(code) = failed {
        s.metrics.errors.with_label_values(&[code.name()]).inc();
    }
    let Some(op) = op else { return };
    if op == "subscribe" {
        // A subscription lasts as long as its client wants: not a latency sample.
        return;
    }
    let secs = start.elapsed().as_secs_f64();
    s.metrics.op_seconds.with_label_values(&[op]).observe(secs);
    s.metrics.tenant_op_seconds.with_label_values(&[&p.tenant, op]).observe(secs);
    if failed.is_some() {
        s.metrics.op_errors.with_label_values(&[op]).inc();
        s.metrics.tenant_op_errors.with_label_values(&[&p.tenant, op]).inc();
    }
}

fn check_keys<'a>(keys: impl IntoIterator<Item = &'a Vec<u8>>, count: usize, l: &Limits) -> Result<(), Fail> {
    if count > l.max_batch as usize {
        return Err(Fail::Reply(error(
            ErrorCode::BatchTooLarge,
            format!("{count} items; the limit is {}", l.max_batch),
        )));
    }
    for k in keys {
        if k.len() > l.max_key_len as usize {
            return Err(Fail::Reply(error(
                ErrorCode::KeyTooLong,
                format!("key of {} bytes; the limit is {}", k.len(), l.max_key_len),
            )));
        }
        if k.is_empty() {
            return Err(Fail::Reply(error(ErrorCode::InvalidArgument, "empty key")));
        }
    }
    Ok(())
}

async fn dispatch<R: RequestRecv, W: RequestSend>(
    req: Request,
    recv: &mut R,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
    deadline: Deadline,
) -> Result<(), Fail> {
    let p = &session.principal;
    let store = &s.store;
    let t = p.tenant_id;
    // Requests without value bytes must end after their frame; nothing takes effect before the
    // end of the stream is seen.
    if s.master.is_some() && holds_blocks(&req) {
        return Err(Fail::Reply(error(
            ErrorCode::Unsupported,
            "this server is a cluster master and holds no blocks: ask it where blocks are (Route, Place) \
             and move them to and from the storage nodes (kvpool_client::ClusterClient does both)",
        )));
    }
    let resp = match req {
        Request::Hello(_) => return Err(malformed("hello is only valid as the first request of a connection")),
        c
        @ (Request::NodeJoin(_) | Request::NodeReport(_) | Request::Nodes | Request::Route(_) | Request::Place(_)) => {
            cluster::dispatch(c, recv, session, s, deadline).await?
        }
        Request::Put(put) => {
            let list = put_items(put, recv, p, s).await?;
            Response::Put(list)
        }
        Request::NodePut(np) => {
            // Another storage node hands over blocks it evicts (into this node's free DRAM):
            // a put on behalf of their tenant, allowed to the cluster's admin keys only.
            if session.version < 2 {
                return Err(Fail::Reply(error(ErrorCode::Unsupported, "this request needs a version 2 hello")));
            }
            if !p.admin {
                return Err(Fail::Reply(error(ErrorCode::Forbidden, "node puts need an admin api key")));
            }
            // Only a tenant this node has a key for: the cluster's nodes share their keys, and
            // a node put must not conjure up a tenant nobody can read.
            let Some(tenant_id) = s.auth.tenant_id_of(&np.tenant) else {
                return Err(Fail::Reply(error(
                    ErrorCode::InvalidArgument,
                    format!("node put for tenant {:?}, which no api key of this node names", np.tenant),
                )));
            };
            let on_behalf = Principal { tenant_id, tenant: np.tenant, admin: false };
            let list = put_items(PutRequest { mode: np.mode, items: np.items }, recv, &on_behalf, s).await?;
            Response::Put(list)
        }
        Request::Get(g) => {
            check_keys(&g.keys, g.keys.len(), &s.limits)?;
            expect_end(recv, deadline).await?;
            return get_items(&g.keys, send, t, s).await;
        }
        Request::Lookup(l) => {
            check_keys(&l.chain, l.chain.len(), &s.limits)?;
            expect_end(recv, deadline).await?;
            Response::Lookup(LookupResponse { resident: store.lookup(t, &l.chain) })
        }
        Request::Exists(e) => {
            check_keys(&e.keys, e.keys.len(), &s.limits)?;
            expect_end(recv, deadline).await?;
            Response::Exists(ExistsResponse { present: store.exists(t, &e.keys) })
        }
        Request::Remove(r) => {
            check_keys(&r.keys, r.keys.len(), &s.limits)?;
            expect_end(recv, deadline).await?;
            Response::Remove(StatusList { results: store.remove(t, &r.keys, r.force) })
        }
        Request::RemoveAll(r) => {
            expect_end(recv, deadline).await?;
            let (removed, skipped) = store.remove_all(t, r.force);
            Response::RemoveAll(RemoveAllResponse { removed, skipped })
        }
        Request::Stats => {
            expect_end(recv, deadline).await?;
            Response::Stats(stats(s, p))
        }
        Request::Ping(ping) => {
            expect_end(recv, deadline).await?;
            Response::Pong(Pong {
                nonce: ping.nonce,
                server_time_us: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_micros() as u64)
                    .unwrap_or(0),
            })
        }
        Request::PolicyLoad(_) | Request::PolicyList | Request::PolicyRollback(_) if !p.admin => {
            return Err(Fail::Reply(error(ErrorCode::Forbidden, "policy administration needs an admin api key")));
        }
        Request::PolicyLoad(l) => {
            if l.module_size > s.max_module_size {
                return Err(Fail::Reply(error(
                    ErrorCode::ValueTooLarge,
                    format!("module of {} bytes; the limit is {}", l.module_size, s.max_module_size),
                )));
            }
            let by = Deadline::now() + s.timeouts.transfer(l.module_size);
            let mut wasm = vec![0u8; l.module_size as usize];
            read_exact_by(recv, &mut wasm, by, "the declared module bytes").await?;
            expect_end(recv, by).await?;
            match s.policies.load(l.kind, &l.name, l.params, wasm).await {
                Ok(info) => Response::Policy(info),
                Err(e) => return Err(Fail::Reply(error(ErrorCode::PolicyError, e.to_string()))),
            }
        }
        Request::PolicyList => {
            expect_end(recv, deadline).await?;
            Response::PolicyList(PolicyListResponse { policies: s.policies.list() })
        }
        v2 @ (Request::ShmAttach
        | Request::LocalAttach
        | Request::PutIntent(_)
        | Request::PutDone(_)
        | Request::GetLocate(_)
        | Request::Release(_)
        | Request::PutFrom(_)
        | Request::GetInto(_)
        | Request::Write(_)
        | Request::Read(_)
        | Request::LookupLease(_)
        | Request::RemoveMatching(_)
        | Request::Subscribe(_)) => match v2::dispatch(v2, recv, send, session, s, deadline).await? {
            Some(r) => r,
            None => return Ok(()),
        },
        Request::PolicyRollback(r) => {
            expect_end(recv, deadline).await?;
            match s.policies.rollback(r.kind).await {
                Ok(info) => Response::Policy(info),
                Err(crate::policy::PolicyError::NothingToRollBack(kind)) => {
                    return Err(Fail::Reply(error(
                        ErrorCode::NotFound,
                        format!("no {kind} module is loaded (the built-in is active): nothing to roll back"),
                    )))
                }
                Err(e) => return Err(Fail::Reply(error(ErrorCode::PolicyError, e.to_string()))),
            }
        }
    };
    reply(send, &resp, Deadline::now() + s.timeouts.request).await
}

/// Requests about blocks a node holds: a master answers them `unsupported`. (`Subscribe` is
/// not one: a master streams the KV events of every storage node.)
fn holds_blocks(r: &Request) -> bool {
    matches!(
        r,
        Request::Put(_)
            | Request::NodePut(_)
            | Request::Get(_)
            | Request::Lookup(_)
            | Request::Exists(_)
            | Request::Remove(_)
            | Request::RemoveAll(_)
            | Request::ShmAttach
            | Request::LocalAttach
            | Request::PutIntent(_)
            | Request::PutDone(_)
            | Request::GetLocate(_)
            | Request::Release(_)
            | Request::PutFrom(_)
            | Request::GetInto(_)
            | Request::Write(_)
            | Request::Read(_)
            | Request::LookupLease(_)
            | Request::RemoveMatching(_)
    )
}

/// A put item whose bytes have been received (with their xxh3-64), waiting for the end of the
/// stream.
enum Staged {
    Skip(ErrorCode),
    Dram(u64, DramBlock, u64),
    Ssd(u64, Vec<u8>, u64),
}

/// Request-level checks of put items (limits, empty keys); the sum of their sizes.
fn check_put(items: &[kvpool_proto::PutItem], l: &Limits) -> Result<u64, Fail> {
    check_keys(items.iter().map(|i| &i.key), items.len(), l)?;
    let mut total = 0u64;
    for it in items {
        if it.size > l.max_value_size {
            return Err(Fail::Reply(error(
                ErrorCode::ValueTooLarge,
                format!("value of {} bytes; the limit is {}", it.size, l.max_value_size),
            )));
        }
        if let Some(parent) = &it.parent {
            if parent.len() > l.max_key_len as usize {
                return Err(Fail::Reply(error(ErrorCode::KeyTooLong, "parent key too long")));
            }
            if parent.is_empty() {
                return Err(Fail::Reply(error(ErrorCode::InvalidArgument, "empty parent key")));
            }
        }
        total += it.size;
    }
    Ok(total)
}

async fn put_items<R: RequestRecv>(
    put: PutRequest,
    recv: &mut R,
    p: &Principal,
    s: &Shared,
) -> Result<StatusList, Fail> {
    let total = check_put(&put.items, &s.limits)?;
    let now = Deadline::now();
    // The bytes must arrive at the minimum rate; space is waited for once per request, not per item.
    let bytes_by = now + s.timeouts.transfer(total);
    let space_by = now + s.store.cfg.put_wait;
    let plans = s.store.plan_put(p.tenant_id, &put.items, put.mode);
    let started = Instant::now();
    // Reservations live in `staged` until commit: any early return releases all of them.
    let mut staged = Vec::with_capacity(put.items.len());
    for (it, plan) in put.items.iter().zip(plans) {
        let st = match plan {
            PutPlan::Skip(code) => {
                discard(recv, it.size, bytes_by).await?;
                Staged::Skip(code)
            }
            PutPlan::Dram(id) => match s.store.reserve(p.tenant_id, it.size, space_by.min(bytes_by)).await {
                Err(code) => {
                    discard(recv, it.size, bytes_by).await?;
                    Staged::Skip(code)
                }
                Ok(mut blk) => {
                    // Straight from the stream into the segment: no staging copy.
                    let sum = read_hashed_by(recv, blk.bytes_mut(), bytes_by, "the declared value bytes").await?;
                    Staged::Dram(id, blk, sum)
                }
            },
            PutPlan::Ssd(id) => {
                let mut data = vec![0u8; it.size as usize];
                let sum = read_hashed_by(recv, &mut data, bytes_by, "the declared value bytes").await?;
                Staged::Ssd(id, data, sum)
            }
        };
        staged.push(st);
    }
    expect_end(recv, bytes_by).await?;
    s.metrics.transferred(recv.transport(), "in", total, started.elapsed());
    let mut results = Vec::with_capacity(staged.len());
    for (it, st) in put.items.iter().zip(staged) {
        results.push(match st {
            Staged::Skip(code) => code,
            Staged::Dram(id, blk, sum) => s.store.commit(p.tenant_id, id, it, put.mode, blk, Some(sum)),
            Staged::Ssd(id, data, sum) => s.store.commit_ssd(p.tenant_id, id, it, put.mode, data, Some(sum)).await,
        });
    }
    Ok(StatusList { results })
}

async fn get_items<W: RequestSend>(keys: &[Vec<u8>], send: &mut W, tenant: u32, s: &Shared) -> Result<(), Fail> {
    let plans = s.store.plan_get(tenant, keys);
    let lease_ms = s.store.cfg.lease_ttl.as_millis().min(u32::MAX as u128) as u32;
    let mut items = Vec::with_capacity(plans.len());
    let mut served: Vec<Served> = Vec::new();
    for plan in plans {
        let r = match plan {
            GetPlan::Missing => Err(ErrorCode::NotFound),
            GetPlan::Dram { block, checksum } => Ok(Served::Dram(block, checksum, kvpool_policy_sdk::Tier::Dram)),
            GetPlan::Ssd { id, file, size, checksum } => s.store.read_ssd(id, file, size, checksum).await,
        };
        match r {
            Ok(sv) => {
                items.push(GetItem {
                    status: ErrorCode::Ok,
                    size: sv.bytes().len() as u64,
                    tier: sv.tier() as u8,
                    checksum: sv.checksum(),
                    lease_ms,
                });
                served.push(sv);
            }
            Err(code) => items.push(GetItem { status: code, size: 0, tier: 0, checksum: 0, lease_ms: 0 }),
        }
    }
    // The client must take the bytes at the minimum rate: a reader that stalls would otherwise
    // pin these blocks' memory for ever.
    let total: u64 = served.iter().map(|sv| sv.bytes().len() as u64).sum();
    let by = Deadline::now() + s.timeouts.transfer(total);
    let frame = encode_frame(&Response::Get(GetResponse { items }))
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let started = Instant::now();
    write_by(send, &frame, by).await?;
    for sv in served {
        // DRAM blocks go out from the segment itself; the chunk keeps the block alive until sent.
        write_owned_by(send, sv.into_bytes(), by).await?;
    }
    send.finish();
    s.metrics.transferred(send.transport(), "out", total, started.elapsed());
    Ok(())
}

/// `stats`: pool-wide for admin keys; for other keys, the caller's tenant only.
fn stats(s: &Shared, p: &Principal) -> StatsReport {
    let m = &s.metrics;
    s.store.update_gauges();
    let usage = s.store.tier_usage();
    let ops_for = |summary: &dyn Fn(&str) -> (u64, f64, f64, f64), errors: &dyn Fn(&str) -> u64| {
        crate::metrics::OPS
            .iter()
            .map(|op| {
                let (count, p50, p99, mean) = summary(op);
                OpStats {
                    op: op.to_string(),
                    count,
                    errors: errors(op),
                    p50_us: p50 * 1e6,
                    p99_us: p99 * 1e6,
                    mean_us: mean * 1e6,
                }
            })
            .collect::<Vec<_>>()
    };
    if p.admin {
        let (blocks, dram_blocks, ssd_blocks) = s.store.counts();
        let tiers = usage
            .into_iter()
            .map(|(tier, cap, used)| {
                let name = tier.name();
                TierStats {
                    tier: name.into(),
                    capacity_bytes: cap,
                    used_bytes: used,
                    blocks: if name == "dram" { dram_blocks } else { ssd_blocks },
                    hits: m.hits.with_label_values(&[name]).get(),
                    misses: m.misses.with_label_values(&[name]).get(),
                    evictions: m.evictions.with_label_values(&[name]).get(),
                }
            })
            .collect();
        return StatsReport {
            server: s.server_name.clone(),
            uptime_s: s.started.elapsed().as_secs(),
            blocks,
            tiers,
            demotions: m.demotions.get(),
            promotions: m.promotions.get(),
            rejected_puts: m.rejected_puts.with_label_values(&["admission"]).get()
                + m.rejected_puts.with_label_values(&["no_space"]).get(),
            corrupt_blocks: m.corrupt.get(),
            ops: ops_for(&|op| m.op_summary(op), &|op| m.op_errors.with_label_values(&[op]).get()),
        };
    }
    let c = s.store.tenant_counters(p.tenant_id);
    let tiers = usage
        .into_iter()
        .map(|(tier, cap, _)| {
            let i = usize::from(tier == kvpool_policy_sdk::Tier::Ssd);
            TierStats {
                tier: tier.name().into(),
                capacity_bytes: cap,
                used_bytes: c.bytes[i],
                blocks: c.blocks[i],
                hits: c.hits[i],
                misses: c.misses[i],
                evictions: c.evictions[i],
            }
        })
        .collect();
    StatsReport {
        server: s.server_name.clone(),
        uptime_s: s.started.elapsed().as_secs(),
        blocks: c.resident,
        tiers,
        demotions: c.demotions,
        promotions: c.promotions,
        rejected_puts: c.rejected,
        corrupt_blocks: c.corrupt,
        ops: ops_for(&|op| m.tenant_op_summary(&p.tenant, op), &|op| {
            m.tenant_op_errors.with_label_values(&[&p.tenant, op]).get()
        }),
    }
}
