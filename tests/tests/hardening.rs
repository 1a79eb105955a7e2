//! Request-path hardening against a real server: stalled streams, over-long values, resets and
//! tenant-scoped stats.

use kvpool_client::RawConnection;
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{ErrorCode, Hello, PinSpec, PutItem, PutMode, PutRequest, Request, Response, PROTOCOL_VERSION};
use kvpool_tests::{metric, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::time::{Duration, Instant};

async fn raw_hello(srv: &TestServer) -> RawConnection {
    let r = RawConnection::connect(&srv.client_config(ADMIN_KEY)).await.expect("raw connect");
    let h = Request::Hello(Hello { version: PROTOCOL_VERSION, api_key: ADMIN_KEY.into(), client_name: "t".into() });
    assert!(matches!(r.request(&h).await.unwrap(), Response::Hello(_)));
    r
}

fn put_frame(key: &str, size: u64) -> Vec<u8> {
    encode_frame(&Request::Put(PutRequest {
        mode: PutMode::Insert,
        items: vec![PutItem { key: key.into(), size, parent: None, tokens: 0, seq_tokens: 0, pin: PinSpec::None }],
    }))
    .unwrap()
}

fn response_code(bytes: &[u8]) -> Option<ErrorCode> {
    match kvpool_client::parse_reply(bytes) {
        Ok((Response::Error(e), _)) => Some(e.code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_puts_cannot_starve_other_clients() {
    let srv = TestServer::start(Opts {
        dram: "128MiB",
        cache: "put_wait_ms = 8000".into(),
        extra: "[limits]\nrequest_timeout_ms = 1000\nmin_transfer_rate = \"64MiB\"\n".into(),
        ..Opts::default()
    });
    // Three streams each declare a 42 MiB value, send a few bytes, and never finish.
    let attacker = raw_hello(&srv).await;
    let conn = attacker.connection().clone();
    let mut stalled = Vec::new();
    for i in 0..3 {
        let (mut tx, rx) = conn.open_bi().await.unwrap();
        tx.write_all(&put_frame(&format!("stall-{i}"), 42 << 20)).await.unwrap();
        tx.write_all(&[0u8; 100]).await.unwrap();
        stalled.push((tx, rx));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        metric(&srv.scrape(), "kvpool_bytes_used{tier=\"dram\"}") >= (120 << 20) as f64,
        "the stalled puts hold their reservations for now"
    );
    // Another client's 42 MiB put gets the space once the stalled requests expire.
    let victim = srv.client(ALICE_KEY).await;
    let value = kvpool_tests::value_for("victim", 42 << 20);
    let started = Instant::now();
    victim.put("victim", &value).await.expect("put succeeds once the stalled requests expire");
    assert!(started.elapsed() < Duration::from_secs(6), "took {:?}", started.elapsed());
    assert_eq!(victim.get("victim").await.unwrap().unwrap(), value);
    // Each stalled stream was answered `timeout`.
    for (_tx, mut rx) in stalled {
        let reply = rx.read_to_end(1 << 20).await.expect("a typed answer, then FIN");
        assert_eq!(response_code(&reply), Some(ErrorCode::Timeout));
    }
    assert!(metric(&srv.scrape(), "kvpool_errors_total{code=\"timeout\"}") >= 3.0);
    assert_eq!(victim.exists(&["stall-0", "stall-1", "stall-2"]).await.unwrap(), vec![false; 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_values_and_trailing_bytes_are_malformed() {
    let srv = TestServer::start(Opts::default());
    let r = raw_hello(&srv).await;
    let mut f = put_frame("four", 4);
    f.extend_from_slice(b"0123456789");
    assert_eq!(response_code(&r.exchange(&f, 1 << 20).await.unwrap()), Some(ErrorCode::Malformed));
    let mut f = encode_frame(&Request::Stats).unwrap();
    f.extend_from_slice(&encode_frame(&Request::Stats).unwrap());
    assert_eq!(response_code(&r.exchange(&f, 1 << 20).await.unwrap()), Some(ErrorCode::Malformed));
    let c = srv.client(ADMIN_KEY).await;
    assert_eq!(c.get("four").await.unwrap(), None, "nothing of the over-long put was stored");
    // Junk after a hello fails the hello: the connection is closed.
    let raw = RawConnection::connect(&srv.client_config(ADMIN_KEY)).await.unwrap();
    let mut h = encode_frame(&Request::Hello(Hello {
        version: PROTOCOL_VERSION,
        api_key: ADMIN_KEY.into(),
        client_name: "t".into(),
    }))
    .unwrap();
    h.extend_from_slice(b"junk");
    assert_eq!(response_code(&raw.exchange(&h, 1 << 20).await.unwrap()), Some(ErrorCode::Malformed));
    tokio::time::timeout(Duration::from_secs(5), raw.connection().closed()).await.expect("connection closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reset_is_counted_cancelled_not_internal() {
    let srv = TestServer::start(Opts::default());
    let r = raw_hello(&srv).await;
    for i in 0..5 {
        let (mut tx, _rx) = r.connection().open_bi().await.unwrap();
        tx.write_all(&put_frame(&format!("reset-{i}"), 1 << 20)).await.unwrap();
        tx.write_all(&[1u8; 1000]).await.unwrap();
        tx.reset(0u32.into()).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = srv.scrape();
        // A reset that overtakes the frame cancels the request before its type is known.
        if metric(&m, "kvpool_requests_cancelled_total{") >= 5.0 {
            assert_eq!(metric(&m, "kvpool_errors_total{code=\"internal\"}"), 0.0);
            assert_eq!(metric(&m, "kvpool_op_errors_total{op=\"put\"}"), 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "cancellations not counted:\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = srv.client(ADMIN_KEY).await;
    assert_eq!(c.stats().await.unwrap().tiers[0].used_bytes, 0, "reservations released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_show_only_the_callers_tenant() {
    let srv = TestServer::start(Opts::default());
    let (a, b, admin) = (srv.client(ALICE_KEY).await, srv.client(BOB_KEY).await, srv.client(ADMIN_KEY).await);
    for i in 0..3 {
        a.put(format!("a{i}"), &[1u8; 5000]).await.unwrap();
    }
    b.put("b0", &[2u8; 10]).await.unwrap();
    b.get("b0").await.unwrap().unwrap();
    let (sa, sb, sadmin) = (a.stats().await.unwrap(), b.stats().await.unwrap(), admin.stats().await.unwrap());
    assert_eq!((sa.blocks, sb.blocks, sadmin.blocks), (3, 1, 4));
    assert_eq!(sa.tiers[0].used_bytes, 3 * 5120);
    assert_eq!(sb.tiers[0].used_bytes, 256);
    assert_eq!(sa.tiers[0].hits, 0, "bob's hit is not in alice's stats");
    assert_eq!(sb.tiers[0].hits, 1);
    // Over shared memory a put is a `put_from`.
    let puts = |s: &kvpool_client::StatsReport| {
        s.ops.iter().filter(|o| o.op == "put" || o.op == "put_from").map(|o| o.count).sum::<u64>()
    };
    assert_eq!((puts(&sa), puts(&sb), puts(&sadmin)), (3, 1, 4));
}
