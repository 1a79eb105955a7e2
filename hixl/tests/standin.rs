//! kvpool's side of the HIXL shim ABI, driven through the stand-in library (`shim/standin.c`:
//! the same ABI over POSIX shared memory). Two engines in one process, and two processes (this
//! test binary re-executed as the peer). None of this touches HIXL itself: see docs/HIXL.md.

use kvpool_hixl::{standin_library, HixlConfig, HixlError, HixlTransport};
use kvpool_transport::{MemKind, Op, PeerId, RegionId, Transport, TransportError, Xfer, XferId, XferStatus};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn cfg() -> HixlConfig {
    HixlConfig {
        shim_path: Some(standin_library().into()),
        local_host: Some("127.0.0.1".into()),
        device_id: Some(0),
        timeout_ms: Some(5000),
        connect_timeout_ms: Some(1000),
        ..Default::default()
    }
}

/// One engine with one registered host buffer. Fields drop in order: the buffer keeps the engine
/// alive until it is freed.
struct Side {
    t: HixlTransport,
    region: RegionId,
    buf: kvpool_hixl::HixlBuffer,
}

impl Side {
    fn new(c: &HixlConfig, len: usize) -> Side {
        let t = HixlTransport::new(c).expect("engine over the stand-in");
        let buf = t.alloc(len, MemKind::Host).expect("alloc");
        // SAFETY: the buffer outlives the registration (it is dropped after the transport's use).
        let region = unsafe { t.register(buf.region()) }.expect("register");
        Side { t, region, buf }
    }

    fn fill(&self, at: usize, len: usize, seed: u8) {
        // SAFETY: no transfer touches the buffer while the test writes it.
        let b = unsafe { self.buf.host_bytes_mut() }.unwrap();
        for (i, x) in b[at..at + len].iter_mut().enumerate() {
            *x = pattern(seed, i);
        }
    }

    fn check(&self, at: usize, len: usize, seed: u8) -> Result<(), String> {
        // SAFETY: no transfer touches the buffer while the test reads it.
        let b = unsafe { self.buf.host_bytes() }.unwrap();
        match b[at..at + len].iter().enumerate().find(|&(i, &x)| x != pattern(seed, i)) {
            None => Ok(()),
            Some((i, &x)) => Err(format!("byte {} is {x}, expected {}", at + i, pattern(seed, i))),
        }
    }

    /// The buffer's bytes, read once every transfer on it settled.
    fn bytes(&self) -> &[u8] {
        settled(&self.buf)
    }

    fn connect_to(&self, other: &Side) -> PeerId {
        self.t.connect(&other.t.local_metadata().unwrap()).expect("connect")
    }
}

/// A host buffer's bytes; the tests read one only once every transfer on it settled.
fn settled(buf: &kvpool_hixl::HixlBuffer) -> &[u8] {
    // SAFETY: the callers read after `settle` returned for every post touching the buffer, and
    // start no transfer while the slice lives.
    unsafe { buf.host_bytes() }.unwrap()
}

fn pattern(seed: u8, i: usize) -> u8 {
    (i as u32).wrapping_mul(2654435761).rotate_left(seed as u32 % 31) as u8 ^ seed
}

fn x(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> Xfer {
    Xfer { local, local_offset: lo, remote, remote_offset: ro, len }
}

/// Poll until the post settles.
fn settle(t: &dyn Transport, id: XferId) -> Result<(), TransportError> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match t.status(id)? {
            XferStatus::Done => return Ok(()),
            XferStatus::Failed(e) => return Err(e),
            XferStatus::Pending if Instant::now() < end => std::thread::sleep(Duration::from_micros(200)),
            XferStatus::Pending => panic!("transfer {id:?} still pending after 30 s"),
        }
    }
}

