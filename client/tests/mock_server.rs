//! The client against a small in-process mock of the server: certificate trust (CA file,
//! pinned fingerprint, wrong fingerprint), the hello, and the stream shapes of put/get,
//! including a checksum the client must reject. The real server is covered by `tests/`.

use kvpool_client::proto::{
    codec, frame, ErrorBody, ExistsResponse, GetItem, GetResponse, HelloOk, Limits, LookupResponse, Pong, Request,
    Response, StatusList, ALPN,
};
use kvpool_client::{Client, ClientConfig, ClientError, ErrorCode, PutEntry, PutMode, Trust};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const KEY: &str = "test-key";

struct Mock {
    addr: SocketAddr,
    cert_pem: String,
    cert_der: Vec<u8>,
    _endpoint: quinn::Endpoint,
}

fn limits() -> Limits {
    Limits { max_frame: 1 << 20, max_key_len: 64, max_value_size: 8 << 20, max_batch: 16 }
}

async fn start_mock() -> Mock {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let cert_der = ck.cert.der().to_vec();
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key.into())
        .unwrap();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
    let endpoint =
        quinn::Endpoint::server(quinn::ServerConfig::with_crypto(Arc::new(crypto)), "127.0.0.1:0".parse().unwrap())
            .unwrap();
    let addr = endpoint.local_addr().unwrap();
    let store: Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>> = Arc::default();
    let ep = endpoint.clone();
    tokio::spawn(async move {
        while let Some(inc) = ep.accept().await {
            let store = store.clone();
            tokio::spawn(async move {
                let Ok(conn) = inc.await else { return };
                let mut hello_done = false;
                while let Ok((tx, rx)) = conn.accept_bi().await {
                    if !hello_done {
                        hello_done = true;
                        if !serve(tx, rx, store.clone(), true, conn.clone()).await {
                            conn.close(kvpool_client::proto::close::UNAUTHORIZED.into(), b"bad key");
                            return;
                        }
                    } else {
                        tokio::spawn(serve(tx, rx, store.clone(), false, conn.clone()));
                    }
                }
            });
        }
    });
    Mock { addr, cert_pem: ck.cert.pem(), cert_der, _endpoint: endpoint }
}

/// Answer one stream; returns false when a hello was refused.
async fn serve(
    mut tx: quinn::SendStream,
    mut rx: quinn::RecvStream,
    store: Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>,
    first: bool,
    conn: quinn::Connection,
) -> bool {
    let req: Request = frame::read_message(&mut rx, 1 << 20).await.unwrap();
    let mut bulk: Vec<Vec<u8>> = Vec::new();
    let resp = match req {
        Request::Hello(h) if first => {
            if h.api_key != KEY {
                let e = Response::Error(ErrorBody { code: ErrorCode::Unauthorized, message: "bad key".into() });
                frame::write_message(&mut tx, &e).await.unwrap();
                let _ = tx.finish();
                let _ = tx.stopped().await;
                return false;
            }
            Response::Hello(HelloOk {
                version: 1,
                server: "mock".into(),
                tenant: "t".into(),
                admin: false,
                limits: limits(),
            })
        }
        _ if first => Response::Error(ErrorBody { code: ErrorCode::HelloRequired, message: "hello first".into() }),
        Request::Ping(p) => Response::Pong(Pong { nonce: p.nonce, server_time_us: 1 }),
        Request::Put(p) => {
            let mut results = Vec::new();
            for item in p.items {
                let mut v = vec![0u8; item.size as usize];
                rx.read_exact(&mut v).await.unwrap();
                let mut s = store.lock().unwrap();
                results.push(match s.entry(item.key) {
                    std::collections::hash_map::Entry::Occupied(_) => ErrorCode::AlreadyExists,
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(v);
                        ErrorCode::Ok
                    }
                });
            }
            Response::Put(StatusList { results })
        }
        Request::Get(g) => {
            let s = store.lock().unwrap();
            let items = g
                .keys
                .iter()
                .map(|k| match s.get(k) {
                    Some(v) => {
                        bulk.push(v.clone());
                        let mut checksum = xxhash_rust::xxh3::xxh3_64(v);
                        if k == b"liar" {
                            checksum ^= 1;
                        }
                        GetItem { status: ErrorCode::Ok, size: v.len() as u64, tier: 1, checksum, lease_ms: 5000 }
                    }
                    None => GetItem { status: ErrorCode::NotFound, size: 0, tier: 0, checksum: 0, lease_ms: 0 },
                })
                .collect();
            Response::Get(GetResponse { items })
        }
        // Test hook: the server drops the connection, as a restart would.
        Request::Exists(e) if e.keys == [b"bye".to_vec()] => {
            conn.close(0u8.into(), b"bye");
            return true;
        }
        Request::Exists(e) => {
            let s = store.lock().unwrap();
            Response::Exists(ExistsResponse { present: e.keys.iter().map(|k| s.contains_key(k)).collect() })
        }
        Request::Lookup(l) => {
            let s = store.lock().unwrap();
            Response::Lookup(LookupResponse {
                resident: l.chain.iter().take_while(|k| s.contains_key(*k)).count() as u32,
            })
        }
        _ => Response::Error(ErrorBody { code: ErrorCode::UnknownMessage, message: "mock".into() }),
    };
    frame::write_message(&mut tx, &resp).await.unwrap();
    for b in bulk {
        tx.write_all(&b).await.unwrap();
    }
    let _ = tx.finish();
    let _ = tx.stopped().await;
    true
}

