//! The TCP bulk channel under TLS, fuzzed through the server's own accept path
//! (`serve_tls_stream`) over in-memory pipes: a real handshake (sometimes without the channel's
//! ALPN, sometimes noise instead of a ClientHello), the token through rustls, then envelopes in
//! the channel's own records, cut as the channel cuts them or at random (records across value
//! boundaries), and mangled on the way: flipped bits (bad tags, bad headers), records of
//! other types (alerts, a KeyUpdate, padding), key updates, noise between records, the stream cut inside a
//! record. Every whole envelope on an unharmed connection must be answered, every answer
//! well-framed; a harmed connection may close, the server never falls over.

use crate::{ask, gen, Worker};
use anyhow::{bail, Context as _, Result};
use kvpool_net::bulk::{self, Piece, RecordReader, RecordWriter};
use kvpool_proto::{BulkAttachRequest, Request, Response};
use kvpool_server::service::Session;
use rand::rngs::StdRng;
use rand::Rng;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};

const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 9, 0, 2));

/// What happens to the bytes a connection sends after its bind.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Harm {
    None,
    /// One bit flipped at this byte.
    Flip(u64),
    /// Noise of this many bytes at this byte.
    Noise(u64, usize),
    /// Nothing after this byte, then the end of the stream.
    Cut(u64),
}

/// The write half, harmed as told.
struct Mangle {
    inner: WriteHalf<DuplexStream>,
    harm: Harm,
    /// Bytes taken so far, and harmed bytes not yet passed on.
    at: u64,
    pending: Vec<u8>,
    noise: Vec<u8>,
    /// Past the cut: nothing more goes out.
    cut: bool,
}

