//! The data paths of protocol version 2 against a real server: same-host shared memory (zero-copy
//! buffers, batches, a client killed mid-transfer, a buffer unshared while in use, two tenants),
//! the one-sided descriptors over QUIC, and a version 1 client.

use kvpool_client::{Client, ClientConfig, ErrorCode, PutMode, PutOptions, RawConnection, TransportChoice};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{BufSlice, GetIntoRequest, Hello, KeysRequest, Request, Response};
use kvpool_tests::{bin, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn cfg_on(srv: &TestServer, key: &str, t: TransportChoice) -> ClientConfig {
    srv.client_config_on(key, t)
}

async fn client_on(srv: &TestServer, key: &str, t: TransportChoice) -> Client {
    Client::connect(cfg_on(srv, key, t)).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_zero_copy_round_trips_in_batches_of_64() {
    let srv = TestServer::start(Opts { dram: "512MiB", ..Opts::default() });
    let c = client_on(&srv, ADMIN_KEY, TransportChoice::Shm).await;
    assert_eq!(c.transport_in_use(), "shm");
    // 64 values of varied sizes (0 bytes to 3 MiB) packed into one buffer.
    let sizes: Vec<usize> = (0..64).map(|i| if i == 5 { 0 } else { (i * 48_271) % (3 << 20) + 1 }).collect();
    let total: usize = sizes.iter().sum();
    let mut src = c.alloc_buffer(total).unwrap();
    let mut at = 0;
    let mut keys = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let k = format!("shm-{i}");
        src.as_mut_slice()[at..at + n].copy_from_slice(&value_for(&k, n));
        keys.push(k);
        at += n;
    }
    let mut slices = Vec::new();
    let mut at = 0;
    for (i, &n) in sizes.iter().enumerate() {
        slices.push((keys[i].clone(), src.slice(at, n).unwrap(), PutOptions::default()));
        at += n;
    }
    let st = c.put_from_batch(&slices, PutMode::Insert).await.unwrap();
    assert!(st.iter().all(|s| *s == ErrorCode::Ok), "{st:?}");
    // Into a second buffer, each value at a different offset than it came from.
    let dst = c.alloc_buffer(total + 64 * 100).unwrap();
    let mut dests = Vec::new();
    let mut at = 0;
    for &n in sizes.iter().rev() {
        dests.push(dst.slice(at, n + 100).unwrap());
        at += n + 100;
    }
    let rev_keys: Vec<&String> = keys.iter().rev().collect();
    let got = c.get_into_batch(&rev_keys, &dests).await.unwrap();
    for ((g, d), k) in got.iter().zip(&dests).zip(&rev_keys) {
        assert_eq!(g.status, ErrorCode::Ok, "{k}");
        assert_eq!(&dst.as_slice()[d.offset..d.offset + g.size as usize], &value_for(k, g.size as usize)[..], "{k}");
    }
    // A destination too small is a per-item status, and nothing is written past it.
    let small = c.alloc_buffer(16).unwrap();
    let r = c.get_into_batch(&["shm-1"], &[small.slice(0, 8).unwrap()]).await.unwrap();
    assert_eq!(r[0].status, ErrorCode::ValueTooLarge);
    assert_eq!(&small.as_slice()[8..], &[0u8; 8]);
    // The same blocks read over QUIC by another client are identical.
    let q = client_on(&srv, ADMIN_KEY, TransportChoice::Quic).await;
    assert_eq!(q.transport_in_use(), "quic");
    for k in keys.iter().take(8) {
        let v = q.get(k).await.unwrap().unwrap();
        assert_eq!(v, value_for(k, v.len()));
    }
    // And the plain-slice calls of a shm client stage through shared memory.
    c.put("plain", b"via staging").await.unwrap();
    let mut out = [0u8; 32];
    assert_eq!(c.get_into("plain", &mut out).await.unwrap(), Some(11));
    assert_eq!(&out[..11], b"via staging");
    assert_eq!(q.get("plain").await.unwrap().unwrap(), b"via staging");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_killed_mid_transfer_leaves_the_pool_serving() {
    let srv = TestServer::start(Opts { dram: "512MiB", ..Opts::default() });
    let keeper = client_on(&srv, ADMIN_KEY, TransportChoice::Shm).await;
    keeper.put("canary", &value_for("canary", 100_000)).await.unwrap();
    for round in 0..3 {
        let cert = srv.endpoint["cert_path"].as_str().unwrap().to_string();
        let mut child = Command::new(bin("kvpool-shm-stress"))
            .args([srv.addr(), cert, ADMIN_KEY.to_string(), format!("stress{round}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the stress client");
        let mut out = child.stdout.take().unwrap();
        let ready = tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut buf = [0u8; 6];
            out.read_exact(&mut buf).map(|_| buf)
        });
        let ready = tokio::time::timeout(Duration::from_secs(60), ready).await.expect("stress client ready").unwrap();
        assert_eq!(&ready.unwrap(), b"ready\n");
        // Kill it at a different point of its loop each round.
        tokio::time::sleep(Duration::from_millis(37 * (round + 1))).await;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
    }
    // The server still serves, on both transports, and the canary is intact.
    assert_eq!(keeper.get("canary").await.unwrap().unwrap(), value_for("canary", 100_000));
    let fresh = client_on(&srv, ADMIN_KEY, TransportChoice::Shm).await;
    fresh.put("after", b"still serving").await.unwrap();
    assert_eq!(fresh.get("after").await.unwrap().unwrap(), b"still serving");
    // Nothing the killed clients held stays allocated once their blocks are gone.
    keeper.remove_all(true).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let used = keeper.stats().await.unwrap().tiers[0].used_bytes;
        if used == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{used} bytes still allocated");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsharing_a_buffer_in_use_is_a_typed_error_not_a_crash() {
    let srv = TestServer::start(Opts { dram: "512MiB", ..Opts::default() });
    let c = client_on(&srv, ADMIN_KEY, TransportChoice::Shm).await;
    let n = 32usize;
    let size = 1 << 20;
    let buf = Arc::new(c.alloc_buffer(n * size).unwrap());
    let keys: Vec<String> = (0..n).map(|i| format!("u{i}")).collect();
    let entries: Vec<_> =
        keys.iter().enumerate().map(|(i, k)| (k, buf.slice(i * size, size).unwrap(), PutOptions::default())).collect();
    c.put_from_batch(&entries, PutMode::Insert).await.unwrap();
    drop(entries);
    // Gets into the buffer run while another task unshares it.
    let (c2, b2, k2) = (c.clone(), buf.clone(), keys.clone());
    let reader = tokio::spawn(async move {
        let mut outcomes = Vec::new();
        for _ in 0..40 {
            let dests: Vec<_> = (0..n).map(|i| b2.slice(i * size, size).unwrap()).collect();
            outcomes.push(c2.get_into_batch(&k2, &dests).await.map(|_| ()).map_err(|e| e.code()));
        }
        outcomes
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    buf.unshare();
    let outcomes = reader.await.unwrap();
    assert!(outcomes.iter().any(|o| o.is_err()), "gets after the unshare must fail");
    for o in &outcomes {
        if let Err(code) = o {
            assert_eq!(*code, ErrorCode::InvalidArgument, "{outcomes:?}");
        }
    }
    // The server serves, and the blocks are intact.
    let q = client_on(&srv, ADMIN_KEY, TransportChoice::Quic).await;
    assert_eq!(q.exists(&keys).await.unwrap(), vec![true; n]);
    let fresh = c.alloc_buffer(size).unwrap();
    c.get_into_batch(&["u0"], &[fresh.slice(0, size).unwrap()]).await.unwrap();
    assert_eq!(fresh.as_slice(), &buf.as_slice()[..size]);
}

/// The server hashes each block as it lands in the client's buffer. A destination written
/// while the server fills it fails that check: the item is `Corrupt`, never `Ok`, and the
/// block (whose server copy is sound) stays and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_written_during_the_copy_is_corrupt_not_ok() {
    let srv = TestServer::start(Opts { dram: "256MiB", ..Opts::default() });
    let c = client_on(&srv, ADMIN_KEY, TransportChoice::Shm).await;
    let size = 8 << 20;
    let value = value_for("raced", size);
    let mut src = c.alloc_buffer(size).unwrap();
    src.as_mut_slice().copy_from_slice(&value);
    let entry = [("raced", src.slice(0, size).unwrap(), PutOptions::default())];
    assert_eq!(c.put_from_batch(&entry, PutMode::Insert).await.unwrap(), vec![ErrorCode::Ok]);
    let dst = c.alloc_buffer(size).unwrap();
    // A thread keeps writing, in every 32 KiB piece of the destination, one byte with a value
    // the block lacks there. The server hashes each piece right after copying it, so a write
    // that lands between the two is caught; sweeping every piece gives each get hundreds of
    // such windows instead of one. (The byte sits 4 KiB into its piece, not at its start:
    // memcpy stores the head of a range last, just before the server reads it back.)
    let base = dst.as_ptr() as usize;
    let marks: Vec<(usize, u8)> =
        (0..size).step_by(32 << 10).map(|piece| piece + 4096).map(|at| (base + at, value[at] ^ 0xff)).collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let writer = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            for &(addr, wrong) in &marks {
                // SAFETY: the buffer outlives the thread (joined below); racing the server's
                // copy is the point of this test.
                unsafe { (addr as *mut u8).write_volatile(wrong) };
            }
        }
    });
    // Each get is a fresh chance (a few ms); on a loaded machine the writer may not run
    // during some of them, so try for a while rather than a fixed number of times.
    let mut statuses = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let r = c.get_into_batch(&["raced"], &[dst.slice(0, size).unwrap()]).await.unwrap();
        statuses.push(r[0].status);
        if r[0].status == ErrorCode::Corrupt {
            break;
        }
        assert_eq!(r[0].status, ErrorCode::Ok, "{statuses:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(statuses.last(), Some(&ErrorCode::Corrupt), "no get was caught in {} tries", statuses.len());
    // The block was not dropped: a quiet get serves it whole, verified again by this client.
    let mut cfg = cfg_on(&srv, ADMIN_KEY, TransportChoice::Shm);
    cfg.verify_shm_gets = true;
    let v = Client::connect(cfg).await.unwrap();
    let dst2 = v.alloc_buffer(size).unwrap();
    let r = v.get_into_batch(&["raced"], &[dst2.slice(0, size).unwrap()]).await.unwrap();
    assert_eq!((r[0].status, r[0].size), (ErrorCode::Ok, size as u64));
    assert!(dst2.as_slice() == &value[..]);
    assert_eq!(v.stats().await.unwrap().corrupt_blocks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_on_shm_cannot_reach_each_other() {
    let srv = TestServer::start(Opts::default());
    let alice = client_on(&srv, ALICE_KEY, TransportChoice::Shm).await;
    let bob = client_on(&srv, BOB_KEY, TransportChoice::Shm).await;
    let mut a = alice.alloc_buffer(4096).unwrap();
    a.as_mut_slice()[..6].copy_from_slice(b"alice!");
    alice.put_from_batch(&[("secret", a.slice(0, 6).unwrap(), PutOptions::default())], PutMode::Insert).await.unwrap();
    // Bob's get of the same name finds nothing; his put goes to his own key space.
    let mut b = bob.alloc_buffer(4096).unwrap();
    let r = bob.get_into_batch(&["secret"], &[b.slice(0, 100).unwrap()]).await.unwrap();
    assert_eq!(r[0].status, ErrorCode::NotFound);
    b.as_mut_slice()[..4].copy_from_slice(b"bob!");
    bob.put_from_batch(&[("secret", b.slice(0, 4).unwrap(), PutOptions::default())], PutMode::Upsert).await.unwrap();
    let r = alice.get_into_batch(&["secret"], &[a.slice(100, 100).unwrap()]).await.unwrap();
    assert_eq!((r[0].status, &a.as_slice()[100..106]), (ErrorCode::Ok, &b"alice!"[..]));
    // Bob cannot name Alice's buffers: region ids belong to the connection that shared them.
    let raw = RawConnection::connect(&cfg_on(&srv, BOB_KEY, TransportChoice::Quic)).await.unwrap();
    let h = Request::Hello(Hello { version: 2, api_key: BOB_KEY.into(), client_name: "t".into() });
    assert!(matches!(raw.request(&h).await.unwrap(), Response::Hello(_)));
    let steal = Request::GetInto(GetIntoRequest {
        keys: vec![b"secret".to_vec()],
        dests: vec![BufSlice { region: 1, offset: 0, len: 100 }],
    });
    match raw.request(&steal).await.unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::Unsupported, "{e:?}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(raw.request(&Request::ShmAttach).await.unwrap(), Response::ShmOffer(_)));
    match raw.request(&steal).await.unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(&a.as_slice()[..6], b"alice!");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sided_descriptors_over_quic() {
    let srv = TestServer::start(Opts {
        extra: "[limits]\nrequest_timeout_ms = 300\nmin_transfer_rate = \"64MiB\"\n".into(),
        ..Opts::default()
    });
    let c = client_on(&srv, ADMIN_KEY, TransportChoice::Quic).await;
    let value = value_for("os", 300_000);
    let grants = c
        .put_intent(
            &[("os", value.len() as u64, PutOptions::default()), ("os2", 10, PutOptions::default())],
            PutMode::Insert,
        )
        .await
        .unwrap();
    assert!(grants.iter().all(|g| g.status == ErrorCode::Ok && g.location.region == 0));
    assert_ne!(grants[0].location.offset, grants[1].location.offset);
    // Written in two pieces, out of order.
    c.write_reservation(grants[0].reservation, 100_000, &value[100_000..]).await.unwrap();
    c.write_reservation(grants[0].reservation, 0, &value[..100_000]).await.unwrap();
    let e = c.write_reservation(grants[0].reservation, 299_999, b"xx").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    assert_eq!(c.exists(&["os"]).await.unwrap(), vec![false], "not visible before put_done");
    // os2 is never committed: its reservation expires (300 ms + 10 bytes at 64 MiB/s).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let st = c.put_done(&[grants[0].reservation, grants[1].reservation, 12345]).await;
    // The first reservation may have expired too, at the same deadline: then redo it quickly.
    let st = st.unwrap();
    assert_eq!(&st[1..], &[ErrorCode::Expired, ErrorCode::Expired]);
    if st[0] != ErrorCode::Ok {
        let g = c.put_intent(&[("os", value.len() as u64, PutOptions::default())], PutMode::Insert).await.unwrap();
        c.write_reservation(g[0].reservation, 0, &value).await.unwrap();
        assert_eq!(c.put_done(&[g[0].reservation]).await.unwrap(), vec![ErrorCode::Ok]);
    }
    assert_eq!(c.get("os").await.unwrap().unwrap(), value);
    assert_eq!(c.exists(&["os2"]).await.unwrap(), vec![false]);
    // Located under a lease, read in pieces, released.
    let loc = c.get_locate(&["os", "nope"]).await.unwrap();
    assert_eq!((loc.blocks[0].status, loc.blocks[1].status), (ErrorCode::Ok, ErrorCode::NotFound));
    let mut back = vec![0u8; value.len()];
    c.read_located(loc.lease, 0, 0, &mut back[..1000]).await.unwrap();
    c.read_located(loc.lease, 0, 1000, &mut back[1000..]).await.unwrap();
    assert_eq!(back, value);
    assert_eq!(xxhash_rust::xxh3::xxh3_64(&back), loc.blocks[0].checksum);
    let mut one = [0u8; 1];
    assert_eq!(c.read_located(loc.lease, 1, 0, &mut one).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    c.release(loc.lease).await.unwrap();
    assert_eq!(c.release(loc.lease).await.unwrap_err().code(), ErrorCode::Expired);
    assert_eq!(c.read_located(loc.lease, 0, 0, &mut one).await.unwrap_err().code(), ErrorCode::Expired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_client_keeps_working() {
    let srv = TestServer::start(Opts::default());
    let raw = RawConnection::connect(&cfg_on(&srv, ADMIN_KEY, TransportChoice::Quic)).await.unwrap();
    let h = Request::Hello(Hello { version: 1, api_key: ADMIN_KEY.into(), client_name: "v1".into() });
    match raw.request(&h).await.unwrap() {
        Response::Hello(ok) => assert_eq!(ok.version, 1),
        other => panic!("{other:?}"),
    }
    let mut put = encode_frame(&Request::Put(kvpool_proto::PutRequest {
        mode: kvpool_proto::PutMode::Insert,
        items: vec![kvpool_proto::PutItem {
            key: b"v1".to_vec(),
            size: 3,
            parent: None,
            tokens: 0,
            seq_tokens: 0,
            pin: kvpool_proto::PinSpec::None,
        }],
    }))
    .unwrap();
    put.extend_from_slice(b"old");
    let reply = raw.exchange(&put, 1 << 20).await.unwrap();
    assert!(matches!(kvpool_client::parse_reply(&reply).unwrap().0, Response::Put(_)));
    let reply = raw
        .exchange(&encode_frame(&Request::Get(KeysRequest { keys: vec![b"v1".to_vec()] })).unwrap(), 1 << 20)
        .await
        .unwrap();
    let (resp, bytes) = kvpool_client::parse_reply(&reply).unwrap();
    assert!(matches!(resp, Response::Get(_)));
    assert_eq!(bytes, b"old");
    // Version 2 requests are not for a version 1 connection.
    match raw.request(&Request::ShmAttach).await.unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::Unsupported),
        other => panic!("{other:?}"),
    }
}
