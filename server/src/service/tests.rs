//! The request handler driven in memory: framing rules, deadlines, cancellation, tenant scoping.

use super::memory::{MemRecv, MemSend};
use super::*;
use crate::auth::Principal;
use crate::config::{ApiKeyEntry, Config, Size};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{
    close, codec, ErrorCode, GetResponse, LookupResponse, PutRequest, Request, Response, StatsReport, StatusList,
};
use kvpool_proto::{KeysRequest, LookupRequest, PinSpec, PutItem, PutMode};
use std::time::{Duration, Instant};

const KEY_A: &str = "key-a";
const KEY_B: &str = "key-b";
const KEY_ADMIN: &str = "key-admin";

async fn node(dir: &std::path::Path, tweak: impl FnOnce(&mut Config)) -> crate::Node {
    let mut cfg = Config::default();
    cfg.server.data_dir = dir.to_path_buf();
    cfg.dram.size = Size(8 << 20);
    cfg.ssd.capacity = Size(0);
    cfg.cache.put_wait_ms = 200;
    cfg.limits.request_timeout_ms = 300;
    cfg.limits.min_transfer_rate = Size(1 << 20);
    let entry = |tenant: &str, key: &str, admin| ApiKeyEntry {
        tenant: tenant.into(),
        sha256: hex::encode(crate::auth::hash_key(key)),
        admin,
    };
    cfg.auth.keys = vec![entry("alice", KEY_A, false), entry("bob", KEY_B, false), entry("ops", KEY_ADMIN, true)];
    tweak(&mut cfg);
    crate::open_node(&cfg).await.expect("node opens")
}

fn principal(n: &crate::Node, key: &str) -> Principal {
    n.shared.auth.check(key).expect("known key")
}

/// Run one request stream; returns the decoded response (if any), trailing bytes, and the halves.
async fn run(
    n: &crate::Node,
    key: &str,
    recv: MemRecv,
    send: MemSend,
) -> (Option<Response>, Vec<u8>, MemRecv, MemSend) {
    let session = Session::new(principal(n, key), kvpool_proto::PROTOCOL_VERSION, None);
    let (mut recv, mut send) = (recv, send);
    handle_stream(&mut recv, &mut send, &session, &n.shared).await;
    let parsed = (send.written.len() >= 4).then(|| {
        let len = u32::from_le_bytes(send.written[..4].try_into().unwrap()) as usize;
        let resp = codec::decode::<Response>(&send.written[4..4 + len]).expect("server frames decode");
        (resp, send.written[4 + len..].to_vec())
    });
    match parsed {
        Some((r, rest)) => (Some(r), rest, recv, send),
        None => (None, Vec::new(), recv, send),
    }
}

fn put_frame(items: &[(&str, u64)]) -> Vec<u8> {
    let req = Request::Put(PutRequest {
        mode: PutMode::Insert,
        items: items
            .iter()
            .map(|(k, size)| PutItem {
                key: k.as_bytes().to_vec(),
                size: *size,
                parent: None,
                tokens: 0,
                seq_tokens: 0,
                pin: PinSpec::None,
            })
            .collect(),
    });
    encode_frame(&req).unwrap()
}

fn code_of(r: &Option<Response>) -> Option<ErrorCode> {
    match r {
        Some(Response::Error(e)) => Some(e.code),
        _ => None,
    }
}

