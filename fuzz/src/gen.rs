//! Inputs: well-formed requests (so that inputs reach deep into the handler), then byte-level
//! mutations of them (so that every decoder and framing rule is hit with near-valid bytes).

use kvpool_proto::frame::encode_frame;
use kvpool_proto::{
    BufSlice, EventScope, GetIntoRequest, KeysRequest, KvEventKind, LookupLeaseRequest, LookupRequest, NodeBlock,
    NodePutRequest, NodeReportRequest, PinSpec, Ping, PlaceRequest, PolicyKind, PolicyLoadRequest,
    PolicyRollbackRequest, PutDoneRequest, PutFromRequest, PutIntentRequest, PutItem, PutMode, PutRequest, ReadRequest,
    ReleaseRequest, RemoveAllRequest, RemoveMatchingRequest, RemoveRequest, Request, SubscribeRequest, TierUse,
    WriteRequest,
};
use rand::rngs::StdRng;
use rand::Rng;

/// How the client ends its stream after the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Fin,
    Reset,
    Stall,
}

#[derive(Debug, Clone)]
pub struct Input {
    pub bytes: Vec<u8>,
    pub ending: Ending,
    /// Which API key sends it (index into the driver's keys).
    pub key: usize,
    /// The response can only be read this slowly (bytes), or freely.
    pub read_limit: Option<usize>,
}

fn key(rng: &mut StdRng) -> Vec<u8> {
    match rng.gen_range(0..60) {
        // A small key space so that puts, gets and removes meet each other.
        0..=57 => format!("k{}", rng.gen_range(0..48)).into_bytes(),
        58 => Vec::new(),
        _ => (0..rng.gen_range(1..1100)).map(|_| rng.gen()).collect(),
    }
}

fn keys(rng: &mut StdRng) -> Vec<Vec<u8>> {
    let n = match rng.gen_range(0..20) {
        0 => 0,
        1 => rng.gen_range(60..80),
        _ => rng.gen_range(1..8),
    };
    (0..n).map(|_| key(rng)).collect()
}

fn value_size(rng: &mut StdRng) -> u64 {
    match rng.gen_range(0..20) {
        0 => 0,
        1 if rng.gen_bool(0.05) => rng.gen_range(1..3 << 20),
        2 => u64::MAX - rng.gen_range(0..3),
        _ => rng.gen_range(1..9000),
    }
}

fn put_items(rng: &mut StdRng) -> Vec<PutItem> {
    (0..rng.gen_range(0..6))
        .map(|_| PutItem {
            key: key(rng),
            size: value_size(rng),
            parent: rng.gen_bool(0.4).then(|| key(rng)),
            tokens: rng.gen(),
            seq_tokens: rng.gen_range(0..4096),
            pin: match rng.gen_range(0..6) {
                0 => PinSpec::Soft { ttl_ms: rng.gen_range(0..2000) },
                1 => PinSpec::Hard,
                _ => PinSpec::None,
            },
        })
        .collect()
}

fn mode(rng: &mut StdRng) -> PutMode {
    if rng.gen_bool(0.3) {
        PutMode::Upsert
    } else {
        PutMode::Insert
    }
}

/// A part of a shared buffer: the driver shares regions 1 and 2 (0 and 3 do not exist).
fn slice(rng: &mut StdRng, len: u64) -> BufSlice {
    let len = if rng.gen_bool(0.9) { len } else { rng.gen() };
    BufSlice {
        region: rng.gen_range(0..4),
        offset: if rng.gen_bool(0.8) { rng.gen_range(0..(2 << 20)) } else { rng.gen() },
        len,
    }
}

