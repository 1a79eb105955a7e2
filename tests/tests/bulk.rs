//! The TCP bulk channel against a real server: puts and gets through the client over TLS and
//! over plaintext where both sides trust the network, and its door: tokens that are unknown,
//! used, from another address or of an ended connection are refused and leak nothing.

use kvpool_client::{BulkChoice, Client, GetIntoResult, PutEntry, RawConnection, TransportChoice, Trust};
use kvpool_proto::frame::{encode_frame, read_message};
use kvpool_proto::{
    BulkAttachRequest, BulkOffer, ErrorCode, EventScope, Hello, KeysRequest, PutMode, Request, Response,
    SubscribeRequest, PROTOCOL_VERSION,
};
use kvpool_tests::{metric, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

fn bulk_config(srv: &TestServer, trusted: &[&str]) -> kvpool_client::ClientConfig {
    let mut cfg = srv.client_config_on(ADMIN_KEY, TransportChoice::Quic);
    cfg.bulk = BulkChoice::Tcp;
    cfg.trusted_networks = trusted.iter().map(|n| n.parse().unwrap()).collect();
    cfg
}

fn moved(srv: &TestServer, transport: &str, direction: &str) -> f64 {
    metric(
        &srv.scrape(),
        &format!("kvpool_transfer_bytes_total{{direction=\"{direction}\",transport=\"{transport}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_and_gets_cross_the_tls_channel_and_small_puts_stay_on_quic() {
    let srv = TestServer::start(Opts::default());
    let c = Client::connect(bulk_config(&srv, &[])).await.unwrap();
    assert_eq!(c.transport_in_use(), "quic", "nothing opened yet");
    let big = value_for("big", 3 << 20);
    c.put("big", &big).await.unwrap();
    assert_eq!(c.transport_in_use(), "tls");
    let values: Vec<Vec<u8>> = (0..8).map(|i| value_for(&format!("b{i}"), 256 << 10)).collect();
    let keys: Vec<String> = (0..8).map(|i| format!("b{i}")).collect();
    let entries: Vec<PutEntry> = keys.iter().zip(&values).map(|(k, v)| PutEntry::new(k.as_bytes(), v)).collect();
    assert!(c.put_batch(&entries, PutMode::Insert).await.unwrap().iter().all(|s| *s == ErrorCode::Ok));
    let quic_in = moved(&srv, "quic", "in");
    c.put("small", &value_for("small", 4096)).await.unwrap();
    assert_eq!(moved(&srv, "quic", "in") - quic_in, 4096.0, "a 4 KiB put stays on QUIC");
    assert!(moved(&srv, "tls", "in") >= (5 << 20) as f64, "the large puts came over TLS");

    assert_eq!(c.get("big").await.unwrap().unwrap(), big);
    let got = c.get_batch(&keys).await.unwrap();
    assert!(got.iter().zip(&values).all(|(g, v)| g.value.as_ref() == Some(v)));
    assert!(moved(&srv, "tls", "out") >= (5 << 20) as f64, "the gets went out over TLS");
    // Into caller buffers: one fits, one is too small (its bytes are skipped, the stream goes on).
    let (mut a, mut b) = (vec![0u8; 256 << 10], vec![0u8; 1000]);
    let r = c.get_batch_into(&["b0", "b1", "nope"], &mut [&mut a[..], &mut b[..], &mut [][..]]).await.unwrap();
    assert_eq!(r[0], GetIntoResult { status: ErrorCode::Ok, size: 256 << 10, tier: 1, lease_ms: r[0].lease_ms });
    assert_eq!((r[1].status, r[2].status), (ErrorCode::ValueTooLarge, ErrorCode::NotFound));
    assert_eq!(a, values[0]);
    // The same connection goes on after an item-level refusal.
    assert_eq!(c.put("big", &big).await.unwrap_err().code(), ErrorCode::AlreadyExists);
    assert_eq!(c.get("big").await.unwrap().unwrap(), big);
    // Another tenant's channel sees its own key space only.
    let mut cfg = bulk_config(&srv, &[]);
    cfg.api_key = ALICE_KEY.into();
    let alice = Client::connect(cfg).await.unwrap();
    assert_eq!(alice.get("big").await.unwrap(), None);
    assert_eq!(alice.transport_in_use(), "tls");
    let text = srv.scrape();
    assert!(metric(&text, "kvpool_bulk_requests_total") >= 8.0);
    // One call at a time: one connection per client, kept between calls.
    assert_eq!(metric(&text, "kvpool_bulk_connections_total"), 2.0);

    // 80 calls at once, more than the server's 64 connections per session: at most 32 open,
    // the rest over QUIC, every answer right, and the channel stays up.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..80 {
        let (c, i) = (c.clone(), i % 8);
        calls.spawn(async move { (i, c.get(format!("b{i}")).await) });
    }
    while let Some(r) = calls.join_next().await {
        let (i, got) = r.unwrap();
        assert_eq!(got.unwrap().as_ref(), Some(&values[i]));
    }
    assert_eq!(c.transport_in_use(), "tls");
    assert!(metric(&srv.scrape(), "kvpool_bulk_connections_total") <= 2.0 + 32.0);
    assert_eq!(c.get("big").await.unwrap().unwrap(), big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_only_where_both_sides_trust_the_network() {
    let trusting =
        TestServer::start(Opts { extra: "[bulk]\ntrusted_networks = [\"127.0.0.0/8\"]\n".into(), ..Opts::default() });
    let v = value_for("p", 1 << 20);
    // Both trust: plaintext TCP.
    let c = Client::connect(bulk_config(&trusting, &["127.0.0.0/8"])).await.unwrap();
    c.put("p", &v).await.unwrap();
    assert_eq!(
        moved(&trusting, "tcp", "in"),
        (1 << 20) as f64,
        "quic {} tls {} via {}",
        moved(&trusting, "quic", "in"),
        moved(&trusting, "tls", "in"),
        c.transport_in_use()
    );
    assert_eq!(c.transport_in_use(), "tcp");
    // Only the server trusts: TLS.
    let c = Client::connect(bulk_config(&trusting, &[])).await.unwrap();
    assert_eq!(c.get("p").await.unwrap().unwrap(), v);
    assert_eq!(moved(&trusting, "tls", "out"), (1 << 20) as f64);
    // Only the client trusts: TLS.
    let strict = TestServer::start(Opts::default());
    let c = Client::connect(bulk_config(&strict, &["127.0.0.0/8"])).await.unwrap();
    c.put("p", &v).await.unwrap();
    assert_eq!((moved(&strict, "tls", "in"), moved(&strict, "tcp", "in")), ((1 << 20) as f64, 0.0));
}

/// Batches on the plaintext channel, values of every size behind one another: each value's
/// last bytes come in one read with what follows them (the next chunk's length, the end of
/// the answer, on the client; the next value, on the server), and every byte lands right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_batches_of_mixed_sizes_read_back_whole() {
    let srv =
        TestServer::start(Opts { extra: "[bulk]\ntrusted_networks = [\"127.0.0.0/8\"]\n".into(), ..Opts::default() });
    let c = Client::connect(bulk_config(&srv, &["127.0.0.0/8"])).await.unwrap();
    let sizes = [65_536, 65_537, 1, 262_144, 100, 300_001, 1 << 20, 64 << 10, 4097, (1 << 20) + 3];
    let keys: Vec<String> = (0..sizes.len()).map(|i| format!("m{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().zip(sizes).map(|(k, n)| value_for(k, n)).collect();
    let entries: Vec<PutEntry> = keys.iter().zip(&values).map(|(k, v)| PutEntry::new(k.as_bytes(), v)).collect();
    assert!(c.put_batch(&entries, PutMode::Insert).await.unwrap().iter().all(|s| *s == ErrorCode::Ok));
    assert_eq!(c.transport_in_use(), "tcp");
    assert_eq!(moved(&srv, "tcp", "in"), sizes.iter().sum::<usize>() as f64, "the values came over plaintext TCP");
    for _ in 0..3 {
        let got = c.get_batch(&keys).await.unwrap();
        assert!(got.iter().zip(&values).all(|(g, v)| g.value.as_ref() == Some(v)));
    }
    // Into buffers, one too small (its bytes are read past), then the connection goes on.
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    bufs[3] = vec![0u8; 10];
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let r = c.get_batch_into(&keys, &mut views).await.unwrap();
    for (i, g) in r.iter().enumerate() {
        if i == 3 {
            assert_eq!(g.status, ErrorCode::ValueTooLarge);
        } else {
            assert_eq!((g.status, &bufs[i]), (ErrorCode::Ok, &values[i]), "value {i}");
        }
    }
    assert_eq!(c.get("m6").await.unwrap().unwrap(), values[6]);
    assert_eq!(metric(&srv.scrape(), "kvpool_bulk_connections_total"), 1.0, "one connection all along");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_channel_the_bytes_go_over_quic() {
    let srv = TestServer::start(Opts { extra: "[bulk]\ntcp = false\n".into(), ..Opts::default() });
    let c = Client::connect(bulk_config(&srv, &[])).await.unwrap();
    let v = value_for("q", 1 << 20);
    let t = std::time::Instant::now();
    c.put("q", &v).await.unwrap();
    assert_eq!(c.get("q").await.unwrap().unwrap(), v);
    assert!(t.elapsed() < Duration::from_secs(2), "no wait for a channel that is not offered");
    assert_eq!(c.transport_in_use(), "quic");
    assert_eq!(moved(&srv, "quic", "in"), (1 << 20) as f64);
}

// ---- the door, driven by hand --------------------------------------------------------------

async fn session(srv: &TestServer) -> RawConnection {
    session_of(srv, ADMIN_KEY).await
}

async fn session_of(srv: &TestServer, key: &str) -> RawConnection {
    let r = RawConnection::connect(&srv.client_config(key)).await.unwrap();
    let h = Request::Hello(Hello { version: PROTOCOL_VERSION, api_key: key.into(), client_name: "t".into() });
    assert!(matches!(r.request(&h).await.unwrap(), Response::Hello(_)));
    r
}

async fn offer(r: &RawConnection, plaintext: bool) -> BulkOffer {
    match r.request(&Request::BulkAttach(BulkAttachRequest { plaintext })).await.unwrap() {
        Response::BulkOffer(o) => o,
        other => panic!("{other:?}"),
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A TCP connection to the offer's port, from `from` when given, with TLS when `tls`.
async fn dial(srv: &TestServer, port: u16, from: Option<IpAddr>, tls: bool) -> Box<dyn Io> {
    let tcp = tcp(srv, port, from).await;
    if !tls {
        return Box::new(tcp);
    }
    Box::new(handshake(srv, tcp, vec![kvpool_proto::BULK_ALPN.to_vec()]).await.unwrap())
}

async fn tcp(srv: &TestServer, port: u16, from: Option<IpAddr>) -> TcpStream {
    let ip: IpAddr = srv.addr().parse::<SocketAddr>().unwrap().ip();
    let sock = TcpSocket::new_v4().unwrap();
    if let Some(from) = from {
        sock.bind(SocketAddr::new(from, 0)).unwrap();
    }
    sock.connect(SocketAddr::new(ip, port)).await.unwrap()
}

/// A TLS handshake with the server's certificate, offering `alpn`.
async fn handshake(
    srv: &TestServer,
    tcp: TcpStream,
    alpn: Vec<Vec<u8>>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let cert = std::path::PathBuf::from(srv.endpoint["cert_path"].as_str().unwrap());
    let mut cfg = kvpool_client::tls::rustls_config(&Trust::CaFile(cert)).unwrap();
    cfg.alpn_protocols = alpn;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg)).connect(name, tcp).await
}

/// Present `token`: `Ok` when bound, else the refusal's code (the server then closes).
async fn present<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S, token: &[u8]) -> Result<(), ErrorCode> {
    io.write_all(token).await.unwrap();
    let mut status = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(5), io.read_exact(&mut status)).await.unwrap().unwrap();
    if status[0] == 0 {
        return Ok(());
    }
    match read_message::<_, Response>(io, 1 << 20).await.unwrap() {
        Response::Error(e) => {
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut rest)).await;
            assert!(rest.is_empty(), "nothing after a refusal: {rest:?}");
            Err(e.code)
        }
        other => panic!("{other:?}"),
    }
}

/// One envelope; the answer's chunks joined, and whether it ended (0) or was reset (1).
async fn envelope<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S, bytes: &[u8]) -> (Vec<u8>, u8) {
    io.write_all(&(bytes.len() as u64).to_le_bytes()).await.unwrap();
    io.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    loop {
        let n = io.read_u32_le().await.unwrap();
        if n == u32::MAX {
            let end = io.read_u8().await.unwrap();
            let _code = io.read_u32_le().await.unwrap();
            return (out, end);
        }
        let at = out.len();
        out.resize(at + n as usize, 0);
        io.read_exact(&mut out[at..]).await.unwrap();
    }
}

fn get_frame(key: &str) -> Vec<u8> {
    encode_frame(&Request::Get(KeysRequest { keys: vec![key.into()] })).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_refuses_unknown_used_foreign_and_orphaned_tokens_and_leaks_nothing() {
    let srv = TestServer::start(Opts::default());
    let secret = value_for("secret", 200_000);
    Client::connect(srv.client_config(ADMIN_KEY)).await.unwrap().put("secret", &secret).await.unwrap();
    let r = session(&srv).await;
    let o = offer(&r, false).await;
    assert!(o.tls, "plaintext is never granted by default");

    // A token nobody issued.
    let mut io = dial(&srv, o.port, None, true).await;
    assert_eq!(present(&mut io, &[7u8; 32]).await, Err(ErrorCode::Unauthorized));
    // A good token from another address is refused, and spent: its owner cannot use it either.
    let mut io = dial(&srv, o.port, Some("127.0.0.2".parse().unwrap()), true).await;
    assert_eq!(present(&mut io, &o.token).await, Err(ErrorCode::Unauthorized));
    let mut io = dial(&srv, o.port, None, true).await;
    assert_eq!(present(&mut io, &o.token).await, Err(ErrorCode::Unauthorized));

    // Plaintext to a server that does not trust this network: the TLS handshake fails on the
    // token's bytes; the request that follows is never answered, and the token is not spent.
    let o = offer(&r, true).await;
    assert!(o.tls);
    let mut plain = dial(&srv, o.port, None, false).await;
    let mut probe = o.token.clone();
    probe.extend_from_slice(&(get_frame("secret").len() as u64).to_le_bytes());
    probe.extend_from_slice(&get_frame("secret"));
    let _ = plain.write_all(&probe).await;
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(6), plain.read_to_end(&mut seen)).await;
    assert!(!seen.windows(64).any(|w| secret.windows(64).next() == Some(w)), "no value bytes in the clear");
    assert!(seen.first() != Some(&0), "never bound: {seen:?}");

    // The right token, over TLS, from the right address: bound once, and serves.
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
    let (answer, end) = envelope(&mut io, &get_frame("secret")).await;
    assert_eq!(end, 0);
    let (resp, rest) = kvpool_client::parse_reply(&answer).unwrap();
    assert!(matches!(resp, Response::Get(_)));
    assert_eq!(rest, &secret[..]);
    // Used: a second connection with it is refused.
    let mut again = dial(&srv, o.port, None, true).await;
    assert_eq!(present(&mut again, &o.token).await, Err(ErrorCode::Unauthorized));

    // What must be asked on QUIC is refused on the channel, which goes on serving.
    let sub = Request::Subscribe(SubscribeRequest { from: None, scope: EventScope::Tenant, max_batch: 0 });
    let (answer, _) = envelope(&mut io, &encode_frame(&sub).unwrap()).await;
    assert!(
        matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Error(e) if e.code == ErrorCode::InvalidArgument)
    );
    let (answer, _) = envelope(&mut io, &get_frame("secret")).await;
    assert_eq!(kvpool_client::parse_reply(&answer).unwrap().1, &secret[..]);
    // Garbage in an envelope is a typed error; so is an empty frame, whatever follows it.
    let (answer, _) = envelope(&mut io, &[9, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]).await;
    assert!(matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Error(_)));
    let mut empty = vec![0, 0, 0, 0];
    empty.extend_from_slice(&get_frame("secret"));
    let (answer, _) = envelope(&mut io, &empty).await;
    assert!(
        matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Error(_)),
        "an empty frame is an error, never the request after it"
    );

    // A token of a connection that has ended; and the ended connection's channel closes.
    let o = offer(&r, false).await;
    let o2 = offer(&r, false).await;
    let mut bound = dial(&srv, o2.port, None, true).await;
    present(&mut bound, &o2.token).await.unwrap();
    r.close();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut io = dial(&srv, o.port, None, true).await;
    assert_eq!(present(&mut io, &o.token).await, Err(ErrorCode::Unauthorized));
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(3), bound.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the channel of an ended connection closes");
    assert!(metric(&srv.scrape(), "kvpool_bulk_refused_total") >= 5.0);

    // Through it all the pool serves.
    let c = Client::connect(srv.client_config(ADMIN_KEY)).await.unwrap();
    assert_eq!(c.get("secret").await.unwrap().unwrap(), secret);
}