async fn get(n: &crate::Node, key: &str, k: &str) -> Option<Vec<u8>> {
    let frame = encode_frame(&Request::Get(KeysRequest { keys: vec![k.as_bytes().to_vec()] })).unwrap();
    let (r, rest, _, _) = run(n, key, MemRecv::new(frame), MemSend::default()).await;
    match r {
        Some(Response::Get(g)) if g.items[0].status == ErrorCode::Ok => Some(rest),
        Some(Response::Get(_)) => None,
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn exact_values_then_fin_are_stored() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut bytes = put_frame(&[("a", 4), ("zero", 0), ("b", 3)]);
    bytes.extend_from_slice(b"abcdxyz");
    let (r, _, recv, send) = run(&n, KEY_A, MemRecv::new(bytes), MemSend::default()).await;
    assert_eq!(r, Some(Response::Put(StatusList { results: vec![ErrorCode::Ok; 3] })));
    assert!(send.finished && recv.stopped.is_none());
    assert_eq!(get(&n, KEY_A, "a").await.unwrap(), b"abcd");
    assert_eq!(get(&n, KEY_A, "zero").await.unwrap(), b"");
    assert_eq!(get(&n, KEY_A, "b").await.unwrap(), b"xyz");
}

#[tokio::test]
async fn more_value_bytes_than_declared_is_malformed_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut bytes = put_frame(&[("first", 2), ("over", 4)]);
    bytes.extend_from_slice(b"ok0123456789");
    let (r, _, recv, _) = run(&n, KEY_A, MemRecv::new(bytes), MemSend::default()).await;
    assert_eq!(code_of(&r), Some(ErrorCode::Malformed));
    assert_eq!(recv.stopped, Some(close::PROTOCOL));
    assert_eq!(get(&n, KEY_A, "first").await, None, "no item of a malformed put is stored");
    assert_eq!(get(&n, KEY_A, "over").await, None);
    assert_eq!(n.shared.store.dram_used(), 0, "reservations released");
}

#[tokio::test]
async fn trailing_bytes_after_any_frame_are_malformed_and_have_no_effect() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut put = put_frame(&[("k", 1)]);
    put.push(b'v');
    assert!(matches!(run(&n, KEY_A, MemRecv::new(put), MemSend::default()).await.0, Some(Response::Put(_))));
    for req in [
        Request::Lookup(LookupRequest { chain: vec![b"k".to_vec()] }),
        Request::Stats,
        Request::Remove(kvpool_proto::RemoveRequest { keys: vec![b"k".to_vec()], force: true }),
        Request::RemoveAll(kvpool_proto::RemoveAllRequest { force: true }),
        Request::Ping(kvpool_proto::Ping { nonce: 1 }),
    ] {
        let mut bytes = encode_frame(&req).unwrap();
        bytes.extend_from_slice(b"junk");
        let (r, _, _, _) = run(&n, KEY_A, MemRecv::new(bytes), MemSend::default()).await;
        assert_eq!(code_of(&r), Some(ErrorCode::Malformed), "{req:?}");
    }
    assert_eq!(get(&n, KEY_A, "k").await.unwrap(), b"v", "the removes with trailing junk did nothing");
}

#[tokio::test]
async fn a_stalled_put_times_out_and_releases_its_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut bytes = put_frame(&[("big", 4 << 20)]);
    bytes.extend_from_slice(&[7u8; 1000]);
    let started = Instant::now();
    let (r, _, recv, _) = run(&n, KEY_A, MemRecv::stall_after(bytes), MemSend::default()).await;
    // 300 ms + 4 MiB at 1 MiB/s.
    assert!(started.elapsed() < Duration::from_secs(10), "deadline bounded: {:?}", started.elapsed());
    assert!(started.elapsed() >= Duration::from_secs(4));
    assert_eq!(code_of(&r), Some(ErrorCode::Timeout));
    assert_eq!(recv.stopped, Some(close::TIMEOUT));
    assert_eq!(n.shared.store.dram_used(), 0);
    assert_eq!(n.shared.metrics.errors.with_label_values(&["timeout"]).get(), 1);
}

#[tokio::test]
async fn a_partial_frame_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut bytes = 100u32.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[1, 2, 3]);
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::stall_after(bytes), MemSend::default()).await;
    assert_eq!(code_of(&r), Some(ErrorCode::Timeout));
    // A complete frame whose stream is never finished.
    let bytes = encode_frame(&Request::Stats).unwrap();
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::stall_after(bytes), MemSend::default()).await;
    assert_eq!(code_of(&r), Some(ErrorCode::Timeout));
}

