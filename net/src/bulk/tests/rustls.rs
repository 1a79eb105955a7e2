//! The record layer against rustls over loopback TCP: a rustls peer on the other end of each
//! direction and each role, byte for byte, with the channel's switch after the token.

use super::super::*;
use super::value;
use ::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{client, server, TlsAcceptor, TlsConnector};

/// Configs of both ends, the first of `crate::crypto_provider`'s suites or `suite`.
fn configs(suite: Option<::rustls::CipherSuite>) -> (Arc<::rustls::ServerConfig>, Arc<::rustls::ClientConfig>) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert = CertificateDer::from(c.cert.der().to_vec());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(c.key_pair.serialize_der()));
    let mut p = (*crate::crypto_provider()).clone();
    if let Some(suite) = suite {
        p.cipher_suites.retain(|s| s.suite() == suite);
    }
    let p = Arc::new(p);
    let mut s = ::rustls::ServerConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&::rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    s.enable_secret_extraction = true;
    s.send_tls13_tickets = 0;
    let mut roots = ::rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let mut cl = ::rustls::ClientConfig::builder_with_provider(p)
        .with_protocol_versions(&[&::rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cl.enable_secret_extraction = true;
    (Arc::new(s), Arc::new(cl))
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dial = TcpStream::connect(l.local_addr().unwrap());
    let (a, b) = tokio::join!(l.accept(), dial);
    (a.unwrap().0, b.unwrap())
}

type Ours = (RecordReader<tokio::net::tcp::OwnedReadHalf>, RecordWriter<tokio::net::tcp::OwnedWriteHalf>);

/// A handshake as the channel does it: the client sends a 32-byte token and the server
/// answers a status byte (not yet read by the client); the side that is ours switches to the
/// record layer after it, with the secrets its config logged.
async fn bound(suite: Option<::rustls::CipherSuite>) -> Bound {
    let (s, c) = configs(suite);
    let (s, slog) = SecretLog::server(&s);
    let (c, clog) = SecretLog::client(&c);
    let (a, b) = tcp_pair().await;
    let name = ServerName::try_from("localhost").unwrap();
    let (srv, cli) = tokio::join!(TlsAcceptor::from(s).accept(a), TlsConnector::from(c).connect(name, b));
    let (mut srv, mut cli) = (srv.unwrap(), cli.unwrap());
    cli.write_all(&[7; 32]).await.unwrap();
    cli.flush().await.unwrap();
    let mut token = [0u8; 32];
    srv.read_exact(&mut token).await.unwrap();
    srv.write_all(&[0]).await.unwrap();
    srv.flush().await.unwrap();
    (srv, slog, cli, clog)
}

type Bound = (server::TlsStream<TcpStream>, Arc<SecretLog>, client::TlsStream<TcpStream>, Arc<SecretLog>);

async fn ours_as_server() -> (Ours, client::TlsStream<TcpStream>) {
    ours_as_server_with(None).await
}

async fn ours_as_server_with(suite: Option<::rustls::CipherSuite>) -> (Ours, client::TlsStream<TcpStream>) {
    let (srv, slog, mut cli, _) = bound(suite).await;
    let (tcp, conn) = srv.into_inner();
    let ours = tls(tcp, conn.dangerous_extract_secrets().unwrap(), &slog).unwrap();
    let mut status = [1u8];
    cli.read_exact(&mut status).await.unwrap();
    assert_eq!(status, [0]);
    (ours, cli)
}

async fn ours_as_client() -> (Ours, server::TlsStream<TcpStream>) {
    ours_as_client_with(None).await
}

async fn ours_as_client_with(suite: Option<::rustls::CipherSuite>) -> (Ours, server::TlsStream<TcpStream>) {
    let (srv, _, mut cli, clog) = bound(suite).await;
    let mut status = [1u8];
    cli.read_exact(&mut status).await.unwrap();
    let (tcp, conn) = cli.into_inner();
    (tls(tcp, conn.dangerous_extract_secrets().unwrap(), &clog).unwrap(), srv)
}

/// Values of every awkward size, written by rustls one `write_all` each (so its records follow
/// the writes, not our cutting), read back by `fill` and small reads.
async fn rustls_to_ours<S: AsyncWriteExt + Unpin + Send + 'static>(
    mut peer: S,
    mut rd: RecordReader<tokio::net::tcp::OwnedReadHalf>,
) {
    let sizes = [3usize, 16_384, 16_385, 65_536, 100_003, 1 << 20];
    let values: Vec<Vec<u8>> = sizes.iter().map(|&n| value(n, n as u64)).collect();
    let sent = values.clone();
    let writer = tokio::spawn(async move {
        for v in &sent {
            peer.write_all(&(v.len() as u32).to_le_bytes()).await.unwrap();
            peer.write_all(v).await.unwrap();
        }
        // Two values in one write: records across the boundary between them.
        let joined = [value(40_000, 1), value(30_000, 2)].concat();
        peer.write_all(&joined).await.unwrap();
        // close_notify in the middle of a value the reader expects whole.
        peer.write_all(&value(70_000, 3)).await.unwrap();
        peer.shutdown().await.unwrap();
    });
    for v in &values {
        let mut l = [0u8; 4];
        rd.read_exact(&mut l).await.unwrap();
        let mut got = vec![0u8; u32::from_le_bytes(l) as usize];
        rd.fill(&mut got, &mut |_| {}).await.unwrap();
        assert!(got == *v, "a value of {} bytes", v.len());
    }
    let (mut a, mut b) = (vec![0u8; 40_000], vec![0u8; 30_000]);
    rd.fill(&mut a, &mut |_| {}).await.unwrap();
    rd.fill(&mut b, &mut |_| {}).await.unwrap();
    assert!(a == value(40_000, 1) && b == value(30_000, 2));
    let mut whole = vec![0u8; 100_000];
    let mut landed = Vec::new();
    let e = rd.fill(&mut whole, &mut |p| landed.extend_from_slice(p)).await.unwrap_err();
    assert!(matches!(e, RecordError::Ended), "close_notify mid-value: {e}");
    assert!(landed == value(70_000, 3), "what came before close_notify, whole");
    writer.await.unwrap();
}

