//! Setting up a connection: resolve, QUIC handshake (pinned or CA-checked TLS), hello with the
//! API key (falling back to an older server's version), and the same-host transports.

use crate::{
    local, read_response, shm, timed, tls, unexpected, write_request, ClientConfig, ClientError, Result, Session,
    TransportChoice,
};
use kvpool_proto::{ErrorCode, Hello, HelloOk, Request, Response, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) async fn resolve(server: &str) -> Result<SocketAddr> {
    let mut addrs = tokio::net::lookup_host(server)
        .await
        .map_err(|e| ClientError::Connect { addr: server.to_string(), message: format!("cannot resolve: {e}") })?;
    addrs.next().ok_or_else(|| ClientError::Connect { addr: server.to_string(), message: "no address".into() })
}

pub(crate) fn quic_config(
    cfg: &ClientConfig,
    addr: &SocketAddr,
    bufs: &kvpool_net::SocketBuffers,
) -> Result<quinn::ClientConfig> {
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

/// The endpoint a client connects from, its socket watched for ICMP port unreachable (the
/// [`kvpool_net::Refusals`] say when the server's process is gone).
pub(crate) fn client_endpoint(
    addr: &SocketAddr,
    tuning: &kvpool_net::QuicTuning,
) -> Result<(quinn::Endpoint, kvpool_net::SocketBuffers, kvpool_net::Refusals)> {
    let bind: SocketAddr = if addr.is_ipv6() { "[::]:0".parse() } else { "0.0.0.0:0".parse() }.expect("literal");
    let mut tuning = *tuning;
    match std::env::var("KVPOOL_QUIC_DRIVERS").as_deref() {
        Ok("caller") => tuning.drivers = kvpool_net::Drivers::Caller,
        Ok("io") => tuning.drivers = kvpool_net::Drivers::IoThread,
        _ => {}
    }
    kvpool_net::endpoint_watched(bind, &tuning).map_err(|e| ClientError::Io(e.to_string()))
}

/// A QUIC handshake with the server at `addr`. It fails as soon as the server's host answers
/// that nothing listens there (its process is not running), else within the request timeout.
pub(crate) async fn handshake(
    endpoint: &quinn::Endpoint,
    refusals: &kvpool_net::Refusals,
    quic: &quinn::ClientConfig,
    addr: SocketAddr,
    cfg: &ClientConfig,
) -> Result<quinn::Connection> {
    let connect_err = |message: String| ClientError::Connect { addr: cfg.server.clone(), message };
    let started = Instant::now();
    let connecting =
        endpoint.connect_with(quic.clone(), addr, &cfg.server_name).map_err(|e| connect_err(e.to_string()))?;
    let done = tokio::select! {
        done = tokio::time::timeout(cfg.request_timeout, connecting) => done,
        _ = refusals.refused(addr, started) => {
            return Err(connect_err(format!("nothing listens on {addr} (ICMP port unreachable): the server is not running")));
        }
    };
    match done {
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

pub(crate) async fn hello(conn: &quinn::Connection, cfg: &ClientConfig, version: u16) -> Result<HelloOk> {
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

pub(crate) async fn establish(
    endpoint: &quinn::Endpoint,
    refusals: &kvpool_net::Refusals,
    quic: &quinn::ClientConfig,
    addr: SocketAddr,
    cfg: &ClientConfig,
) -> Result<Session> {
    let conn = handshake(endpoint, refusals, quic, addr, cfg).await?;
    let mut session = match hello(&conn, cfg, PROTOCOL_VERSION).await {
        // A server older than this client: speak its version (it closed that connection).
        Err(ClientError::Status { code: ErrorCode::UnsupportedVersion, .. }) if PROTOCOL_VERSION > 1 => {
            conn.close(kvpool_proto::close::OK.into(), b"retry with version 1");
            let conn = handshake(endpoint, refusals, quic, addr, cfg).await?;
            let h = hello(&conn, cfg, 1).await;
            finish_session(conn, h)?
        }
        h => finish_session(conn, h)?,
    };
    session.refusal_watch = close_when_refused(&session.conn, refusals, addr);
    Ok(session)
}

/// Close `conn` when the server's host says nothing listens on its port any more: the server's
/// process is gone, and every call waiting on it fails now instead of at a watchdog's bound or
/// the idle timeout (the next call connects again). The watch holds a handle of the connection
/// (quinn has no weak one), so it is aborted with the session that owns it.
fn close_when_refused(
    conn: &quinn::Connection,
    refusals: &kvpool_net::Refusals,
    addr: SocketAddr,
) -> Option<Arc<WatchTask>> {
    if !refusals.watched() {
        return None;
    }
    let (conn, refusals, since) = (conn.clone(), refusals.clone(), Instant::now());
    let task = tokio::spawn(async move {
        tokio::select! {
            _ = conn.closed() => {}
            _ = refusals.refused(addr, since) => {
                tracing::warn!(server = %addr, "the server's port answered unreachable (its process is gone): connection closed");
                conn.close(kvpool_proto::close::OK.into(), b"server port unreachable");
            }
        }
    });
    Some(Arc::new(WatchTask(task.abort_handle())))
}

/// A session's refusal watch: aborted when the session's last clone is dropped.
pub(crate) struct WatchTask(tokio::task::AbortHandle);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) fn finish_session(conn: quinn::Connection, hello: Result<HelloOk>) -> Result<Session> {
    match hello {
        Ok(hello) => {
            tracing::debug!(tenant = %hello.tenant, server = %hello.server, version = hello.version, "connected to kvpool");
            Ok(Session { conn, hello, local: None, bulk: None, refusal_watch: None })
        }
        Err(e) => {
            conn.close(kvpool_proto::close::OK.into(), b"hello failed");
            Err(e)
        }
    }
}

/// Set up the same-host transport on a fresh connection when the configuration allows it and the
/// server offers it: ask for a token, attach on the shm socket, share every live buffer.
pub(crate) async fn attach_shm(
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
pub(crate) async fn attach_local(session: &Session, cfg: &ClientConfig) -> Option<Arc<local::LocalLink>> {
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
