//! Each standard policy gives the same answers natively and through Wasm, on the same
//! scenarios (components built from source by this test).

mod common;

use common::{random_batch, Oracle, Rng};
use kvpool_policies as pol;
use kvpool_policy_host::{HostConfig, PolicyEngine, PolicyKind, WasmAdmission, WasmEviction, WasmPlacement};
use kvpool_policy_sdk::{
    AdmissionPolicy, AdmitBatch, AdmitRequest, Event, Events, EvictionPolicy, FromParams, NodeSet, Params, PlaceBatch,
    PlaceRequest, PlacementPolicy, Tier, NO_NODE, NO_PARENT,
};

fn engine() -> PolicyEngine {
    PolicyEngine::new(HostConfig::default()).expect("engine")
}

fn load(engine: &PolicyEngine, name: &str, kind: PolicyKind, params: &Params) -> kvpool_policy_host::LoadedModule {
    let wasm = common::standard().get(name).unwrap_or_else(|| panic!("component {name} not built"));
    engine.load(name, kind, wasm, params).expect("load")
}

/// Drive native and Wasm with the same events; compare victims often; evict what they chose.
fn eviction_same<P: EvictionPolicy + FromParams>(name: &str, params: &[(&str, &str)]) {
    let params = Params::from_pairs(params.iter().copied());
    let engine = engine();
    let module = load(&engine, name, PolicyKind::Eviction, &params);
    let mut wasm = WasmEviction::new(&module).expect("instantiate");
    let mut native = P::from_params(&params).expect("params");
    let mut oracle = Oracle::default();
    let mut rng = Rng(0x5eed ^ name.len() as u64);
    let mut next_id = 1;
    let mut checks = 0;
    let mut multi = 0;
    for round in 0..60 {
        let n = [1, 7, 64, 300][round % 4];
        let batch = random_batch(&mut rng, &oracle, &mut next_id, n);
        oracle.apply(&batch);
        native.on_events(&batch);
        wasm.try_on_events(&batch).expect("on-events");
        for tier in [Tier::Dram, Tier::Ssd] {
            let resident = oracle.resident(tier);
            let exclude: Vec<u64> = resident.iter().copied().filter(|_| rng.below(10) == 0).collect();
            let bytes = 100 * (1 + rng.below(20));
            let a = native.victims(tier, bytes, &exclude);
            let b = wasm.try_victims(tier, bytes, &exclude).expect("victims");
            assert_eq!(a, b, "{name}: round {round} tier {tier:?}");
            checks += 1;
            multi += usize::from(a.len() > 1);
            // The host evicts the victims when the store is over a watermark.
            if resident.len() > 150 {
                let removed: Events = a.iter().map(|&id| Event::removed(id, tier)).collect();
                oracle.apply(&removed);
                native.on_events(&removed);
                wasm.try_on_events(&removed).expect("on-events");
            }
        }
    }
    assert!(checks >= 120);
    // The scenarios must exercise real choices, not agree on empty answers.
    assert!(multi > checks / 3, "{name}: only {multi} of {checks} answers had several victims");
}

#[test]
fn lru_native_equals_wasm() {
    eviction_same::<pol::Lru>("lru", &[]);
}

#[test]
fn leaf_lru_native_equals_wasm() {
    eviction_same::<pol::LeafLru>("leaf-lru", &[]);
}

#[test]
fn arc_native_equals_wasm() {
    eviction_same::<pol::Arc>("arc", &[]);
}

#[test]
fn s3fifo_native_equals_wasm() {
    eviction_same::<pol::S3Fifo>("s3fifo", &[]);
    eviction_same::<pol::S3Fifo>("s3fifo", &[("small_pct", "25"), ("move_threshold", "2")]);
}

#[test]
fn sieve_native_equals_wasm() {
    eviction_same::<pol::Sieve>("sieve", &[]);
}

#[test]
fn chain_experts_native_equals_wasm() {
    eviction_same::<pol::ChainExperts>("chain-experts", &[]);
    eviction_same::<pol::ChainExperts>("chain-experts", &[("expert", "arc"), ("shadows", "false")]);
    eviction_same::<pol::ChainExperts>("chain-experts", &[("expert", "filter"), ("small_pct", "5")]);
}