fn cfg(mock: &Mock, trust: Trust) -> ClientConfig {
    let mut c = ClientConfig::new(mock.addr.to_string(), KEY, trust);
    c.request_timeout = Duration::from_secs(10);
    c
}

#[tokio::test]
async fn fingerprint_and_ca_trust() {
    let mock = start_mock().await;
    let fp = kvpool_client::tls::cert_fingerprint(&mock.cert_der);
    let c = Client::connect(cfg(&mock, Trust::Fingerprint(fp))).await.unwrap();
    assert_eq!(c.tenant(), "t");
    assert_eq!(c.limits(), limits());
    c.ping().await.unwrap();

    let c2 = Client::connect(cfg(&mock, Trust::CaPem(mock.cert_pem.clone().into_bytes()))).await.unwrap();
    c2.ping().await.unwrap();

    let mut wrong = fp;
    wrong[0] ^= 0xff;
    let err = Client::connect(cfg(&mock, Trust::Fingerprint(wrong))).await.unwrap_err();
    assert!(matches!(err, ClientError::Tls(_)), "{err:?}");

    // A CA that did not sign the server certificate is refused as well.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let err = Client::connect(cfg(&mock, Trust::CaPem(other.cert.pem().into_bytes()))).await.unwrap_err();
    assert!(matches!(err, ClientError::Tls(_)), "{err:?}");

    // A CA-verified name must match the certificate.
    let mut bad_name = cfg(&mock, Trust::CaPem(mock.cert_pem.clone().into_bytes()));
    bad_name.server_name = "evil.example".into();
    assert!(matches!(Client::connect(bad_name).await.unwrap_err(), ClientError::Tls(_)));
}

#[tokio::test]
async fn bad_key_is_unauthorized() {
    let mock = start_mock().await;
    let fp = kvpool_client::tls::cert_fingerprint(&mock.cert_der);
    let mut c = cfg(&mock, Trust::Fingerprint(fp));
    c.api_key = "nope".into();
    let err = Client::connect(c).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Unauthorized, "{err:?}");
    assert!(err.to_string().starts_with("unauthorized: "), "{err}");
}