#[tokio::test]
async fn a_peer_reset_is_cancelled_not_internal() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut bytes = put_frame(&[("r", 1 << 20)]);
    bytes.extend_from_slice(&[1u8; 4096]);
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::reset_after(bytes), MemSend::default()).await;
    assert_eq!(r, None, "nothing is answered to a reset stream");
    assert_eq!(n.shared.metrics.cancelled.with_label_values(&["put"]).get(), 1);
    assert_eq!(n.shared.metrics.errors.with_label_values(&["internal"]).get(), 0);
    assert_eq!(n.shared.metrics.op_errors.with_label_values(&["put"]).get(), 0);
    assert_eq!(n.shared.store.dram_used(), 0);
    // A reset in the middle of a frame, too.
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::reset_after(vec![9, 0, 0]), MemSend::default()).await;
    assert_eq!(r, None);
    assert_eq!(n.shared.metrics.cancelled.with_label_values(&["unknown"]).get(), 1);
}

#[tokio::test]
async fn a_reader_that_stops_reading_is_reset_and_releases_the_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |c| c.cache.lease_ttl_ms = 50).await;
    let mut bytes = put_frame(&[("v", 2 << 20)]);
    bytes.extend(std::iter::repeat_n(3u8, 2 << 20));
    run(&n, KEY_A, MemRecv::new(bytes), MemSend::default()).await;
    let used = n.shared.store.dram_used();
    let frame = encode_frame(&Request::Get(KeysRequest { keys: vec![b"v".to_vec()] })).unwrap();
    let send = MemSend { capacity: Some(4096), ..MemSend::default() };
    let (_, _, _, send) = run(&n, KEY_A, MemRecv::new(frame), send).await;
    assert_eq!(send.reset, Some(close::TIMEOUT));
    // The block can be removed and its memory is free again: nothing holds it.
    tokio::time::sleep(Duration::from_millis(60)).await;
    let removed = n.shared.store.remove(principal(&n, KEY_A).tenant_id, &[b"v".to_vec()], false);
    let removed: Vec<ErrorCode> = removed.into_iter().map(super::dispatch::remove_code).collect();
    assert_eq!(removed, vec![ErrorCode::Ok]);
    assert!(n.shared.store.dram_used() < used);
}

#[tokio::test]
async fn empty_batches_and_repeated_keys() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::new(put_frame(&[])), MemSend::default()).await;
    assert_eq!(r, Some(Response::Put(StatusList { results: vec![] })));
    let frame = encode_frame(&Request::Get(KeysRequest { keys: vec![] })).unwrap();
    assert_eq!(
        run(&n, KEY_A, MemRecv::new(frame), MemSend::default()).await.0,
        Some(Response::Get(GetResponse { items: vec![] }))
    );
    let frame = encode_frame(&Request::Lookup(LookupRequest { chain: vec![] })).unwrap();
    assert_eq!(
        run(&n, KEY_A, MemRecv::new(frame), MemSend::default()).await.0,
        Some(Response::Lookup(LookupResponse { resident: 0 }))
    );
    // Insert of a key twice in one put: the first wins, the second is already-exists.
    let mut bytes = put_frame(&[("dup", 1), ("dup", 1)]);
    bytes.extend_from_slice(b"12");
    let (r, _, _, _) = run(&n, KEY_A, MemRecv::new(bytes), MemSend::default()).await;
    assert_eq!(r, Some(Response::Put(StatusList { results: vec![ErrorCode::Ok, ErrorCode::AlreadyExists] })));
    assert_eq!(get(&n, KEY_A, "dup").await.unwrap(), b"1");
}