fn admission_same<P: AdmissionPolicy + FromParams>(name: &str, params: &[(&str, &str)]) {
    let params = Params::from_pairs(params.iter().copied());
    let engine = engine();
    let module = load(&engine, name, PolicyKind::Admission, &params);
    let mut wasm = WasmAdmission::new(&module).expect("instantiate");
    let mut native = P::from_params(&params).expect("params");
    let mut oracle = Oracle::default();
    let mut rng = Rng(77);
    let mut next_id = 1;
    for round in 0..40 {
        let batch = random_batch(&mut rng, &oracle, &mut next_id, 50);
        oracle.apply(&batch);
        native.on_events(&batch);
        wasm.try_on_events(&batch).expect("on-events");
        let reqs: AdmitBatch = (0..[1, 16, 200][round % 3])
            .map(|_| {
                let id = rng.below(next_id + 20);
                AdmitRequest {
                    id,
                    key: common::key_of(rng.below(id + 1)),
                    size: 50 + rng.below(200),
                    tokens: 16,
                    seq_tokens: 16 * rng.below(200),
                    tier: if rng.below(2) == 0 { Tier::Dram } else { Tier::Ssd },
                    parent: NO_PARENT,
                    depth: rng.below(200) as u32,
                }
            })
            .collect();
        let a: Vec<u8> = native.admit(&reqs).into_iter().map(|d| d.to_u8()).collect();
        let b = wasm.try_admit(&reqs).expect("admit");
        assert_eq!(a, b, "{name}: round {round}");
    }
}

#[test]
fn threshold_native_equals_wasm() {
    admission_same::<pol::ThresholdAdmission>("threshold", &[("store_threshold", "1024")]);
}

#[test]
fn seen_twice_native_equals_wasm() {
    admission_same::<pol::SeenTwice>("seen-twice", &[]);
    admission_same::<pol::SeenTwice>("seen-twice", &[("max_tracked", "64"), ("min_sightings", "3")]);
}

#[test]
fn doorkeeper_native_equals_wasm() {
    admission_same::<pol::Doorkeeper>("doorkeeper", &[]);
    admission_same::<pol::Doorkeeper>("doorkeeper", &[("min_count", "3"), ("tier", "ssd"), ("blocks", "2000")]);
}

#[test]
fn ghost_native_equals_wasm() {
    admission_same::<pol::GhostAdmission>("ghost", &[]);
    admission_same::<pol::GhostAdmission>("ghost", &[("ghost_pct", "10")]);
}

#[test]
fn size_range_native_equals_wasm() {
    admission_same::<pol::SizeRange>("size-range", &[("min_bytes", "100"), ("max_bytes", "200")]);
}

fn placement_same<P: PlacementPolicy + FromParams>(name: &str, params: &[(&str, &str)]) {
    let params = Params::from_pairs(params.iter().copied());
    let engine = engine();
    let module = load(&engine, name, PolicyKind::Placement, &params);
    let mut wasm = WasmPlacement::new(&module).expect("instantiate");
    let mut native = P::from_params(&params).expect("params");
    let mut rng = Rng(99);
    for round in 0..40 {
        let mut nodes = NodeSet::default();
        for n in 0..(1 + rng.below(6)) {
            nodes.push(100 + n * 7, [0, rng.below(3000), 100_000], rng.below(10) as u32);
        }
        let mut blocks: PlaceBatch = (0..[1, 8, 100][round % 3])
            .map(|i| PlaceRequest {
                id: 1000 * round as u64 + i,
                size: 100,
                tokens: 16,
                parent: if i > 0 { 1000 * round as u64 + i - 1 } else { NO_PARENT },
                parent_node: if i == 0 && rng.below(2) == 0 { nodes.id[0] } else { NO_NODE },
                tier: Tier::Dram,
            })
            .collect();
        blocks.replicas = 1 + rng.below(3) as u32;
        let a = native.place(&blocks, &nodes);
        let b = wasm.try_place(&blocks, &nodes).expect("place");
        assert_eq!(a, b, "{name}: round {round}");
        assert!(kvpool_policy_host::validate_placements(&a, &blocks, &nodes).is_ok());
    }
}

