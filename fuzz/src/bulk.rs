//! The TCP bulk channel's door and framing, fuzzed through `serve_stream` over in-memory pipes
//! (what follows the TLS handshake is the same bytes either way): genuine, flipped, short,
//! reused and foreign tokens, plaintext where TLS was required, then envelopes of generated
//! requests, noise, lies about their length and cut-off bodies. A bad token must be refused
//! with nothing else said; a good one bound; every answer well-framed. The connection may be
//! closed, never the server.

use crate::{ask, gen, Worker};
use anyhow::{bail, Context, Result};
use kvpool_proto::{codec, BulkAttachRequest, Request, Response};
use kvpool_server::service::Session;
use rand::rngs::StdRng;
use rand::Rng;
use std::net::IpAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, DuplexStream};

const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 9, 0, 2));
const STRANGER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 9, 0, 3));

/// `n` connections; returns how many were made.
pub(crate) async fn fuzz_bulk(w: &Worker, rng: &mut StdRng, n: u64) -> Result<u64> {
    w.shared.bulk.get().context("the fuzz node has a bulk channel")?;
    let mut last = Vec::new();
    let mut spent: Vec<Vec<u8>> = Vec::new();
    for _ in 0..n {
        let session = Session::new(w.principals[rng.gen_range(0..w.principals.len())].clone(), 2, Some(CLIENT));
        let ask_plain = rng.gen_bool(0.5);
        let offer = match ask(w, &session, &Request::BulkAttach(BulkAttachRequest { plaintext: ask_plain })).await? {
            Response::BulkOffer(o) => o,
            other => bail!("no bulk offer: {other:?}"),
        };
        if offer.token.len() != 32 || offer.token[0] == 0x16 {
            bail!("a token a plaintext connection could not present: {:?}", offer.token);
        }
        if ask_plain == offer.tls {
            bail!("plaintext asked {ask_plain}, granted {} (the fuzz node trusts 10.9.0.0/24)", !offer.tls);
        }
        let mut token = offer.token.clone();
        match rng.gen_range(0..12) {
            0 => token.truncate(rng.gen_range(0..32)),
            1 => token[rng.gen_range(0..32)] ^= 1 << rng.gen_range(0..8),
            2 if !spent.is_empty() => token = spent[rng.gen_range(0..spent.len())].clone(),
            _ => {}
        }
        let peer = if rng.gen_bool(0.1) { STRANGER } else { CLIENT };
        let tls = offer.tls || rng.gen_bool(0.7);
        let (mut sock, server) = tokio::io::duplex(256 << 10);
        let shared = w.shared.clone();
        let served = tokio::spawn(async move { serve(server, peer, tls, shared).await });
        let outcome = connection(w, rng, &mut sock, &token, &offer.token, peer, &mut last).await;
        drop(sock);
        served.await.context("the bulk connection's task panicked")?;
        outcome?;
        spent.push(offer.token);
        if spent.len() > 64 {
            spent.remove(0);
        }
    }
    Ok(n)
}

async fn serve(server: DuplexStream, peer: IpAddr, tls: bool, shared: std::sync::Arc<kvpool_server::service::Shared>) {
    let _ = kvpool_server::service::bulk::serve_stream(server, peer, tls, &shared).await;
}