#[test]
fn two_engines_write_read_and_report_each_post_once() {
    let a = Side::new(&cfg(), 1 << 20);
    let b = Side::new(&cfg(), 1 << 20);
    assert_eq!(a.t.backend(), "standin");
    assert_ne!(a.t.engine_name(), b.t.engine_name());
    assert!(a.t.caps().same_host_only && a.t.caps().device_memory);
    let peer = a.connect_to(&b);
    // Connecting again with the same metadata is the same peer.
    assert_eq!(a.connect_to(&b), peer);

    // Batch write: 32 scattered 4 KiB descriptors.
    a.fill(0, 256 << 10, 7);
    let batch: Vec<Xfer> = (0..32u64).map(|i| x(a.region, i * 8192, b.region, 4096 + i * 8192, 4096)).collect();
    let id = a.t.post(peer, Op::Write, &batch).unwrap();
    settle(&a.t, id).unwrap();
    assert_eq!(a.t.status(id), Err(TransportError::UnknownXfer(id)), "a settled post is reported once");
    for i in 0..32usize {
        // The 4 KiB at i*8192 of a landed at 4096 + i*8192 of b.
        let src = a.bytes()[i * 8192..i * 8192 + 4096].to_vec();
        let dst = b.bytes()[4096 + i * 8192..8192 + i * 8192].to_vec();
        assert_eq!(src, dst, "descriptor {i}");
    }

    // Batch read: b's 512 KiB..768 KiB into a's 768 KiB.., as 64 contiguous descriptors.
    b.fill(512 << 10, 256 << 10, 9);
    let batch: Vec<Xfer> =
        (0..64u64).map(|i| x(a.region, (768 << 10) + i * 4096, b.region, (512 << 10) + i * 4096, 4096)).collect();
    let id = a.t.post(peer, Op::Read, &batch).unwrap();
    settle(&a.t, id).unwrap();
    a.check(768 << 10, 256 << 10, 9).unwrap();

    // The async path with a completion signal, through the trait's own wait.
    b.fill(0, 4096, 11);
    let id = a.t.post(peer, Op::Read, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    assert!(a.t.completion(id).is_some());
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(kvpool_transport::wait(&a.t, id, Duration::from_secs(10))).unwrap();
    a.check(0, 4096, 11).unwrap();

    // Every descriptor is checked before anything moves.
    let bad = [x(a.region, 0, b.region, 0, 16), x(a.region, (1 << 20) - 8, b.region, 0, 16)];
    assert!(matches!(a.t.post(peer, Op::Write, &bad), Err(TransportError::OutOfBounds { .. })));
    let bad = [x(a.region, 0, RegionId(999_999), 0, 16)];
    assert_eq!(a.t.post(peer, Op::Write, &bad), Err(TransportError::UnknownRegion(RegionId(999_999))));
    assert_eq!(a.t.post(PeerId(424_242), Op::Write, &[]), Err(TransportError::UnknownPeer(PeerId(424_242))));
    // An empty batch settles at once.
    let id = a.t.post(peer, Op::Write, &[]).unwrap();
    settle(&a.t, id).unwrap();

    // All calls came from the engine thread (HIXL needs the ACL context on the calling thread).
    let c = a.t.standin_counters().unwrap();
    assert_eq!(c.wrong_thread, 0);
    assert_eq!(c.stale_status, 0, "no request queried after it was reported: {c:?}");
    assert_eq!(c.bytes, (128 << 10) + (256 << 10) + 4096);

    a.t.disconnect(peer).unwrap();
    assert_eq!(a.t.disconnect(peer), Err(TransportError::UnknownPeer(peer)));
    assert_eq!(a.t.post(peer, Op::Write, &[]), Err(TransportError::UnknownPeer(peer)));
    a.t.deregister(a.region).unwrap();
    assert_eq!(a.t.deregister(a.region), Err(TransportError::UnknownRegion(a.region)));
}

#[test]
fn small_posts_to_one_peer_share_hixl_calls_up_to_batch_size() {
    let mut c = cfg();
    c.max_batch_size = Some(8);
    c.merge_threshold = Some(64 << 10);
    // Hold small descriptors 50 ms so that the merge does not depend on timing.
    c.batch_linger_us = 50_000;
    let a = Side::new(&c, 4 << 20);
    let b = Side::new(&cfg(), 4 << 20);
    let peer = a.connect_to(&b);
    a.fill(0, 4 << 20, 3);
    let before = a.t.standin_counters().unwrap();
    // 40 posts of one 1 KiB descriptor each, none contiguous with another.
    let ids: Vec<XferId> = (0..40u64)
        .map(|i| a.t.post(peer, Op::Write, &[x(a.region, i * 4096, b.region, i * 4096, 1024)]).unwrap())
        .collect();
    // One large post (above merge_threshold) travels in a list of its own.
    let big = a.t.post(peer, Op::Write, &[x(a.region, 1 << 20, b.region, 1 << 20, 1 << 20)]).unwrap();
    for id in ids.into_iter().chain([big]) {
        settle(&a.t, id).unwrap();
    }
    let after = a.t.standin_counters().unwrap();
    let calls = after.transfer_calls - before.transfer_calls;
    assert_eq!(after.descs - before.descs, 41);
    assert_eq!(calls, 6, "40 small descriptors in lists of 8, and the large one alone: {after:?}");
    assert_eq!(after.max_descs_per_call, 8);
    for i in 0..40usize {
        let s = a.bytes()[i * 4096..i * 4096 + 1024].to_vec();
        assert_eq!(s, b.bytes()[i * 4096..i * 4096 + 1024].to_vec());
    }

    // Batching off: one HIXL call per post, descriptors as given.
    let mut off = cfg();
    off.batch_enable = false;
    off.max_batch_size = Some(8);
    let o = Side::new(&off, 1 << 20);
    let peer = o.connect_to(&b);
    let ids: Vec<XferId> = (0..10u64)
        .map(|i| o.t.post(peer, Op::Read, &[x(o.region, i * 4096, b.region, i * 4096, 512)]).unwrap())
        .collect();
    for id in ids {
        settle(&o.t, id).unwrap();
    }
    assert_eq!(o.t.standin_counters().unwrap().transfer_calls, 10);

    // max_transfer_size splits long descriptors; contiguous ones of a post coalesce first.
    let mut split = cfg();
    split.max_transfer_size = Some(256 << 10);
    let s = Side::new(&split, 2 << 20);
    let peer = s.connect_to(&b);
    let batch: Vec<Xfer> =
        (0..4u64).map(|i| x(s.region, i * (256 << 10), b.region, i * (256 << 10), 256 << 10)).collect();
    let id = s.t.post(peer, Op::Read, &batch).unwrap();
    settle(&s.t, id).unwrap();
    let id = s.t.post(peer, Op::Read, &[x(s.region, 0, b.region, 0, 1 << 20)]).unwrap();
    settle(&s.t, id).unwrap();
    let c = s.t.standin_counters().unwrap();
    assert_eq!((c.transfer_calls, c.descs), (2, 8), "{c:?}");
    assert_eq!(&s.bytes()[..1 << 20], &b.bytes()[..1 << 20]);
}

#[test]
fn num_workers_bounds_requests_in_flight_async_and_sync() {
    for enable_async in [true, false] {
        let mut c = cfg();
        c.num_workers = Some(2);
        c.enable_async = Some(enable_async);
        let a = Side::new(&c, 4 << 20);
        let b = Side::new(&cfg(), 4 << 20);
        let peer = a.connect_to(&b);
        // Every request waits 20 ms in the library: the engine must hold the rest back.
        assert!(a.t.standin_inject("stall_ms=20:-1"));
        // Large descriptors (above merge_threshold) are a HIXL call each.
        let ids: Vec<XferId> = (0..8u64)
            .map(|i| {
                a.t.post(peer, Op::Write, &[x(a.region, i * (128 << 10), b.region, i * (128 << 10), 128 << 10)])
                    .unwrap()
            })
            .collect();
        for id in ids {
            settle(&a.t, id).unwrap();
        }
        let k = a.t.standin_counters().unwrap();
        assert_eq!(k.transfer_calls, 8, "{k:?}");
        assert!(k.max_outstanding <= 2 && k.max_outstanding >= 1, "async={enable_async}: {k:?}");
        if enable_async {
            assert_eq!(k.sync_calls, 0);
        } else {
            assert_eq!(k.sync_calls, 8);
        }
        // Sync workers bind the engine's context before calling (bind_thread).
        assert_eq!(k.wrong_thread, 0, "{k:?}");
        assert_eq!(&a.bytes()[..1 << 20], &b.bytes()[..1 << 20]);
    }
}

#[test]
fn transfer_timeout_disconnects_the_link_and_retries_or_fails() {
    // No retries: the timeout is the post's error, and the link was torn down (HIXL's rule).
    let mut c = cfg();
    c.timeout_ms = Some(100);
    c.retry_times = Some(0);
    let a = Side::new(&c, 1 << 20);
    let b = Side::new(&cfg(), 1 << 20);
    let peer = a.connect_to(&b);
    assert!(a.t.standin_inject("stall_ms=5000:1"));
    let t0 = Instant::now();
    let id = a.t.post(peer, Op::Write, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    assert_eq!(settle(&a.t, id), Err(TransportError::Timeout(Duration::from_millis(100))));
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let k = a.t.standin_counters().unwrap();
    assert_eq!(k.disconnects, 1, "{k:?}");
    // The next post reconnects by itself.
    a.fill(0, 4096, 5);
    let id = a.t.post(peer, Op::Write, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    settle(&a.t, id).unwrap();
    b.check(0, 4096, 5).unwrap();
    assert_eq!(a.t.standin_counters().unwrap().connects, 2);

    // One retry: the stalled request times out, the link is rebuilt, the second attempt lands.
    let mut c = cfg();
    c.timeout_ms = Some(100);
    c.retry_times = Some(1);
    let r = Side::new(&c, 1 << 20);
    let peer = r.connect_to(&b);
    assert!(r.t.standin_inject("stall_ms=5000:1"));
    r.fill(8192, 4096, 6);
    let id = r.t.post(peer, Op::Write, &[x(r.region, 8192, b.region, 8192, 4096)]).unwrap();
    settle(&r.t, id).unwrap();
    b.check(8192, 4096, 6).unwrap();
    let k = r.t.standin_counters().unwrap();
    assert_eq!((k.transfer_calls, k.disconnects, k.connects), (2, 1, 2), "{k:?}");
    assert_eq!(k.stale_status, 0, "a request of a disconnected link was queried: {k:?}");
}

#[test]
fn caller_timeout_cancels_and_disconnect_fails_pending_posts() {
    let a = Side::new(&cfg(), 1 << 20);
    let b = Side::new(&cfg(), 1 << 20);
    let peer = a.connect_to(&b);
    // The trait's wait: on its deadline it cancels; HIXL cannot cancel a running request, so the
    // engine drops the link, and wait returns once the post has settled.
    assert!(a.t.standin_inject("stall_ms=10000:1"));
    let id = a.t.post(peer, Op::Write, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let t0 = Instant::now();
    let r = rt.block_on(kvpool_transport::wait(&a.t, id, Duration::from_millis(100)));
    assert_eq!(r, Err(TransportError::Timeout(Duration::from_millis(100))));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(a.t.standin_counters().unwrap().disconnects, 1);
    // The link comes back for the next post.
    let id = a.t.post(peer, Op::Write, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    settle(&a.t, id).unwrap();

    // Disconnecting the peer fails what is still pending for it.
    assert!(a.t.standin_inject("stall_ms=10000:1"));
    let id = a.t.post(peer, Op::Write, &[x(a.region, 0, b.region, 0, 4096)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    a.t.disconnect(peer).unwrap();
    match settle(&a.t, id) {
        Err(TransportError::Io(m)) => assert!(m.contains("disconnected"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.t.standin_counters().unwrap().stale_status, 0);
}

#[test]
fn hixl_status_codes_become_errors_naming_causes() {
    let mut c = cfg();
    c.retry_times = Some(2);
    let a = Side::new(&c, 1 << 20);
    let b = Side::new(&cfg(), 1 << 20);
    let peer = a.connect_to(&b);
    let one = [x(a.region, 0, b.region, 0, 4096)];

    // NOT_CONNECTED is retried after a reconnect (twice here) and then succeeds.
    assert!(a.t.standin_inject("transfer=103902:2"));
    settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()).unwrap();
    // Three in a row exhaust retry_times = 2.
    assert!(a.t.standin_inject("transfer=103902:3"));
    match settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()) {
        Err(TransportError::Io(m)) => {
            assert!(
                m.contains("NOT_CONNECTED (103902)") && m.contains("Likely causes") && m.contains("hccn.conf"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    // PARAM_INVALID is not retried.
    let calls = a.t.standin_counters().unwrap().transfer_calls;
    assert!(a.t.standin_inject("transfer=103900:1"));
    match settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()) {
        Err(TransportError::Io(m)) => assert!(m.contains("PARAM_INVALID (103900)") && m.contains("registered"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.t.standin_counters().unwrap().transfer_calls, calls, "PARAM_INVALID was retried");
    // A request that ends FAILED.
    assert!(a.t.standin_inject("xfer_fail=1"));
    match settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()) {
        Err(TransportError::Io(m)) => assert!(m.contains("FAILED (503900)") && m.contains("ACL context"), "{m}"),
        other => panic!("{other:?}"),
    }
    // RESOURCE_EXHAUSTED backs off and retries.
    assert!(a.t.standin_inject("transfer=203900:1"));
    settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()).unwrap();

    // Register: memory HIXL would not accept (not from aclrtMallocHost / aclrtMalloc).
    let plain = vec![0u8; 1 << 16];
    let region = kvpool_transport::Region { addr: plain.as_ptr() as usize, len: plain.len(), kind: MemKind::Host };
    // SAFETY: `plain` outlives the attempt, which fails anyway.
    match unsafe { a.t.register(region) } {
        Err(TransportError::Io(m)) => {
            assert!(m.contains("RegisterMem failed: PARAM_INVALID (103900)") && m.contains("aclrtMallocHost"), "{m}")
        }
        other => panic!("{other:?}"),
    }

    // Connect to an engine that is gone: TIMEOUT, naming the listener and hccn.conf.
    let gone = {
        let g = Side::new(&cfg(), 1 << 16);
        g.t.local_metadata().unwrap()
    };
    let mut quick = cfg();
    quick.connect_timeout_ms = Some(200);
    let q = Side::new(&quick, 1 << 16);
    match q.t.connect(&gone) {
        Err(TransportError::Io(m)) => {
            assert!(m.contains("Connect failed: TIMEOUT (103901)") && m.contains("not listening"), "{m}");
            assert!(m.contains("hccn.conf"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    // Metadata that is not ours, or our own.
    assert!(matches!(q.t.connect(b"{}"), Err(TransportError::BadMetadata(_))));
    assert!(matches!(q.t.connect(&q.t.local_metadata().unwrap()), Err(TransportError::BadMetadata(_))));
    assert_eq!(a.t.standin_counters().unwrap().wrong_thread, 0);
}

#[test]
fn settings_reach_the_library_as_hixl_options() {
    let mut c = cfg();
    c.link_type = Some("hccs".into());
    c.memory.insert("buffer_pool".into(), "2:4".into());
    c.enable_async = Some(false);
    let t = HixlTransport::new(&c).unwrap();
    assert_eq!(t.standin_option("BufferPool").as_deref(), Some("2:4"));
    let g: serde_json::Value = serde_json::from_str(&t.standin_option("GlobalResourceConfig").unwrap()).unwrap();
    assert_eq!(g["comm_resource_config.protocol_desc"][0], "hccs:device");
    assert_eq!(t.standin_option("link_type"), None);
}

#[test]
fn missing_or_mismatched_library_is_refused_by_name() {
    let mut c = cfg();
    c.shim_path = Some("/nonexistent/libkvpool_hixl_shim.so".into());
    let e = HixlTransport::new(&c).err().unwrap();
    assert!(matches!(e, HixlError::LibraryMissing { .. }), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("/nonexistent/libkvpool_hixl_shim.so") && m.contains("libcann_hixl.so"), "{m}");
    assert!(kvpool_hixl::check_library(&c).is_err());

    c.shim_path = Some(env!("KVPOOL_HIXL_STANDIN_ABI999_LIB").into());
    match HixlTransport::new(&c).err().unwrap() {
        HixlError::AbiMismatch { found, expected, .. } => assert_eq!((found, expected), (999, 1)),
        other => panic!("{other:?}"),
    }
    // A library that is not a shim at all.
    c.shim_path = Some("libc.so.6".into());
    assert!(matches!(HixlTransport::new(&c).err().unwrap(), HixlError::MissingSymbol { .. }));
    assert!(kvpool_hixl::check_library(&cfg()).unwrap().contains("standin"));
}

#[test]
fn memory_registered_after_connect_is_reached_after_reconnecting() {
    let a = Side::new(&cfg(), 1 << 20);
    let b = Side::new(&cfg(), 1 << 20);
    let peer = a.connect_to(&b);
    let extra = b.t.alloc(1 << 16, MemKind::Host).unwrap();
    // SAFETY: `extra` outlives its use below.
    let extra_id = unsafe { b.t.register(extra.region()) }.unwrap();
    // With the old metadata the region is unknown here.
    let one = [x(a.region, 0, extra_id, 0, 4096)];
    assert_eq!(a.t.post(peer, Op::Write, &one), Err(TransportError::UnknownRegion(extra_id)));
    // New metadata: the same peer, a new link that sees the new memory.
    assert_eq!(a.connect_to(&b), peer);
    a.fill(0, 4096, 21);
    settle(&a.t, a.t.post(peer, Op::Write, &one).unwrap()).unwrap();
    assert_eq!(&settled(&extra)[..4096], &a.bytes()[..4096]);
    let k = a.t.standin_counters().unwrap();
    assert_eq!((k.connects, k.disconnects), (2, 1), "{k:?}");
}

// ---- two processes ----

const CHILD_ENV: &str = "KVPOOL_HIXL_TEST_CHILD_DIR";

fn wait_file(p: &Path) -> Vec<u8> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(b) = std::fs::read(p) {
            return b;
        }
        assert!(Instant::now() < end, "{} did not appear", p.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn publish(p: &Path, bytes: &[u8]) {
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(tmp, p).unwrap();
}

/// The peer process: run by `two_processes_*` through this same test binary; a no-op otherwise.
#[test]
fn child_peer_process() {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else { return };
    let me = Side::new(&cfg(), 1 << 20);
    // [0, 256K): pattern 1 for the parent to read; [256K, 512K): the parent writes pattern 2.
    me.fill(0, 256 << 10, 1);
    // Read the parent's pattern 3 into [512K, 768K) (this side initiates too).
    let parent = me.t.connect(&wait_file(&dir.join("parent.meta"))).unwrap();
    let batch: Vec<Xfer> =
        (0..16u64).map(|i| x(me.region, (512 << 10) + i * (16 << 10), RegionId(1), i * (16 << 10), 16 << 10)).collect();
    // The parent's region id is its first registration; check it is in its metadata by using it.
    let id = me.t.post(parent, Op::Read, &batch).unwrap();
    settle(&me.t, id).unwrap();
    me.check(512 << 10, 256 << 10, 3).unwrap();
    publish(&dir.join("child.meta"), &me.t.local_metadata().unwrap());
    wait_file(&dir.join("go"));
    if let Err(e) = me.check(256 << 10, 256 << 10, 2) {
        eprintln!("CHILD: parent's write did not land: {e}");
        std::process::exit(3);
    }
    me.t.disconnect(parent).unwrap();
    eprintln!("CHILD: ok");
}

#[test]
fn two_processes_write_read_and_see_the_peer_exit() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg();
    c.connect_timeout_ms = Some(200);
    c.retry_times = Some(1);
    let me = Side::new(&c, 1 << 20);
    assert_eq!(me.region, RegionId(1), "the child addresses this side's first region by id");
    me.fill(0, 256 << 10, 3);
    publish(&dir.path().join("parent.meta"), &me.t.local_metadata().unwrap());
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_peer_process", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let peer = me.t.connect(&wait_file(&dir.path().join("child.meta"))).unwrap();
    // The child's region is also its first; scattered reads of its pattern 1.
    let remote = RegionId(1);
    let reads: Vec<Xfer> = (0..64u64).map(|i| x(me.region, (512 << 10) + i * 4096, remote, i * 4096, 4096)).collect();
    settle(&me.t, me.t.post(peer, Op::Read, &reads).unwrap()).unwrap();
    me.check(512 << 10, 256 << 10, 1).unwrap();
    me.fill(256 << 10, 256 << 10, 2);
    let writes: Vec<Xfer> = (0..8u64)
        .map(|i| x(me.region, (256 << 10) + i * (32 << 10), remote, (256 << 10) + i * (32 << 10), 32 << 10))
        .collect();
    settle(&me.t, me.t.post(peer, Op::Write, &writes).unwrap()).unwrap();
    publish(&dir.path().join("go"), b"go");
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status:?}");

    // The peer process is gone: transfers to it fail (after the retry's reconnect times out).
    match settle(&me.t, me.t.post(peer, Op::Read, &reads[..1]).unwrap()) {
        Err(TransportError::Io(m)) => assert!(m.contains("103902") || m.contains("103901"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(me.t.standin_counters().unwrap().wrong_thread, 0);
}