#[test]
fn consistent_hash_native_equals_wasm() {
    placement_same::<pol::ConsistentHash>("consistent-hash", &[("vnodes", "16")]);
}

#[test]
fn least_loaded_native_equals_wasm() {
    placement_same::<pol::LeastLoaded>("least-loaded", &[]);
}

#[test]
fn prefix_affinity_native_equals_wasm() {
    placement_same::<pol::PrefixAffinity>("prefix-affinity", &[("spill_load", "7")]);
}

#[test]
fn wrong_kind_and_bad_params_are_refused() {
    let engine = engine();
    let sieve = &common::standard()["sieve"];
    assert!(matches!(
        engine.load("sieve", PolicyKind::Admission, sieve, &Params::new()),
        Err(kvpool_policy_host::HostError::WrongKind { .. })
    ));
    let module = load(&engine, "s3fifo", PolicyKind::Eviction, &Params::from_pairs([("small_pct", "lots")]));
    assert!(matches!(WasmEviction::new(&module), Err(kvpool_policy_host::HostError::Init { .. })));
}

#[test]
fn compile_cache_is_used_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = HostConfig { cache_dir: Some(dir.path().to_path_buf()), ..HostConfig::default() };
    let wasm = &common::standard()["lru"];
    let a = PolicyEngine::new(cfg.clone()).unwrap().load("lru", PolicyKind::Eviction, wasm, &Params::new()).unwrap();
    assert!(!a.from_cache());
    let b = PolicyEngine::new(cfg.clone()).unwrap().load("lru", PolicyKind::Eviction, wasm, &Params::new()).unwrap();
    assert!(b.from_cache());
    assert_eq!(a.sha256(), b.sha256());
    WasmEviction::new(&b).expect("cached module instantiates");
    // A tampered cache entry is not deserialized: it is recompiled.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "cwasm") {
            let mut bytes = std::fs::read(&p).unwrap();
            let n = bytes.len();
            bytes[n / 2] ^= 0xff;
            std::fs::write(&p, bytes).unwrap();
        }
    }
    let c = PolicyEngine::new(cfg).unwrap().load("lru", PolicyKind::Eviction, wasm, &Params::new()).unwrap();
    assert!(!c.from_cache());
}

/// The swap path: build from a snapshot off the request path, apply the events that happened
/// since, then the new module answers exactly as a policy that saw everything.
#[test]
fn swap_prepare_replay_and_catch_up() {
    use common::Oracle;
    use kvpool_policy_host::GuardedEviction;
    use kvpool_policy_sdk::IndexView;
    let engine = PolicyEngine::new(HostConfig { replay_chunk: 100, ..HostConfig::default() }).unwrap();
    let mut oracle = Oracle::default();
    let mut rng = Rng(3);
    let mut next_id = 1;
    for _ in 0..10 {
        let b = random_batch(&mut rng, &oracle, &mut next_id, 100);
        oracle.apply(&b);
    }
    let snapshot = oracle.snapshot();
    assert!(snapshot.len() > 300);
    let module = load(&engine, "s3fifo", PolicyKind::Eviction, &Params::from_pairs([("small_pct", "20")]));
    let mut fresh = pol::S3Fifo::from_params(&Params::from_pairs([("small_pct", "20")])).unwrap();
    fresh.on_events(&snapshot);
    let mut g = GuardedEviction::new(&module, Box::new(pol::LeafLru::new()), &snapshot).unwrap();
    // Events during the build: applied before the switch.
    let delta = random_batch(&mut rng, &oracle, &mut next_id, 200);
    oracle.apply(&delta);
    g.on_events(&delta);
    fresh.on_events(&delta);
    let ex: Vec<u64> = vec![];
    assert_eq!(g.victims(&oracle, Tier::Dram, 5000, &ex), fresh.victims(Tier::Dram, 5000, &ex));
    let info = g.info();
    assert_eq!(
        (info.name.as_str(), info.kind, info.answered, info.faults.total()),
        ("s3fifo", PolicyKind::Eviction, 1, 0)
    );
    assert_eq!(info.sha256.len(), 64);
    assert_eq!(info.params.get("small_pct"), Some("20"));
    let _ = oracle.evictable_bytes(Tier::Dram, &ex);
}