/// Past the bind the server follows the client's key updates (answering one that asks with
/// its own), and answers a record that fails its authentication with a `bad_record_mac` alert
/// before it closes that connection; the others go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_channel_follows_key_updates_and_answers_a_bad_record_with_an_alert() {
    let srv = TestServer::start(Opts::default());
    let secret = value_for("secret", 300_000);
    Client::connect(srv.client_config(ADMIN_KEY)).await.unwrap().put("secret", &secret).await.unwrap();
    let r = session(&srv).await;
    let alpn = vec![kvpool_proto::BULK_ALPN.to_vec()];

    let o = offer(&r, false).await;
    let mut kept = handshake(&srv, tcp(&srv, o.port, None).await, alpn.clone()).await.unwrap();
    present(&mut kept, &o.token).await.unwrap();
    for _ in 0..3 {
        // rustls's update asks for the server's (update_requested): its answer comes under
        // its next keys, which rustls follows.
        kept.get_mut().1.refresh_traffic_keys().unwrap();
        let (answer, end) = envelope(&mut kept, &get_frame("secret")).await;
        assert_eq!(end, 0);
        assert_eq!(kvpool_client::parse_reply(&answer).unwrap().1, &secret[..]);
    }

    let o = offer(&r, false).await;
    let mut bad = handshake(&srv, tcp(&srv, o.port, None).await, alpn).await.unwrap();
    present(&mut bad, &o.token).await.unwrap();
    {
        let (tcp, conn) = bad.get_mut();
        let frame = get_frame("secret");
        let mut plain = (frame.len() as u64).to_le_bytes().to_vec();
        plain.extend_from_slice(&frame);
        std::io::Write::write_all(&mut conn.writer(), &plain).unwrap();
        let mut records = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut records).unwrap();
        }
        let last = records.len() - 1;
        records[last] ^= 0x40;
        tcp.write_all(&records).await.unwrap();
    }
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), bad.read_to_end(&mut rest)).await.expect("not left open");
    let e = read.expect_err("an alert, not a clean end");
    let alert = e.into_inner().unwrap().downcast::<rustls::Error>().unwrap();
    assert!(
        matches!(*alert, rustls::Error::AlertReceived(rustls::AlertDescription::BadRecordMac)),
        "the client saw {alert:?}"
    );
    assert!(rest.is_empty(), "no answer to the bad record");

    // The other connection, and the pool, go on.
    let (answer, _) = envelope(&mut kept, &get_frame("secret")).await;
    assert_eq!(kvpool_client::parse_reply(&answer).unwrap().1, &secret[..]);
    let c = Client::connect(bulk_config(&srv, &[])).await.unwrap();
    let big = value_for("big", 3 << 20);
    c.put("big", &big).await.unwrap();
    assert_eq!(c.transport_in_use(), "tls");
    assert_eq!(c.get("big").await.unwrap().unwrap(), big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_hello_without_the_channels_alpn_is_refused_in_the_handshake() {
    let srv = TestServer::start(Opts::default());
    let r = session(&srv).await;
    let o = offer(&r, false).await;
    // As QUIC refuses a handshake without its ALPN, so does the channel: no ALPN at all, or
    // another protocol, is answered with the alert `no_application_protocol`.
    for alpn in [vec![], vec![b"h2".to_vec()]] {
        let shown = format!("{alpn:?}");
        let refused = handshake(&srv, tcp(&srv, o.port, None).await, alpn).await;
        let e = refused.err().unwrap_or_else(|| panic!("a handshake offering {shown} completed"));
        assert!(e.to_string().contains("NoApplicationProtocol"), "{shown}: {e}");
    }
    assert!(metric(&srv.scrape(), "kvpool_bulk_refused_total") >= 2.0);
    // The token was never shown: with the channel's ALPN it binds.
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
    let (answer, end) = envelope(&mut io, &get_frame("absent")).await;
    assert_eq!(end, 0);
    assert!(matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Get(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_bounds_what_a_greedy_session_holds() {
    let srv = TestServer::start(Opts::default());
    // One session holds at most 64 unspent tokens; another session still gets its own.
    let greedy = session(&srv).await;
    for _ in 0..64 {
        offer(&greedy, false).await;
    }
    let ask = Request::BulkAttach(BulkAttachRequest { plaintext: false });
    match greedy.request(&ask).await.unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::Rejected),
        other => panic!("{other:?}"),
    }
    let other = session(&srv).await;
    let o = offer(&other, false).await;
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_take_every_waiting_token() {
    let srv = TestServer::start(Opts::default());
    // One tenant's 64 connections ask for 64 tokens each: 4,096, the size of the whole table.
    let started = std::time::Instant::now();
    let mut asks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let r = session(&srv).await;
        asks.spawn(async move {
            let ask = Request::BulkAttach(BulkAttachRequest { plaintext: false });
            let mut granted = 0;
            for _ in 0..64 {
                match r.request(&ask).await.unwrap() {
                    Response::BulkOffer(_) => granted += 1,
                    Response::Error(e) => assert_eq!(e.code, ErrorCode::Rejected, "{}", e.message),
                    other => panic!("{other:?}"),
                }
            }
            (granted, r)
        });
    }
    let mut granted = 0;
    let mut held = Vec::new();
    while let Some(r) = asks.join_next().await {
        let (n, r) = r.unwrap();
        granted += n;
        held.push(r);
    }
    let took = started.elapsed();
    // Another tenant is still answered with an offer, and binds.
    let alice = session_of(&srv, ALICE_KEY).await;
    let o = offer(&alice, false).await;
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
    // (Tokens are forgotten after 10 s: on a machine that slow, more would have been granted.)
    if took < Duration::from_secs(9) {
        assert_eq!(granted, 1024, "a tenant waits with a quarter of the table at most");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_without_tokens_cannot_close_the_door_to_others() {
    let srv = TestServer::start(Opts::default());
    let r = session(&srv).await;
    let o = offer(&r, false).await;
    // One address opens 256 connections and never shows a token: 64 are held (until their 5 s
    // run out), the others closed at once, unanswered.
    let hog: IpAddr = "127.0.0.2".parse().unwrap();
    let mut idle = Vec::new();
    for _ in 0..256 {
        idle.push(dial(&srv, o.port, Some(hog), false).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut closed = 0;
    for io in &mut idle {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(5), io.read(&mut b)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 256 - 64, "an address's share of the connections waiting for a token");
    // The channel is still open to everyone else: a token from this address binds and serves.
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
    let (answer, end) = envelope(&mut io, &get_frame("absent")).await;
    assert_eq!(end, 0);
    assert!(matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Get(_)));
    drop(idle);

    // In all, 256 connections wait for their token: four addresses' 64 each fill the door, and
    // the next connection is closed at once, unanswered, wherever it comes from.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut idle = Vec::new();
    for a in 2..6 {
        for _ in 0..64 {
            idle.push(dial(&srv, o.port, Some(IpAddr::from([127, 0, 0, a])), false).await);
        }
    }
    let mut late = dial(&srv, o.port, Some("127.0.0.6".parse().unwrap()), false).await;
    let t = std::time::Instant::now();
    let mut seen = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(4), late.read_to_end(&mut seen)).await;
    assert!(matches!(n, Ok(Ok(0))), "closed unanswered at once: {n:?} after {:?}", t.elapsed());
    assert!(metric(&srv.scrape(), "kvpool_bulk_refused_total") >= 193.0);

    // Once they go, a token binds again and the channel serves.
    drop(idle);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let o = offer(&r, false).await;
    let mut io = dial(&srv, o.port, None, true).await;
    present(&mut io, &o.token).await.unwrap();
    let (answer, end) = envelope(&mut io, &get_frame("absent")).await;
    assert_eq!(end, 0);
    assert!(matches!(kvpool_client::parse_reply(&answer).unwrap().0, Response::Get(_)));
}
