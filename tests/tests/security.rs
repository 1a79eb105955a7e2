//! Authentication, tenant isolation, and malformed input of every kind.

use kvpool_client::{Client, RawConnection};
use kvpool_proto::{frame::encode_frame, ErrorCode, Hello, Request, Response, PROTOCOL_VERSION};
use kvpool_tests::{Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use rand::{Rng, SeedableRng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_api_key_is_refused() {
    let srv = TestServer::start(Opts::default());
    for key in ["wrong-key", "", "test-admin-key "] {
        let Err(err) = Client::connect(srv.client_config(key)).await else { panic!("{key:?} must be refused") };
        assert_eq!(err.code(), ErrorCode::Unauthorized, "{key:?}: {err}");
    }
    // a good client still works
    let c = srv.client(ADMIN_KEY).await;
    c.ping().await.unwrap();
    assert!(c.is_admin());
    let a = srv.client(ALICE_KEY).await;
    assert!(!a.is_admin());
    assert_eq!(a.tenant(), "alice");
    assert!(kvpool_tests::metric(&srv.scrape(), "kvpool_auth_failures_total") >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cannot_see_each_other() {
    let srv = TestServer::start(Opts::default());
    let a = srv.client(ALICE_KEY).await;
    let b = srv.client(BOB_KEY).await;
    a.put("shared-name", b"alice's").await.unwrap();
    assert_eq!(b.get("shared-name").await.unwrap(), None);
    assert_eq!(b.exists(&["shared-name"]).await.unwrap(), vec![false]);
    assert_eq!(b.lookup(&["shared-name"]).await.unwrap(), 0);
    assert_eq!(b.remove("shared-name", true).await.unwrap_err().code(), ErrorCode::NotFound);
    b.put("shared-name", b"bob's").await.unwrap();
    b.remove_all(true).await.unwrap();
    assert_eq!(a.get("shared-name").await.unwrap().unwrap(), b"alice's");
    assert_eq!(b.get("shared-name").await.unwrap(), None);
}

async fn raw(srv: &TestServer) -> RawConnection {
    RawConnection::connect(&srv.client_config(ADMIN_KEY)).await.expect("raw connect")
}

async fn hello(r: &RawConnection) {
    let h = Request::Hello(Hello { version: PROTOCOL_VERSION, api_key: ADMIN_KEY.into(), client_name: "t".into() });
    assert!(matches!(r.request(&h).await.unwrap(), Response::Hello(_)));
}

fn error_code(reply: &[u8]) -> Option<ErrorCode> {
    match kvpool_client::parse_reply(reply) {
        Ok((Response::Error(e), _)) => Some(e.code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_gets_typed_errors_and_others_keep_working() {
    let srv = TestServer::start(Opts::default());
    let good = srv.client(ADMIN_KEY).await;
    good.put("keep", b"intact").await.unwrap();

    // wrong protocol version: typed error, then the connection closes
    let r = raw(&srv).await;
    let h = Request::Hello(Hello { version: 99, api_key: ADMIN_KEY.into(), client_name: "t".into() });
    match r.request(&h).await {
        Ok(Response::Error(e)) => assert_eq!(e.code, ErrorCode::UnsupportedVersion),
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
    // a request before any hello
    let r = raw(&srv).await;
    match r.request(&Request::Stats).await {
        Ok(Response::Error(e)) => assert_eq!(e.code, ErrorCode::HelloRequired),
        other => panic!("expected HelloRequired, got {other:?}"),
    }

    let r = raw(&srv).await;
    hello(&r).await;
    // a length of 4 GiB - 1
    let reply = r.exchange(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3], 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::FrameTooLarge));
    // truncated frame: claims 100 bytes, sends 10
    let mut t = 100u32.to_le_bytes().to_vec();
    t.extend_from_slice(&[7u8; 10]);
    let reply = r.exchange(&t, 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::Malformed));
    // an unknown message type
    let mut body = 77u32.to_le_bytes().to_vec();
    body.extend_from_slice(&[0u8; 8]);
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    let reply = r.exchange(&f, 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::UnknownMessage));
    // a known type with a body that lies about its lengths
    let mut body = 2u32.to_le_bytes().to_vec(); // Get
    body.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    let reply = r.exchange(&f, 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::Malformed));
    // a put whose declared value never arrives
    let put = Request::Put(kvpool_proto::PutRequest {
        mode: kvpool_proto::PutMode::Insert,
        items: vec![kvpool_proto::PutItem {
            key: b"half".to_vec(),
            size: 1000,
            parent: None,
            tokens: 0,
            seq_tokens: 0,
            pin: kvpool_proto::PinSpec::None,
        }],
    });
    let mut f = encode_frame(&put).unwrap();
    f.extend_from_slice(&[1u8; 10]);
    let reply = r.exchange(&f, 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::Malformed));
    // oversized value and key, refused before any allocation
    let big = Request::Put(kvpool_proto::PutRequest {
        mode: kvpool_proto::PutMode::Insert,
        items: vec![kvpool_proto::PutItem {
            key: b"big".to_vec(),
            size: 1 << 40,
            parent: None,
            tokens: 0,
            seq_tokens: 0,
            pin: kvpool_proto::PinSpec::None,
        }],
    });
    let reply = r.exchange(&encode_frame(&big).unwrap(), 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::ValueTooLarge));
    let long = Request::Exists(kvpool_proto::KeysRequest { keys: vec![vec![b'k'; 5000]] });
    let reply = r.exchange(&encode_frame(&long).unwrap(), 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::KeyTooLong));
    let many = Request::Exists(kvpool_proto::KeysRequest { keys: vec![b"k".to_vec(); 5000] });
    let reply = r.exchange(&encode_frame(&many).unwrap(), 1 << 20).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::BatchTooLarge));
    // a second hello
    let h = Request::Hello(Hello { version: PROTOCOL_VERSION, api_key: ADMIN_KEY.into(), client_name: "t".into() });
    assert!(matches!(r.request(&h).await.unwrap(), Response::Error(_)));
    // random garbage, many times: each gets an error or a closed stream, never a crash
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..200 {
        let n = rng.gen_range(0..64);
        let junk: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        if let Ok(reply) = r.exchange(&junk, 1 << 20).await {
            if !reply.is_empty() {
                assert!(error_code(&reply).is_some(), "garbage must get an error, got {reply:?}");
            }
        }
    }
    // the same connection still serves well-formed requests
    assert!(matches!(r.request(&Request::Stats).await.unwrap(), Response::Stats(_)));
    // random garbage as the very first stream of a connection
    for _ in 0..20 {
        let r = raw(&srv).await;
        let junk: Vec<u8> = (0..rng.gen_range(0..64)).map(|_| rng.gen()).collect();
        let _ = r.exchange(&junk, 1 << 20).await;
    }
    // other clients were never disturbed and the data is intact
    assert_eq!(good.get("keep").await.unwrap().unwrap(), b"intact");
    let fresh = srv.client(ADMIN_KEY).await;
    fresh.ping().await.unwrap();
}