impl Mangle {
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Mangle {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        std::task::ready!(me.poll_drain(cx))?;
        if me.cut {
            std::task::ready!(Pin::new(&mut me.inner).poll_shutdown(cx))?;
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let (at, end) = (me.at, me.at + buf.len() as u64);
        let mut out = buf.to_vec();
        match me.harm {
            Harm::Flip(x) if (at..end).contains(&x) => out[(x - at) as usize] ^= 1 << (x % 8),
            Harm::Noise(x, _) if (at..end).contains(&x) => {
                let k = (x - at) as usize;
                let noise = std::mem::take(&mut me.noise);
                out.splice(k..k, noise);
            }
            Harm::Cut(x) if end > x => {
                out.truncate(x.saturating_sub(at) as usize);
                me.cut = true;
            }
            _ => {}
        }
        me.pending = out;
        me.at = end;
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A client config trusting the fuzz node's certificate, the channel's ALPN, keys handed over.
pub(crate) fn client_config(cert: &rustls::pki_types::CertificateDer<'static>) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let mut c = rustls::ClientConfig::builder_with_provider(kvpool_net::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![kvpool_proto::BULK_ALPN.to_vec()];
    c.enable_secret_extraction = true;
    Ok(Arc::new(c))
}

/// `n` connections; returns how many were made.
pub(crate) async fn fuzz_bulk_tls(
    w: &Worker,
    rng: &mut StdRng,
    n: u64,
    cfg: &Arc<rustls::ClientConfig>,
) -> Result<u64> {
    for _ in 0..n {
        let session = Session::new(w.principals[rng.gen_range(0..w.principals.len())].clone(), 2, Some(CLIENT));
        let offer = match ask(w, &session, &Request::BulkAttach(BulkAttachRequest { plaintext: false })).await? {
            Response::BulkOffer(o) => o,
            other => bail!("no bulk offer: {other:?}"),
        };
        let (sock, server) = tokio::io::duplex(1 << 20);
        let shared = w.shared.clone();
        let served = tokio::spawn(async move {
            let _ = kvpool_server::service::bulk::serve_tls_stream(server, CLIENT, &shared).await;
        });
        let outcome = connection(w, rng, sock, &offer.token, cfg).await;
        served.await.context("the TLS bulk connection's task panicked")?;
        outcome?;
    }
    Ok(n)
}

async fn connection(
    w: &Worker,
    rng: &mut StdRng,
    mut sock: DuplexStream,
    token: &[u8],
    cfg: &Arc<rustls::ClientConfig>,
) -> Result<()> {
    match rng.gen_range(0..20) {
        0 => {
            // Noise instead of a ClientHello: the server closes.
            let noise: Vec<u8> = (0..rng.gen_range(1..300)).map(|_| rng.gen()).collect();
            let _ = sock.write_all(&noise).await;
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
            return Ok(());
        }
        1 => {
            // No ALPN: refused in the handshake.
            let mut c = (**cfg).clone();
            c.alpn_protocols.clear();
            let name = rustls::pki_types::ServerName::try_from("localhost")?;
            if tokio_rustls::TlsConnector::from(Arc::new(c)).connect(name, sock).await.is_ok() {
                bail!("a TLS handshake without the channel's ALPN completed");
            }
            return Ok(());
        }
        _ => {}
    }
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let (cfg, secrets_log) = bulk::SecretLog::client(cfg);
    let mut tls = tokio_rustls::TlsConnector::from(cfg).connect(name, sock).await.context("handshake")?;
    let mut shown = token.to_vec();
    if rng.gen_bool(0.05) {
        shown[rng.gen_range(0..32)] ^= 1;
    }
    tls.write_all(&shown).await?;
    tls.flush().await?;
    let mut status = [0u8; 1];
    tls.read_exact(&mut status).await.context("no status for a whole token")?;
    match (status[0], shown == token) {
        (0, true) => {}
        (0, false) => bail!("a bad token was bound over TLS"),
        (1, false) => return Ok(()),
        (1, true) => bail!("a genuine token was refused over TLS"),
        (s, _) => bail!("status byte {s}"),
    }
    let (sock, conn) = tls.into_inner();
    let secrets = conn.dangerous_extract_secrets()?;
    let (rd, wr) = tokio::io::split(sock);
    let harm = match rng.gen_range(0..8) {
        0 => Harm::Flip(rng.gen_range(0..4096)),
        1 => Harm::Noise(rng.gen_range(0..4096), rng.gen_range(1..40)),
        2 => Harm::Cut(rng.gen_range(0..4096)),
        _ => Harm::None,
    };
    let noise = match harm {
        Harm::Noise(_, k) => (0..k).map(|_| rng.gen()).collect(),
        _ => Vec::new(),
    };
    let mangle = Mangle { inner: wr, harm, at: 0, pending: Vec::new(), noise, cut: false };
    let (mut rd, mut wr) = bulk::tls_halves(rd, mangle, secrets, &secrets_log)?;
    let mut last = Vec::new();
    for _ in 0..rng.gen_range(1..5) {
        let body = gen::input(rng, w.principals.len(), &last).bytes;
        let mut head = (body.len() as u64).to_le_bytes().to_vec();
        let sent = send(rng, &mut wr, &mut head, &body).await;
        last = body;
        let answered =
            crate::bulk::answer(&mut rd, async |rd: &mut RecordReader<ReadHalf<DuplexStream>>, b: &mut [u8]| {
                // Large chunks (values) land in place, as the client reads them.
                if b.len() > 4096 {
                    rd.fill(b, &mut |_| {}).await.map_err(io::Error::from)
                } else {
                    rd.read_exact(b).await.map(drop)
                }
            })
            .await;
        match (sent, answered, harm) {
            (_, Ok(Some(_)), _) => {}
            // A harmed stream may end anywhere; an unharmed one answers every envelope.
            (_, _, h) if h != Harm::None => return Ok(()),
            (Ok(true), Ok(None), _) => bail!("an envelope sent whole over sound records got no answer"),
            (Ok(true), Err(e), _) => bail!("an answer over sound records broke off: {e:#}"),
            (_, _, _) => return Ok(()),
        }
    }
    Ok(())
}

/// One envelope as the channel's client sends it, or in records cut at random, or with a
/// record of another type in between, or after a key update; `Ok(true)` when all of it went
/// out unharmed by us.
async fn send(rng: &mut StdRng, wr: &mut RecordWriter<Mangle>, head: &mut Vec<u8>, body: &[u8]) -> Result<bool> {
    let whole = match rng.gen_range(0..7) {
        0 => {
            // Cut at random: records across the frame and the value bytes.
            head.extend_from_slice(body);
            let mut at = 0;
            while at < head.len() {
                let k = rng.gen_range(1..=head.len() - at).min(rng.gen_range(1..40_000));
                wr.write_all(&head[at..at + k]).await?;
                if rng.gen_bool(0.3) {
                    wr.flush().await?;
                }
                at += k;
            }
            // The writer keeps what it has not flushed: the envelope's tail must go out.
            wr.flush().await?;
            true
        }
        1 => {
            // A record of another type first: an alert, a KeyUpdate with no change of our keys
            // after it, a ticket, padding only.
            let (ty, content): (u8, Vec<u8>) = match rng.gen_range(0..5) {
                0 => (21, vec![2, rng.gen()]),
                1 => (22, vec![24, 0, 0, 1, 0]),
                2 => (22, vec![4, 0, 0, 0]),
                3 => (23, Vec::new()),
                _ => (rng.gen(), (0..rng.gen_range(0..20)).map(|_| rng.gen()).collect()),
            };
            wr.seal_record(ty, &content, rng.gen_range(0..30))?;
            // A random record may be empty: its first byte is looked at, not indexed.
            let harmless = (ty == 22 && content.first() == Some(&4)) || (ty == 23);
            let pieces = [Piece::Small(head), Piece::Value(body)];
            bulk::send_all(wr, &pieces).await?;
            harmless
        }
        2 => {
            // A true key update (the server's answer follows one of its own when asked).
            wr.update_keys(rng.gen_bool(0.5))?;
            let pieces = [Piece::Small(head), Piece::Value(body)];
            bulk::send_all(wr, &pieces).await?;
            true
        }
        _ => {
            let pieces = [Piece::Small(head), Piece::Value(body)];
            bulk::send_all(wr, &pieces).await?;
            true
        }
    };
    Ok(whole)
}