async fn connection(
    w: &Worker,
    rng: &mut StdRng,
    sock: &mut DuplexStream,
    token: &[u8],
    genuine: &[u8],
    peer: IpAddr,
    last: &mut Vec<u8>,
) -> Result<()> {
    if sock.write_all(token).await.is_err() {
        return Ok(());
    }
    if token.len() < 32 {
        // The server waits for the rest of the token, then says so (paused time runs on).
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
        if rest.first() == Some(&0) {
            bail!("a short token was bound");
        }
        return Ok(());
    }
    let mut status = [0u8; 1];
    if sock.read_exact(&mut status).await.is_err() {
        bail!("no status for a whole token");
    }
    let good = token == genuine && peer == CLIENT;
    match (status[0], good) {
        (0, true) => {}
        (0, false) => bail!("a bad token was bound (foreign address: {})", peer != CLIENT),
        (1, _) => {
            // Refused: one error frame, then the end; a genuine token only for plaintext
            // where TLS was required.
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
            match frame_of(&rest) {
                Some((Response::Error(_), n)) if n == rest.len() => return Ok(()),
                _ => bail!("a refusal that is not one error frame: {rest:?}"),
            }
        }
        (s, _) => bail!("status byte {s}"),
    }
    let max = {
        let l = &w.shared.limits;
        l.max_value_size.saturating_mul(l.max_batch as u64) + l.max_frame as u64 + 4
    };
    for _ in 0..rng.gen_range(1..6) {
        let body: Vec<u8> = match rng.gen_range(0..8) {
            0 => (0..rng.gen_range(0..64)).map(|_| rng.gen()).collect(),
            _ => gen::input(rng, w.principals.len(), last).bytes,
        };
        let declared: u64 = match rng.gen_range(0..20) {
            0 => max + 1,
            1 => rng.gen::<u32>() as u64,
            _ => body.len() as u64,
        };
        let mut env = declared.to_le_bytes().to_vec();
        env.extend_from_slice(&body);
        let cut = if rng.gen_bool(0.05) { rng.gen_range(0..=env.len()) } else { env.len() };
        let body_len = body.len() as u64;
        *last = body;
        if sock.write_all(&env[..cut]).await.is_err() || cut < 8 {
            // Part of a length only: an idle connection, which only its client ends.
            return Ok(());
        }
        let whole = cut == env.len() && declared <= body_len;
        if declared < body_len && declared <= max {
            // The rest of the body reads as the next envelope; only the connection is at stake.
            return Ok(());
        }
        match answer(sock, async |s: &mut DuplexStream, b: &mut [u8]| s.read_exact(b).await.map(drop)).await? {
            Some(_) => {}
            None if !whole || declared > max => return Ok(()),
            None => bail!("a whole envelope of {declared} bytes got no answer"),
        }
        if !whole || declared > max {
            return Ok(());
        }
    }
    Ok(())
}

/// One answer: chunks, then the end. `None`: the connection closed before any chunk. `chunk`
/// reads a chunk's bytes (the TLS driver lands large ones in place, as the client does).
pub(crate) async fn answer<R: AsyncRead + Unpin>(
    sock: &mut R,
    mut chunk: impl AsyncFnMut(&mut R, &mut [u8]) -> std::io::Result<()>,
) -> Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    let mut heard = false;
    loop {
        // A stalled envelope ends with the server's deadline (paused time runs on).
        let n = match tokio::time::timeout(Duration::from_secs(600), sock.read_u32_le()).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) if !heard => return Ok(None),
            Ok(Err(e)) => bail!("the answer broke off: {e}"),
            Err(_) => bail!("no answer and no close"),
        };
        heard = true;
        if n == u32::MAX {
            let end = sock.read_u8().await?;
            let _code = sock.read_u32_le().await?;
            if end > 1 {
                bail!("end byte {end}");
            }
            if end == 0 && !out.is_empty() && frame_of(&out).is_none() {
                bail!("an answer that does not start with a response frame");
            }
            return Ok(Some(out));
        }
        if n > u32::MAX >> 1 || out.len() + n as usize > 256 << 20 {
            bail!("chunk of {n} bytes");
        }
        let at = out.len();
        out.resize(at + n as usize, 0);
        chunk(sock, &mut out[at..]).await?;
    }
}

/// The response frame at the front of `bytes`, and its length with the header.
pub(crate) fn frame_of(bytes: &[u8]) -> Option<(Response, usize)> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let body = bytes.get(4..4 + len)?;
    Some((codec::decode::<Response>(body).ok()?, 4 + len))
}