#[tokio::test]
async fn stats_are_scoped_to_the_tenant_for_non_admin_keys() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let mut a = put_frame(&[("a1", 1000), ("a2", 1000)]);
    a.extend(std::iter::repeat_n(1u8, 2000));
    run(&n, KEY_A, MemRecv::new(a), MemSend::default()).await;
    let mut b = put_frame(&[("b1", 10)]);
    b.extend(std::iter::repeat_n(2u8, 10));
    run(&n, KEY_B, MemRecv::new(b), MemSend::default()).await;
    get(&n, KEY_B, "b1").await.unwrap();
    assert_eq!(get(&n, KEY_B, "nope").await, None);
    let stats = |key| {
        let n = &n;
        async move {
            let frame = encode_frame(&Request::Stats).unwrap();
            match run(n, key, MemRecv::new(frame), MemSend::default()).await.0 {
                Some(Response::Stats(s)) => s,
                other => panic!("{other:?}"),
            }
        }
    };
    let sa = stats(KEY_A).await;
    let sb = stats(KEY_B).await;
    let so = stats(KEY_ADMIN).await;
    assert_eq!((sa.blocks, sb.blocks, so.blocks), (2, 1, 3));
    assert_eq!(sa.tiers[0].blocks, 2);
    assert_eq!(sa.tiers[0].used_bytes, 2 * 1024, "two 1000-byte values at 256-byte granularity");
    assert_eq!((sa.tiers[0].hits, sa.tiers[0].misses), (0, 0), "bob's reads are not alice's");
    assert_eq!((sb.tiers[0].hits, sb.tiers[0].misses), (1, 1));
    let put_ops = |s: &StatsReport| s.ops.iter().find(|o| o.op == "put").unwrap().count;
    assert_eq!((put_ops(&sa), put_ops(&sb), put_ops(&so)), (1, 1, 2));
}

/// A master fed hostile cluster requests from every kind of key: every one gets a typed answer,
/// none panics, and the master's view stays consistent (a route names only nodes it lists).
#[tokio::test(flavor = "current_thread")]
async fn a_master_answers_hostile_cluster_requests_with_typed_errors() {
    use kvpool_proto::{KvEventKind, NodeBlock, NodeJoinRequest, NodeReportRequest, PlaceRequest, TierUse};
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |c| c.cluster.role = crate::config::Role::Master).await;
    // A small deterministic generator (xorshift): the same inputs every run.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..3000 {
        let r = next();
        let key = [KEY_A, KEY_B, KEY_ADMIN][(r % 3) as usize];
        let bytes = |len: u64| (0..len).map(|j| (j as u8).wrapping_mul(r as u8)).collect::<Vec<u8>>();
        let node_id = (next() % 6) as u32;
        let req = match next() % 6 {
            0 => Request::NodeJoin(NodeJoinRequest {
                name: format!("n{}", next() % 4),
                addr: if next() % 5 == 0 { String::new() } else { format!("127.0.0.1:{}", 7000 + i) },
                server_name: "localhost".into(),
                fingerprint: bytes(if next() % 4 == 0 { next() % 64 } else { 32 }),
                incarnation: next() % 3,
                tiers: vec![TierUse { tier: (next() % 5) as u8, capacity: next(), used: next() }],
            }),
            1 | 2 => Request::NodeReport(NodeReportRequest {
                node: node_id,
                incarnation: next() % 3,
                reset: next() % 7 == 0,
                tiers: vec![TierUse { tier: (next() % 4) as u8, capacity: next() % 1000, used: next() }],
                blocks: (0..next() % 20)
                    .map(|_| NodeBlock {
                        kind: [KvEventKind::Stored, KvEventKind::Removed, KvEventKind::Evicted][(next() % 3) as usize],
                        tier: (next() % 5) as u8,
                        tenant: ["alice", "bob", "ops", "stranger"][(next() % 4) as usize].into(),
                        key: bytes(next() % 8 + u64::from(next() % 50 == 0) * 2000),
                        parent: (next() % 2 == 0).then(|| bytes(3)),
                        size: next(),
                    })
                    .collect(),
            }),
            3 => Request::Route(KeysRequest { keys: (0..next() % 10).map(|_| bytes(next() % 8)).collect() }),
            4 => Request::Place(PlaceRequest {
                items: (0..next() % 10)
                    .map(|_| PutItem {
                        key: bytes(next() % 8 + 1),
                        size: next() % (1 << 30),
                        parent: (next() % 2 == 0).then(|| bytes(next() % 8)),
                        tokens: next() as u32,
                        seq_tokens: next(),
                        pin: PinSpec::None,
                    })
                    .collect(),
                replicas: [0, 1, 2, 3, u32::MAX][(next() % 5) as usize],
            }),
            _ => Request::Nodes,
        };
        let (resp, _, _, _) = run(&n, key, MemRecv::new(encode_frame(&req).unwrap()), MemSend::default()).await;
        let label = match resp.expect("every request is answered") {
            Response::Error(e) => e.code.name().to_string(),
            Response::Routes(routes) => {
                let listed: Vec<u32> = routes.nodes.iter().map(|a| a.node).collect();
                assert!(routes.items.iter().flatten().all(|id| listed.contains(id)), "{routes:?}");
                "routes".into()
            }
            other => format!("{other:?}").split(['(', ' ']).next().unwrap().to_string(),
        };
        *answers.entry(label).or_default() += 1;
    }
    // Joins, reports, routes and placements all happened, and so did refusals.
    for seen in ["NodeJoined", "Done", "routes", "NodeList", "forbidden", "expired", "invalid-argument"] {
        assert!(answers.contains_key(seen), "{seen} never answered: {answers:?}");
    }
    // The pool keeps serving: a join and a report still work.
    let join = Request::NodeJoin(NodeJoinRequest {
        name: "last".into(),
        addr: "127.0.0.1:1".into(),
        server_name: "localhost".into(),
        fingerprint: vec![1; 32],
        incarnation: 5,
        tiers: Vec::new(),
    });
    let (resp, ..) = run(&n, KEY_ADMIN, MemRecv::new(encode_frame(&join).unwrap()), MemSend::default()).await;
    assert!(matches!(resp, Some(Response::NodeJoined(_))), "{resp:?}");
}