/// Pieces as the channel sends them, read back by rustls byte for byte, then a clean end.
async fn ours_to_rustls<S: AsyncReadExt + Unpin>(mut wr: RecordWriter<tokio::net::tcp::OwnedWriteHalf>, mut peer: S) {
    let vals: Vec<Vec<u8>> =
        [0usize, 1, 1025, 16_384, 16_385, 262_145, (1 << 20) + 7].iter().map(|&n| value(n, 9 + n as u64)).collect();
    let mut want = b"frame".to_vec();
    for v in &vals {
        want.extend_from_slice(b"len!");
        want.extend_from_slice(v);
    }
    let writer = tokio::spawn(async move {
        let mut pieces = vec![Piece::Small(b"frame")];
        for v in &vals {
            pieces.push(Piece::Small(b"len!"));
            pieces.push(Piece::Value(v));
        }
        send_all(&mut wr, &pieces).await.unwrap();
        wr.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    peer.read_to_end(&mut got).await.unwrap();
    assert!(got == want, "rustls read {} bytes, {} sent", got.len(), want.len());
    writer.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rustls_client_and_our_server_records() {
    let ((rd, wr), cli) = ours_as_server().await;
    let (cr, cw) = tokio::io::split(cli);
    tokio::join!(rustls_to_ours(cw, rd), ours_to_rustls(wr, cr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_records_and_a_rustls_server() {
    let ((rd, wr), srv) = ours_as_client().await;
    let (sr, sw) = tokio::io::split(srv);
    tokio::join!(rustls_to_ours(sw, rd), ours_to_rustls(wr, sr));
}

const SUITES: [::rustls::CipherSuite; 3] = [
    ::rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
    ::rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
    ::rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
];

/// The rustls end updates its keys mid-stream, asking for ours (`refresh_traffic_keys` sends
/// `update_requested`): what it sends after reads on, and our writer answers with a
/// `KeyUpdate` of its own that rustls follows; then ours asks, and rustls's answer (one
/// without `update_requested`) is followed too. Every suite, both roles.
async fn updates_both_ways<P: AsyncReadExt + AsyncWriteExt + Unpin>(ours: Ours, mut peer: P, refresh: fn(&mut P)) {
    let (mut rd, mut wr) = ours;
    peer.write_all(b"before").await.unwrap();
    peer.flush().await.unwrap();
    refresh(&mut peer);
    let v = value(100_003, 5);
    peer.write_all(b"after").await.unwrap();
    peer.write_all(&v).await.unwrap();
    peer.flush().await.unwrap();
    let mut b = [0u8; 11];
    rd.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"beforeafter");
    let mut got = vec![0u8; v.len()];
    rd.fill(&mut got, &mut |_| {}).await.unwrap();
    assert!(got == v);
    assert_eq!(rd.key_updates(), 1);
    // An update in the middle of a value the reader fills at once.
    peer.write_all(&v[..50_000]).await.unwrap();
    refresh(&mut peer);
    peer.write_all(&v[50_000..]).await.unwrap();
    peer.flush().await.unwrap();
    rd.fill(&mut got, &mut |_| {}).await.unwrap();
    assert!(got == v);
    assert_eq!(rd.key_updates(), 2);

    send_all(&mut wr, &[Piece::Small(b"answer"), Piece::Value(&v)]).await.unwrap();
    assert_eq!(wr.key_updates(), 1, "the update rustls asked for");
    let mut a = vec![0u8; 6 + v.len()];
    peer.read_exact(&mut a).await.unwrap();
    assert!(a.starts_with(b"answer") && a[6..] == v[..]);

    wr.update_keys(true).unwrap();
    send_all(&mut wr, &[Piece::Small(b"asked")]).await.unwrap();
    let mut a = [0u8; 5];
    peer.read_exact(&mut a).await.unwrap();
    assert_eq!(&a, b"asked");
    // rustls answers before its next data.
    peer.write_all(b"answered").await.unwrap();
    peer.flush().await.unwrap();
    let mut a = [0u8; 8];
    rd.read_exact(&mut a).await.unwrap();
    assert_eq!(&a, b"answered");
    assert_eq!((rd.key_updates(), wr.key_updates()), (3, 2), "an answer without update_requested asks for none");
    send_all(&mut wr, &[Piece::Small(b"x")]).await.unwrap();
    assert_eq!(wr.key_updates(), 2);
    wr.shutdown().await.unwrap();
    let mut rest = Vec::new();
    peer.read_to_end(&mut rest).await.unwrap();
    assert_eq!(rest, b"x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_updates_both_ways_with_a_rustls_client() {
    for suite in SUITES {
        let (ours, cli) = ours_as_server_with(Some(suite)).await;
        updates_both_ways(ours, cli, |c| c.get_mut().1.refresh_traffic_keys().unwrap()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_updates_both_ways_with_a_rustls_server() {
    for suite in SUITES {
        let (ours, srv) = ours_as_client_with(Some(suite)).await;
        updates_both_ways(ours, srv, |s| s.get_mut().1.refresh_traffic_keys().unwrap()).await;
    }
}

/// Keys rustls extracted with no logged secret behind them are refused, not used blindly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_without_their_secrets_are_refused() {
    let (srv, _, _cli, _) = bound(None).await;
    let (tcp, conn) = srv.into_inner();
    let other = SecretLog::new(Arc::new(::rustls::NoKeyLog));
    let e = tls(tcp, conn.dangerous_extract_secrets().unwrap(), &other).err().unwrap();
    assert!(matches!(e, RecordError::Secrets(_)), "{e}");
}

/// A rustls client whose record is corrupted on the way: our reader fails, our writer sends
/// `bad_record_mac`, and rustls reads that alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_record_is_answered_with_bad_record_mac() {
    let ((mut rd, mut wr), mut cli) = ours_as_server().await;
    {
        let (tcp, conn) = cli.get_mut();
        std::io::Write::write_all(&mut conn.writer(), b"tampered").unwrap();
        let mut rec = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut rec).unwrap();
        }
        let last = rec.len() - 1;
        rec[last] ^= 1;
        tcp.write_all(&rec).await.unwrap();
    }
    let e = rd.fill(&mut [0u8; 8], &mut |_| {}).await.unwrap_err();
    assert!(matches!(e, RecordError::BadRecordMac), "{e}");
    send_alert(&mut wr).await;
    let mut buf = [0u8; 8];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), cli.read(&mut buf));
    let e = read.await.expect("an alert, not silence").unwrap_err();
    let alert = e.into_inner().unwrap().downcast::<::rustls::Error>().unwrap();
    assert!(
        matches!(*alert, ::rustls::Error::AlertReceived(::rustls::AlertDescription::BadRecordMac)),
        "rustls saw {alert:?}"
    );
}
