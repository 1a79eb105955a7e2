//! Client checks against a running server, for client development. Skipped unless
//! `KVPOOL_LIVE_DATA_DIR` names the data directory of a running kvpool-server; the end-to-end
//! suite proper lives in `tests/`.

use kvpool_client::proto::{frame, Hello, Ping, Request, Response, PROTOCOL_VERSION};
use kvpool_client::{Client, ClientConfig, ErrorCode, PutEntry, PutMode, RawConnection};

fn live() -> Option<ClientConfig> {
    let dir = std::env::var_os("KVPOOL_LIVE_DATA_DIR")?;
    Some(ClientConfig::from_data_dir(dir).expect("readable data dir"))
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[tokio::test]
async fn live_round_trips_and_raw_inputs() {
    let Some(cfg) = live() else {
        eprintln!("KVPOOL_LIVE_DATA_DIR not set: skipped");
        return;
    };
    let c = Client::connect(cfg.clone()).await.unwrap();
    let run = std::process::id();

    // Sizes from 1 B to 16 MiB, single and batch, through both get paths.
    let sizes = [1usize, 1000, 65536, 1 << 20, 16 << 20];
    let values: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, n)| bytes(*n, i as u8)).collect();
    let keys: Vec<String> = sizes.iter().map(|n| format!("live/{run}/{n}")).collect();
    let entries: Vec<PutEntry<'_>> = keys.iter().zip(&values).map(|(k, v)| PutEntry::new(k.as_bytes(), v)).collect();
    assert!(c.put_batch(&entries, PutMode::Insert).await.unwrap().iter().all(|s| *s == ErrorCode::Ok));
    let got = c.get_batch(&keys).await.unwrap();
    for (g, v) in got.iter().zip(&values) {
        assert_eq!(g.value.as_ref().unwrap(), v);
    }
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0u8; *n]).collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let r = c.get_batch_into(&keys, &mut views).await.unwrap();
    assert!(r.iter().all(|x| x.status == ErrorCode::Ok));
    assert_eq!(bufs, values);
    assert_eq!(c.put(&keys[0], b"other").await.unwrap_err().code(), ErrorCode::AlreadyExists);
    assert_eq!(c.lookup(&[&keys[0], &keys[1], &"nope".to_string(), &keys[2]]).await.unwrap(), 2);
    assert_eq!(c.remove_batch(&keys, true).await.unwrap(), vec![ErrorCode::Ok; sizes.len()]);
    assert_eq!(c.get(&keys[0]).await.unwrap(), None);

    // 200 concurrent tasks on one connection.
    let mut tasks = Vec::new();
    for i in 0..200 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let k = format!("live/{run}/c{i}");
            let v = bytes(1000 + i, i as u8);
            c.put(&k, &v).await.unwrap();
            assert_eq!(c.get(&k).await.unwrap().unwrap(), v);
            assert_eq!(c.exists(&[&k]).await.unwrap(), vec![true]);
            c.remove(&k, true).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    // Malformed input on the authenticated connection: typed errors, connection survives.
    let check = |reply: Vec<u8>, want: ErrorCode| match kvpool_client::parse_reply(&reply).unwrap().0 {
        Response::Error(e) => assert_eq!(e.code, want, "{e:?}"),
        other => panic!("expected {want}, got {other:?}"),
    };
    check(c.raw_exchange(&[7, 0, 0, 0, 2, 0, 0, 0, 1, 2, 3], 4096).await.unwrap(), ErrorCode::Malformed);
    check(c.raw_exchange(&[0xff, 0xff, 0xff, 0xff], 4096).await.unwrap(), ErrorCode::FrameTooLarge);
    check(c.raw_exchange(&[4, 0, 0, 0, 99, 0, 0, 0], 4096).await.unwrap(), ErrorCode::UnknownMessage);
    check(c.raw_exchange(&[10, 0, 0, 0, 1, 2], 4096).await.unwrap(), ErrorCode::Malformed);
    c.ping().await.unwrap();

    // Hello rules on fresh connections.
    let raw = RawConnection::connect(&cfg).await.unwrap();
    let r = raw.request(&Request::Ping(Ping { nonce: 1 })).await.unwrap();
    assert!(matches!(r, Response::Error(ref e) if e.code == ErrorCode::HelloRequired), "{r:?}");
    let raw = RawConnection::connect(&cfg).await.unwrap();
    let hello =
        Request::Hello(Hello { version: PROTOCOL_VERSION + 1, api_key: cfg.api_key.clone(), client_name: "t".into() });
    let r = raw.request(&hello).await.unwrap();
    assert!(matches!(r, Response::Error(ref e) if e.code == ErrorCode::UnsupportedVersion), "{r:?}");
    let _ = frame::encode_frame(&hello).unwrap();
    c.ping().await.unwrap();
}