/// A node put stores blocks as the named tenant's, for admin keys only, and only for a tenant
/// some key of this node names.
#[tokio::test(flavor = "current_thread")]
async fn node_puts_store_for_a_known_tenant_and_only_from_admin_keys() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), |_| {}).await;
    let node_put = |tenant: &str| {
        let req = Request::NodePut(kvpool_proto::NodePutRequest {
            tenant: tenant.into(),
            mode: PutMode::Insert,
            items: vec![PutItem {
                key: b"moved".to_vec(),
                size: 3,
                parent: None,
                tokens: 0,
                seq_tokens: 0,
                pin: PinSpec::None,
            }],
        });
        let mut bytes = encode_frame(&req).unwrap();
        bytes.extend_from_slice(b"abc");
        MemRecv::new(bytes)
    };
    let (r, ..) = run(&n, KEY_A, node_put("alice"), MemSend::default()).await;
    assert_eq!(code_of(&r), Some(ErrorCode::Forbidden), "{r:?}");
    let (r, ..) = run(&n, KEY_ADMIN, node_put("nobody"), MemSend::default()).await;
    assert_eq!(code_of(&r), Some(ErrorCode::InvalidArgument), "{r:?}");
    let (r, ..) = run(&n, KEY_ADMIN, node_put("alice"), MemSend::default()).await;
    assert!(matches!(&r, Some(Response::Put(l)) if l.results == vec![ErrorCode::Ok]), "{r:?}");
    // It is alice's block: she finds it, bob does not, and the admin's own tenant does not.
    for (key, present) in [(KEY_A, true), (KEY_B, false), (KEY_ADMIN, false)] {
        let req = Request::Exists(KeysRequest { keys: vec![b"moved".to_vec()] });
        match run(&n, key, MemRecv::new(encode_frame(&req).unwrap()), MemSend::default()).await.0 {
            Some(Response::Exists(e)) => assert_eq!(e.present, vec![present], "{key}"),
            other => panic!("{other:?}"),
        }
    }
}
