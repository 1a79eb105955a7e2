//! Hooks for protocol tests (feature `test-hooks`): raw streams on an authenticated connection,
//! and a QUIC connection on which no hello has been sent. Not part of the client's API.

use crate::connect::{client_endpoint, handshake, quic_config, resolve};
use crate::error::{ClientError, Result};
use crate::{timed, Client, ClientConfig};
use kvpool_proto::{frame, Request, Response, CLIENT_MAX_FRAME};
use std::time::Duration;

impl Client {
    /// Open a stream on this (authenticated) connection, write `bytes` verbatim, finish, and
    /// return everything the server wrote back (at most `max_reply` bytes).
    pub async fn raw_exchange(&self, bytes: &[u8], max_reply: usize) -> Result<Vec<u8>> {
        let s = self.session().await?;
        exchange_raw(&s.conn, self.inner.cfg.request_timeout, bytes, max_reply).await
    }

    /// The underlying QUIC connection.
    pub fn connection(&self) -> quinn::Connection {
        self.current().conn
    }
}

/// A TLS-verified QUIC connection on which no hello has been sent: for tests that probe the
/// server with malformed or out-of-order input.
pub struct RawConnection {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    timeout: Duration,
}

impl RawConnection {
    pub async fn connect(cfg: &ClientConfig) -> Result<RawConnection> {
        let addr = resolve(&cfg.server).await?;
        let (endpoint, bufs, refusals) = client_endpoint(&addr, &cfg.quic)?;
        let quic = quic_config(cfg, &addr, &bufs)?;
        let conn = handshake(&endpoint, &refusals, &quic, addr, cfg).await?;
        Ok(RawConnection { endpoint, conn, timeout: cfg.request_timeout })
    }

    pub fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    /// Write `bytes` on a new stream, finish it, and read the whole reply.
    pub async fn exchange(&self, bytes: &[u8], max_reply: usize) -> Result<Vec<u8>> {
        exchange_raw(&self.conn, self.timeout, bytes, max_reply).await
    }

    /// Send one well-formed request and decode the response frame (bulk bytes are left unread).
    pub async fn request(&self, req: &Request) -> Result<Response> {
        let frame = frame::encode_frame(req)?;
        let reply = self.exchange(&frame, CLIENT_MAX_FRAME as usize + (256 << 20)).await?;
        Ok(parse_reply(&reply)?.0)
    }

    pub fn close(&self) {
        self.conn.close(kvpool_proto::close::OK.into(), b"bye");
    }
}

impl Drop for RawConnection {
    fn drop(&mut self) {
        self.conn.close(kvpool_proto::close::OK.into(), b"dropped");
        let _ = &self.endpoint;
    }
}

/// Split a raw reply into its response frame and the bulk bytes after it.
pub fn parse_reply(reply: &[u8]) -> Result<(Response, &[u8])> {
    if reply.len() < 4 {
        return Err(ClientError::Protocol(format!("reply of {} bytes has no frame", reply.len())));
    }
    let len = u32::from_le_bytes([reply[0], reply[1], reply[2], reply[3]]) as usize;
    let body = reply
        .get(4..4 + len)
        .ok_or_else(|| ClientError::Protocol(format!("frame claims {len} bytes, reply has {}", reply.len() - 4)))?;
    let resp = kvpool_proto::codec::decode::<Response>(body)?;
    Ok((resp, &reply[4 + len..]))
}

async fn exchange_raw(conn: &quinn::Connection, limit: Duration, bytes: &[u8], max_reply: usize) -> Result<Vec<u8>> {
    timed(limit, async {
        let (mut tx, mut rx) = conn.open_bi().await?;
        // The server may stop reading early (that is often the point of a malformed input);
        // what it answered is still worth reading.
        let written = tx.write_all(bytes).await;
        let _ = tx.finish();
        let reply = rx.read_to_end(max_reply).await;
        match (reply, written) {
            (Ok(r), _) => Ok(r),
            (Err(e), Ok(())) => Err(e.into()),
            (Err(_), Err(w)) => Err(w.into()),
        }
    })
    .await
}
