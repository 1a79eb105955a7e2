//! The same-host control channel against a real server: a same-host client sends its requests on
//! the Unix control socket (and gets the same answers as over QUIC); the socket refuses unknown
//! tokens, oversized envelopes and over-long answers with typed errors and keeps serving; its
//! sockets close with their QUIC connection; a token acts for its own tenant only.

use kvpool_client::{Client, ClientConfig, ErrorCode, PutMode, PutOptions, RawConnection, TransportChoice};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{codec, Hello, KeysRequest, LocalOffer, LookupRequest, Ping, Request, Response};
use kvpool_tests::{metric, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

fn cfg_on(srv: &TestServer, key: &str, t: TransportChoice) -> ClientConfig {
    srv.client_config_on(key, t)
}

/// A version 2 QUIC connection that asked for the control channel.
async fn attached(srv: &TestServer, key: &str) -> (RawConnection, LocalOffer) {
    let raw = RawConnection::connect(&cfg_on(srv, key, TransportChoice::Quic)).await.unwrap();
    let h = Request::Hello(Hello { version: 2, api_key: key.into(), client_name: "local-test".into() });
    assert!(matches!(raw.request(&h).await.unwrap(), Response::Hello(_)));
    match raw.request(&Request::LocalAttach).await.unwrap() {
        Response::LocalOffer(o) => (raw, o),
        other => panic!("{other:?}"),
    }
}

/// Connect and present a token: `Ok` when bound, else the refusal's error frame.
async fn bind(offer: &LocalOffer, token: &[u8]) -> Result<UnixStream, Response> {
    let mut s = UnixStream::connect(&offer.socket_path).await.unwrap();
    s.write_all(token).await.unwrap();
    let mut status = [0u8; 1];
    s.read_exact(&mut status).await.unwrap();
    if status[0] == 0 {
        return Ok(s);
    }
    Err(kvpool_proto::frame::read_message::<_, Response>(&mut s, 1 << 20).await.unwrap())
}

/// One envelope out, one back: (end marker, reset code, body).
async fn exchange(s: &mut UnixStream, body: &[u8]) -> std::io::Result<(u8, u32, Vec<u8>)> {
    s.write_all(&(body.len() as u32).to_le_bytes()).await?;
    s.write_all(body).await?;
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await?;
    let len = u32::from_le_bytes(head[5..9].try_into().unwrap()) as usize;
    let mut out = vec![0u8; len];
    s.read_exact(&mut out).await?;
    Ok((head[0], u32::from_le_bytes(head[1..5].try_into().unwrap()), out))
}

async fn request(s: &mut UnixStream, req: &Request) -> Response {
    let (end, _, body) = exchange(s, &encode_frame(req).unwrap()).await.unwrap();
    assert_eq!(end, 0, "finished, not reset");
    codec::decode::<Response>(&body[4..]).unwrap()
}

fn code_of(r: &Response) -> ErrorCode {
    match r {
        Response::Error(e) => e.code,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_client_sends_requests_on_the_control_socket() {
    let srv = TestServer::start(Opts::default());
    let local = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Shm)).await.unwrap();
    assert_eq!((local.transport_in_use(), local.control_in_use()), ("shm", "local"));
    let quic = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
    assert_eq!(quic.control_in_use(), "quic");
    let before = metric(&srv.scrape(), "kvpool_local_requests_total");

    // A chain of 8 put through shared buffers, half of it looked up, read back, removed.
    let keys: Vec<String> = (0..8).map(|i| format!("lc-{i}")).collect();
    let mut buf = local.alloc_buffer(8 * 1000).unwrap();
    for (i, k) in keys.iter().enumerate() {
        buf.as_mut_slice()[i * 1000..(i + 1) * 1000].copy_from_slice(&value_for(k, 1000));
    }
    let entries: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let parent = (i > 0).then(|| keys[i - 1].as_bytes().to_vec());
            (k.clone(), buf.slice(i * 1000, 1000).unwrap(), PutOptions { parent, ..Default::default() })
        })
        .collect();
    let st = local.put_from_batch(&entries, PutMode::Insert).await.unwrap();
    assert!(st.iter().all(|s| *s == ErrorCode::Ok), "{st:?}");
    assert_eq!(local.lookup(&keys).await.unwrap(), 8);
    assert_eq!(quic.lookup(&keys).await.unwrap(), 8, "the same pool seen over QUIC");
    let mut probe = keys.clone();
    probe.insert(4, "absent".into());
    assert_eq!(local.lookup(&probe).await.unwrap(), quic.lookup(&probe).await.unwrap());
    assert_eq!(local.exists(&["lc-3", "nope"]).await.unwrap(), vec![true, false]);
    let dst = local.alloc_buffer(1000).unwrap();
    let got = local.get_into_batch(&["lc-5"], &[dst.slice(0, 1000).unwrap()]).await.unwrap();
    assert_eq!(got[0].status, ErrorCode::Ok);
    assert_eq!(dst.as_slice(), &value_for("lc-5", 1000)[..]);
    // Typed errors come back typed and leave the socket usable.
    let e = local.remove("nope", false).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    local.remove("lc-7", false).await.unwrap();
    assert_eq!(quic.lookup(&keys).await.unwrap(), 7);
    assert!(local.ping().await.unwrap() < Duration::from_secs(1));
    assert_eq!(local.stats().await.unwrap().blocks, 7);
    // In-band puts and gets of small values work on a same-host connection too.
    local.put("small", b"hello").await.unwrap();
    assert_eq!(local.get("small").await.unwrap().unwrap(), b"hello");

    let after = metric(&srv.scrape(), "kvpool_local_requests_total");
    assert!(after - before >= 10.0, "requests went over the control socket: {before} -> {after}");
    assert_eq!(local.control_in_use(), "local");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_socket_refuses_bad_input_with_typed_errors_and_keeps_serving() {
    let srv = TestServer::start(Opts::default());
    let (_raw, offer) = attached(&srv, ADMIN_KEY).await;
    assert_eq!(offer.token.len(), 32);

    // An unknown token.
    assert_eq!(code_of(&bind(&offer, &[7u8; 32]).await.unwrap_err()), ErrorCode::Unauthorized);
    // A bound socket: garbage, an unknown message and a hello are answered and the socket lives.
    let mut s = bind(&offer, &offer.token).await.unwrap();
    let (end, _, body) = exchange(&mut s, b"\x03\x00\x00\x00abc").await.unwrap();
    assert_eq!(end, 0);
    assert_eq!(code_of(&codec::decode::<Response>(&body[4..]).unwrap()), ErrorCode::Malformed);
    let (_, _, body) = exchange(&mut s, b"\x04\x00\x00\x00\xff\xff\x00\x00").await.unwrap();
    assert_eq!(code_of(&codec::decode::<Response>(&body[4..]).unwrap()), ErrorCode::UnknownMessage);
    let hello = Request::Hello(Hello { version: 2, api_key: BOB_KEY.into(), client_name: "x".into() });
    assert_eq!(code_of(&request(&mut s, &hello).await), ErrorCode::Malformed);
    // Bytes after the frame of a request that declares none.
    let mut trailing = encode_frame(&Request::Ping(Ping { nonce: 1 })).unwrap();
    trailing.extend_from_slice(b"junk");
    let (_, _, body) = exchange(&mut s, &trailing).await.unwrap();
    assert_eq!(code_of(&codec::decode::<Response>(&body[4..]).unwrap()), ErrorCode::Malformed);
    assert!(matches!(request(&mut s, &Request::Ping(Ping { nonce: 9 })).await, Response::Pong(p) if p.nonce == 9));
    // What binds a channel to the QUIC connection, or answers with a stream, belongs on QUIC (the
    // request table says so): here it is refused, and the socket lives on.
    assert_eq!(code_of(&request(&mut s, &Request::LocalAttach).await), ErrorCode::InvalidArgument);
    let bulk = Request::BulkAttach(kvpool_proto::BulkAttachRequest { plaintext: false });
    assert_eq!(code_of(&request(&mut s, &bulk).await), ErrorCode::InvalidArgument);
    let sub = Request::Subscribe(kvpool_proto::SubscribeRequest {
        from: None,
        scope: kvpool_proto::EventScope::Tenant,
        max_batch: 0,
    });
    assert_eq!(code_of(&request(&mut s, &sub).await), ErrorCode::InvalidArgument);
    assert!(matches!(request(&mut s, &Request::Ping(Ping { nonce: 10 })).await, Response::Pong(p) if p.nonce == 10));

    // An answer longer than the channel carries (a value just over its limit, fetched in band).
    let c = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
    let big = value_for("big", offer.max_response as usize + 1);
    c.put("big", &big).await.unwrap();
    let get = Request::Get(KeysRequest { keys: vec![b"big".to_vec()] });
    assert_eq!(code_of(&request(&mut s, &get).await), ErrorCode::ValueTooLarge);
    assert_eq!(c.get("big").await.unwrap().unwrap(), big, "the block is intact");

    // An envelope over the announced limit: a typed error, then the server closes the socket.
    s.write_all(&(offer.max_request + 1).to_le_bytes()).await.unwrap();
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(head[5..9].try_into().unwrap()) as usize];
    s.read_exact(&mut body).await.unwrap();
    assert_eq!(code_of(&codec::decode::<Response>(&body[4..]).unwrap()), ErrorCode::FrameTooLarge);
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).await.unwrap(), 0, "closed after the refusal");

    // A client that stalls before its token is dropped; the pool keeps serving.
    let mut idle = UnixStream::connect(&offer.socket_path).await.unwrap();
    idle.write_all(&offer.token[..10]).await.unwrap();
    let mut s2 = bind(&offer, &offer.token).await.unwrap();
    assert!(matches!(request(&mut s2, &Request::Ping(Ping { nonce: 2 })).await, Response::Pong(_)));
    assert_eq!(c.get("big").await.unwrap().unwrap(), big);
    assert!(metric(&srv.scrape(), "kvpool_local_refused_total") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_sockets_close_with_their_connection() {
    let srv = TestServer::start(Opts::default());
    let (raw, offer) = attached(&srv, ADMIN_KEY).await;
    let mut s = bind(&offer, &offer.token).await.unwrap();
    assert!(matches!(request(&mut s, &Request::Ping(Ping { nonce: 1 })).await, Response::Pong(_)));
    // Attaching again replaces the token: sockets bound with the old one close.
    let second = match raw.request(&Request::LocalAttach).await.unwrap() {
        Response::LocalOffer(o) => o,
        other => panic!("{other:?}"),
    };
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("closed").unwrap();
    assert_eq!(n, 0);
    assert_eq!(code_of(&bind(&offer, &offer.token).await.unwrap_err()), ErrorCode::Unauthorized);
    let mut s = bind(&second, &second.token).await.unwrap();
    assert!(matches!(request(&mut s, &Request::Ping(Ping { nonce: 2 })).await, Response::Pong(_)));
    // The QUIC connection ends: so do its sockets and its token.
    raw.close();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("closed").unwrap();
    assert_eq!(n, 0);
    assert_eq!(code_of(&bind(&second, &second.token).await.unwrap_err()), ErrorCode::Unauthorized);
    // At most 64 sockets per connection.
    let (_raw, offer) = attached(&srv, ADMIN_KEY).await;
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(bind(&offer, &offer.token).await.unwrap());
    }
    assert_eq!(code_of(&bind(&offer, &offer.token).await.unwrap_err()), ErrorCode::Rejected);
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut again = bind(&offer, &offer.token).await.unwrap();
    assert!(matches!(request(&mut again, &Request::Ping(Ping { nonce: 3 })).await, Response::Pong(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_without_a_token_holds_64_sockets_and_others_still_bind() {
    use std::io::BufRead;
    let srv = TestServer::start(Opts::default());
    let (_raw, offer) = attached(&srv, ADMIN_KEY).await;
    // Another process opens 100 sockets and never presents a token: the server keeps 64 of them
    // (until their 5 s run out) and closes the others at once.
    let mut hog = std::process::Command::new(kvpool_tests::bin("kvpool-socket-hog"))
        .args([offer.socket_path.as_str(), "100"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(hog.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "held 64", "a process's share of the sockets waiting for a token");
    // Meanwhile this process binds a socket and is served.
    let mut s = bind(&offer, &offer.token).await.unwrap();
    assert!(matches!(request(&mut s, &Request::Ping(Ping { nonce: 4 })).await, Response::Pong(_)));
    assert!(metric(&srv.scrape(), "kvpool_local_refused_total") >= 36.0);
    drop(hog.stdin.take());
    hog.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_acts_for_its_own_tenant_only() {
    let srv = TestServer::start(Opts::default());
    let alice = Client::connect(cfg_on(&srv, ALICE_KEY, TransportChoice::Quic)).await.unwrap();
    alice.put("a-secret", b"alice!").await.unwrap();
    let (_bob_raw, bob) = attached(&srv, BOB_KEY).await;
    let mut s = bind(&bob, &bob.token).await.unwrap();
    let lookup = Request::Lookup(LookupRequest { chain: vec![b"a-secret".to_vec()] });
    assert!(matches!(request(&mut s, &lookup).await, Response::Lookup(l) if l.resident == 0));
    let exists = Request::Exists(KeysRequest { keys: vec![b"a-secret".to_vec()] });
    assert!(matches!(request(&mut s, &exists).await, Response::Exists(e) if e.present == vec![false]));
    let remove = Request::Remove(kvpool_proto::RemoveRequest { keys: vec![b"a-secret".to_vec()], force: true });
    assert!(matches!(request(&mut s, &remove).await, Response::Remove(l) if l.results == vec![ErrorCode::NotFound]));
    // Bob's socket cannot load policies (not an admin) either.
    assert_eq!(code_of(&request(&mut s, &Request::PolicyList).await), ErrorCode::Forbidden);
    assert_eq!(alice.get("a-secret").await.unwrap().unwrap(), b"alice!");
    // A version 1 connection is not offered the channel.
    let raw = RawConnection::connect(&cfg_on(&srv, ALICE_KEY, TransportChoice::Quic)).await.unwrap();
    let h = Request::Hello(Hello { version: 1, api_key: ALICE_KEY.into(), client_name: "v1".into() });
    assert!(matches!(raw.request(&h).await.unwrap(), Response::Hello(_)));
    assert_eq!(code_of(&raw.request(&Request::LocalAttach).await.unwrap()), ErrorCode::Unsupported);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_only_server_offers_no_control_socket() {
    let srv = TestServer::start(Opts { extra: "[transport]\nprotocol = \"quic\"\n".into(), ..Opts::default() });
    let c = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Auto)).await.unwrap();
    assert_eq!((c.transport_in_use(), c.control_in_use()), ("quic", "quic"));
    c.put("k", b"v").await.unwrap();
    assert_eq!(c.lookup(&["k"]).await.unwrap(), 1);
    let (raw, _) = {
        let raw = RawConnection::connect(&cfg_on(&srv, ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
        let h = Request::Hello(Hello { version: 2, api_key: ADMIN_KEY.into(), client_name: "t".into() });
        assert!(matches!(raw.request(&h).await.unwrap(), Response::Hello(_)));
        (raw, ())
    };
    assert_eq!(code_of(&raw.request(&Request::LocalAttach).await.unwrap()), ErrorCode::Unsupported);
}

/// The two hex dumps of PROTOCOL.md section 11.6 (request envelope, answer envelope).
fn documented_dumps() -> (Vec<u8>, Vec<u8>) {
    let doc = include_str!("../../docs/PROTOCOL.md");
    let start = doc.find("### 11.6 Same-host control channel").expect("section 11.6");
    let end = start + doc[start..].find("### 11.5").expect("11.5 follows 11.6");
    let blocks: Vec<Vec<u8>> = doc[start..end]
        .split("```")
        .skip(1)
        .step_by(2)
        .map(|t| kvpool_proto::parse_hex_dump(t).expect("hex"))
        .collect();
    assert_eq!(blocks.len(), 2, "two dumps in section 11.6");
    (blocks[0].clone(), blocks[1].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_envelope_bytes_are_what_the_server_answers() {
    let srv = TestServer::start(Opts::default());
    let (_raw, offer) = attached(&srv, ADMIN_KEY).await;
    let (ask, want) = documented_dumps();
    let lookup = Request::Lookup(LookupRequest { chain: vec![b"k".to_vec()] });
    assert_eq!(&ask[4..], &encode_frame(&lookup).unwrap()[..]);
    let mut s = bind(&offer, &offer.token).await.unwrap();
    s.write_all(&ask).await.unwrap();
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_calls_share_the_sockets_and_all_succeed() {
    let srv = TestServer::start(Opts::default());
    let c = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Shm)).await.unwrap();
    assert_eq!(c.control_in_use(), "local");
    c.put("shared", b"v").await.unwrap();
    // More calls at once than the server binds sockets per connection.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..300 {
        let c = c.clone();
        calls.spawn(async move { c.exists(&["shared", &format!("absent-{i}")]).await });
    }
    while let Some(r) = calls.join_next().await {
        assert_eq!(r.unwrap().unwrap(), vec![true, false]);
    }
    assert_eq!(c.control_in_use(), "local", "the channel is still in use");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answers_loses_the_socket_not_the_pool() {
    let srv = TestServer::start(Opts { extra: "[limits]\nrequest_timeout_ms = 300\n".into(), ..Opts::default() });
    let c = Client::connect(cfg_on(&srv, ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
    let big = value_for("big", 2 << 20);
    c.put("big", &big).await.unwrap();
    let (_raw, offer) = attached(&srv, ADMIN_KEY).await;
    let mut s = bind(&offer, &offer.token).await.unwrap();
    // Gets of 2 MiB, never read: the socket buffer fills, the server's write waits, then gives up.
    let get = encode_frame(&Request::Get(KeysRequest { keys: vec![b"big".to_vec()] })).unwrap();
    let mut env = (get.len() as u32).to_le_bytes().to_vec();
    env.extend_from_slice(&get);
    for _ in 0..4 {
        if s.write_all(&env).await.is_err() {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("closed in time");
    assert!(read.is_err() || rest.len() < 4 * (2 << 20), "the server stopped answering a client that does not read");
    assert_eq!(c.get("big").await.unwrap().unwrap(), big, "the pool serves on");
}
