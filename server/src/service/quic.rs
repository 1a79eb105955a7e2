//! The QUIC front door: accept connections (up to the limit), run the hello on a connection's
//! first stream, then hand every further stream to `handle_stream` (in `dispatch`).

use super::dispatch::{conclude, handle_stream, read_request};
use super::doors::Door;
use super::session::Session;
use super::shared::Shared;
use super::stream::{error, expect_end, reply, BoxFuture, Fail, RequestRecv, RequestSend};
use crate::auth::Principal;
use kvpool_proto::{close, ErrorCode, HelloOk, Request, Response, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::time::Instant as Deadline;
use tracing::{debug, info, warn, Instrument};

impl RequestRecv for quinn::RecvStream {
    fn stop(&mut self, code: u32) {
        let _ = quinn::RecvStream::stop(self, code.into());
    }
    fn transport(&self) -> &'static str {
        "quic"
    }
    fn door(&self) -> Door {
        Door::Quic
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

/// Server configs per path: same-host peers get large datagrams, others segmentation offload with
/// a capped MTU (`kvpool_net` says why).
pub struct QuicServerConfigs {
    pub same_host: Arc<quinn::ServerConfig>,
    pub network: Arc<quinn::ServerConfig>,
}

impl QuicServerConfigs {
    pub fn for_peer(&self, peer: std::net::IpAddr) -> Arc<quinn::ServerConfig> {
        match kvpool_net::path_kind(peer) {
            kvpool_net::PathKind::SameHost => self.same_host.clone(),
            kvpool_net::PathKind::Network => self.network.clone(),
        }
    }
}

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>, configs: Arc<QuicServerConfigs>) {
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