#[tokio::test]
async fn put_get_checksum_and_limits() {
    let mock = start_mock().await;
    let fp = kvpool_client::tls::cert_fingerprint(&mock.cert_der);
    let c = Client::connect(cfg(&mock, Trust::Fingerprint(fp))).await.unwrap();

    let a = vec![7u8; 100_000];
    let b = b"hello".to_vec();
    let st = c.put_batch(&[PutEntry::new(b"a", &a), PutEntry::new(b"b", &b)], PutMode::Insert).await.unwrap();
    assert_eq!(st, vec![ErrorCode::Ok, ErrorCode::Ok]);
    let err = c.put("a", b"x").await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::AlreadyExists);

    assert_eq!(c.get("a").await.unwrap().unwrap(), a);
    assert_eq!(c.get("missing").await.unwrap(), None);
    let r = c.get_batch(&["b", "missing", "a"]).await.unwrap();
    assert_eq!(r[0].value.as_deref(), Some(&b[..]));
    assert_eq!(r[1].status, ErrorCode::NotFound);
    assert_eq!(r[2].value.as_deref(), Some(&a[..]));

    let mut buf_a = vec![0u8; 200_000];
    let mut small = [0u8; 3];
    let r = c.get_batch_into(&["a", "b"], &mut [&mut buf_a[..], &mut small[..]]).await.unwrap();
    assert_eq!((r[0].status, r[0].size), (ErrorCode::Ok, a.len() as u64));
    assert_eq!(&buf_a[..a.len()], &a[..]);
    assert_eq!(r[1].status, ErrorCode::ValueTooLarge);

    assert_eq!(c.exists(&["a", "zz"]).await.unwrap(), vec![true, false]);
    assert_eq!(c.lookup(&["a", "b", "zz", "a"]).await.unwrap(), 2);

    c.put("liar", b"data").await.unwrap();
    let err = c.get("liar").await.unwrap_err();
    assert!(matches!(err, ClientError::Checksum { .. }), "{err:?}");
    assert_eq!(err.code(), ErrorCode::Corrupt);

    // Local limit checks: nothing is sent.
    let long = vec![b'k'; 65];
    assert_eq!(c.put(&long, b"x").await.unwrap_err().code(), ErrorCode::KeyTooLong);
    let big = vec![0u8; (8 << 20) + 1];
    assert_eq!(c.put("big", &big).await.unwrap_err().code(), ErrorCode::ValueTooLarge);
    let many: Vec<String> = (0..17).map(|i| i.to_string()).collect();
    assert_eq!(c.exists(&many).await.unwrap_err().code(), ErrorCode::BatchTooLarge);

    // Many requests in flight on one connection.
    let mut tasks = Vec::new();
    for i in 0..50 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let k = format!("k{i}");
            c.put(&k, k.as_bytes()).await.unwrap();
            assert_eq!(c.get(&k).await.unwrap().unwrap(), k.as_bytes());
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    // The raw helper sends bytes verbatim.
    let reply = c
        .raw_exchange(&frame::encode_frame(&Request::Ping(kvpool_client::proto::Ping { nonce: 9 })).unwrap(), 1024)
        .await
        .unwrap();
    let (resp, rest) = kvpool_client::parse_reply(&reply).unwrap();
    assert_eq!(resp, Response::Pong(Pong { nonce: 9, server_time_us: 1 }));
    assert!(rest.is_empty());
    let _ = codec::encode(&Request::Stats).unwrap();
}

#[tokio::test]
async fn reconnects_after_the_connection_drops() {
    let mock = start_mock().await;
    let fp = kvpool_client::tls::cert_fingerprint(&mock.cert_der);
    let c = Client::connect(cfg(&mock, Trust::Fingerprint(fp))).await.unwrap();
    let first = c.connection().stable_id();
    assert!(c.exists(&["bye"]).await.is_err());
    c.connection().closed().await;
    c.ping().await.unwrap();
    assert_ne!(c.connection().stable_id(), first);
    assert_eq!(c.tenant(), "t");
}