thread_local! {
    /// Reservation and lease names the fuzzed sessions hold now (set by the driver).
    pub static HELD: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A reservation or lease name: mostly ones a session really holds.
fn small_id(rng: &mut StdRng) -> u64 {
    let held = HELD.with(|h| h.borrow().clone());
    match rng.gen_range(0..10) {
        0..=6 if !held.is_empty() => held[rng.gen_range(0..held.len())],
        7 => rng.gen(),
        _ => rng.gen_range(0..12),
    }
}

/// A well-formed version 2 request.
fn request_v2(rng: &mut StdRng) -> Request {
    match rng.gen_range(0..14) {
        12 => Request::LookupLease(LookupLeaseRequest {
            chain: keys(rng),
            ttl_ms: match rng.gen_range(0..4) {
                0 => 0,
                1 => rng.gen(),
                _ => rng.gen_range(1..3_000),
            },
        }),
        13 => Request::RemoveMatching(RemoveMatchingRequest {
            prefix: if rng.gen_bool(0.7) { format!("k{}", rng.gen_range(0..5)).into_bytes() } else { key(rng) },
            pattern: match rng.gen_range(0..6) {
                0 => Some(format!("^k{}$", rng.gen_range(0..48))),
                1 => Some("(a+)+$[".into()),
                2 => Some("k(1|2)\\d{0,1000}{1000}".into()),
                3 => Some((0..rng.gen_range(0..64)).map(|_| rng.gen_range(32u8..127) as char).collect()),
                _ => None,
            },
            force: rng.gen(),
        }),
        // Cluster requests: this server is no master, so they are refused with a typed error
        // (the master's side has its own hostile-input test in the server crate).
        10 => match rng.gen_range(0..4) {
            // The fuzzed tenants (the leak check clears them; canaries stay untouched), or one no
            // key names (refused).
            3 => Request::NodePut(NodePutRequest {
                tenant: ["alice", "bob", "ops", "stranger"][rng.gen_range(0..4)].into(),
                mode: mode(rng),
                items: put_items(rng),
            }),
            0 => Request::Nodes,
            1 => Request::Route(KeysRequest { keys: keys(rng) }),
            _ => Request::Place(PlaceRequest { items: put_items(rng), replicas: rng.gen_range(0..4) }),
        },
        11 => Request::NodeReport(NodeReportRequest {
            node: rng.gen_range(0..4),
            incarnation: rng.gen(),
            reset: rng.gen(),
            tiers: vec![TierUse { tier: rng.gen_range(0..4), capacity: rng.gen(), used: rng.gen() }],
            blocks: keys(rng)
                .into_iter()
                .map(|key| NodeBlock {
                    kind: KvEventKind::Stored,
                    tier: rng.gen_range(0..4),
                    tenant: "t".into(),
                    key,
                    parent: None,
                    size: rng.gen(),
                })
                .collect(),
        }),
        0 if rng.gen_bool(0.2) => Request::LocalAttach,
        0 if rng.gen_bool(0.2) => Request::BulkAttach(kvpool_proto::BulkAttachRequest { plaintext: rng.gen() }),
        0 => Request::ShmAttach,
        1 => Request::PutIntent(PutIntentRequest { mode: mode(rng), items: put_items(rng) }),
        2 => {
            Request::PutDone(PutDoneRequest { reservations: (0..rng.gen_range(0..5)).map(|_| small_id(rng)).collect() })
        }
        3 => Request::Write(WriteRequest {
            reservation: small_id(rng),
            offset: rng.gen_range(0..10_000),
            size: rng.gen_range(0..20_000),
        }),
        4 => Request::GetLocate(KeysRequest { keys: keys(rng) }),
        5 => Request::Read(ReadRequest {
            lease: small_id(rng),
            index: rng.gen_range(0..6),
            offset: rng.gen_range(0..2_000),
            size: if rng.gen_bool(0.9) { rng.gen_range(0..4_000) } else { rng.gen() },
        }),
        6 if rng.gen_bool(0.3) => Request::Subscribe(SubscribeRequest {
            from: rng.gen_bool(0.5).then(|| if rng.gen_bool(0.8) { rng.gen_range(0..100) } else { rng.gen() }),
            scope: if rng.gen_bool(0.5) { EventScope::Tenant } else { EventScope::All },
            max_batch: if rng.gen_bool(0.8) { rng.gen_range(0..2_000) } else { rng.gen() },
        }),
        6 => Request::Release(ReleaseRequest { lease: small_id(rng) }),
        7 | 8 => {
            let items = put_items(rng);
            let sources = items.iter().map(|i| slice(rng, i.size)).collect();
            Request::PutFrom(PutFromRequest { mode: mode(rng), items, sources })
        }
        _ => {
            let keys = keys(rng);
            let dests = keys
                .iter()
                .map(|_| {
                    let room = rng.gen_range(0..(3 << 20));
                    slice(rng, room)
                })
                .collect();
            Request::GetInto(GetIntoRequest { keys, dests })
        }
    }
}

/// A well-formed request and the value bytes it declares.
pub fn request(rng: &mut StdRng) -> (Request, Vec<u8>) {
    let req = match rng.gen_range(0..32) {
        24..=31 => request_v2(rng),
        0..=7 => Request::Put(PutRequest { mode: mode(rng), items: put_items(rng) }),
        8..=12 => Request::Get(KeysRequest { keys: keys(rng) }),
        13..=14 => Request::Lookup(LookupRequest { chain: keys(rng) }),
        15 => Request::Exists(KeysRequest { keys: keys(rng) }),
        16..=17 => Request::Remove(RemoveRequest { keys: keys(rng), force: rng.gen() }),
        18 => Request::RemoveAll(RemoveAllRequest { force: rng.gen() }),
        19 => Request::Stats,
        20 => Request::Ping(Ping { nonce: rng.gen() }),
        21 => Request::PolicyList,
        22 => Request::PolicyRollback(PolicyRollbackRequest { kind: policy_kind(rng) }),
        _ => Request::PolicyLoad(PolicyLoadRequest {
            kind: policy_kind(rng),
            name: "fuzz".into(),
            params: vec![("a".into(), "1".into())],
            module_size: rng.gen_range(0..512),
        }),
    };
    let declared: u64 = match &req {
        Request::Put(p) => p.items.iter().map(|i| i.size.min(4 << 20)).sum(),
        Request::NodePut(p) => p.items.iter().map(|i| i.size.min(4 << 20)).sum(),
        Request::PolicyLoad(l) => l.module_size,
        Request::Write(w) => w.size,
        _ => 0,
    };
    // Content does not steer the handler (only sizes do): a cheap fill keeps big values cheap.
    let seed: u8 = rng.gen();
    let values = (0..declared).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
    (req, values)
}

fn policy_kind(rng: &mut StdRng) -> PolicyKind {
    [PolicyKind::Eviction, PolicyKind::Admission, PolicyKind::Placement][rng.gen_range(0..3)]
}

/// Byte-level damage of a well-formed stream.
pub fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..rng.gen_range(1..4) {
        let len = bytes.len();
        match rng.gen_range(0..10) {
            0 if len > 0 => {
                let i = rng.gen_range(0..len);
                bytes[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.gen_range(0..len);
                bytes[i] = [0, 1, 0x7f, 0x80, 0xff][rng.gen_range(0..5)];
            }
            2 if len > 0 => bytes.truncate(rng.gen_range(0..len)),
            3 => bytes.extend((0..rng.gen_range(1..64)).map(|_| rng.gen::<u8>())),
            // The frame length: too short, too long, huge.
            4 if len >= 4 => {
                let v = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                let n = match rng.gen_range(0..3) {
                    0 => v.saturating_sub(rng.gen_range(1..9)),
                    1 => v.saturating_add(rng.gen_range(1..9)),
                    _ => rng.gen(),
                };
                bytes[..4].copy_from_slice(&n.to_le_bytes());
            }
            // A u64 length or count inside the body set to something absurd.
            5 if len >= 16 => {
                let i = rng.gen_range(4..len - 8);
                let v: u64 = [u64::MAX, 1 << 40, 1 << 20, 0][rng.gen_range(0..4)];
                bytes[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            // The enum tag of the request.
            6 if len >= 8 => bytes[4..8].copy_from_slice(&rng.gen_range(0u32..24).to_le_bytes()),
            7 if !other.is_empty() => {
                let cut = rng.gen_range(0..=len);
                let from = rng.gen_range(0..other.len());
                bytes.truncate(cut);
                bytes.extend_from_slice(&other[from..]);
            }
            8 => bytes.extend_from_slice(&bytes.clone()),
            _ => {
                if len > 1 {
                    let (a, b) = (rng.gen_range(0..len), rng.gen_range(0..len));
                    bytes.swap(a, b);
                }
            }
        }
    }
}

/// One input: mostly valid, a third damaged, a few pure noise.
pub fn input(rng: &mut StdRng, keys: usize, last: &[u8]) -> Input {
    let mut bytes = match rng.gen_range(0..30) {
        0 => (0..rng.gen_range(0..80)).map(|_| rng.gen()).collect(),
        _ => {
            let (req, values) = request(rng);
            let mut b = encode_frame(&req).expect("generated requests encode");
            b.extend_from_slice(&values);
            b
        }
    };
    if rng.gen_bool(0.35) {
        mutate(rng, &mut bytes, last);
    }
    let ending = match rng.gen_range(0..40) {
        0 => Ending::Stall,
        1 | 2 => {
            // A reset somewhere in the middle.
            if !bytes.is_empty() {
                let cut = rng.gen_range(0..bytes.len());
                bytes.truncate(cut);
            }
            Ending::Reset
        }
        _ => Ending::Fin,
    };
    Input { bytes, ending, key: rng.gen_range(0..keys), read_limit: rng.gen_bool(0.01).then(|| rng.gen_range(0..64)) }
}
