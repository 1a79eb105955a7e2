//! Shared test helpers: components built from source once per test binary, a host-truth oracle
//! and a deterministic scenario generator.
#![allow(dead_code)]

use kvpool_policy_build::{build, BuildOptions, Built};
use kvpool_policy_sdk::{key_hash, Event, EventKind, Events, IndexView, Pin, Tier, NO_PARENT};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::OnceLock;

fn out_dir(what: &str) -> PathBuf {
    kvpool_policy_build::default_target_dir().join("components").join(what)
}

/// name -> component bytes of the standard policies, built from `policies/wasm`.
pub fn standard() -> &'static HashMap<String, Vec<u8>> {
    static S: OnceLock<HashMap<String, Vec<u8>>> = OnceLock::new();
    S.get_or_init(|| load(build(&BuildOptions::new(kvpool_policy_build::standard_manifest(), out_dir("standard")))))
}

/// name -> component bytes of the malicious test modules, built from `tests/malicious`.
pub fn malicious() -> &'static HashMap<String, Vec<u8>> {
    static S: OnceLock<HashMap<String, Vec<u8>>> = OnceLock::new();
    S.get_or_init(|| {
        let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/malicious/Cargo.toml");
        load(build(&BuildOptions::new(manifest, out_dir("malicious"))))
    })
}

fn load(r: Result<Vec<Built>, kvpool_policy_build::BuildError>) -> HashMap<String, Vec<u8>> {
    let built = r.unwrap_or_else(|e| panic!("building components failed: {e}"));
    built.into_iter().map(|b| (b.name, std::fs::read(&b.path).expect("read component"))).collect()
}

/// Host truth: resident copies per tier, pins, insertion order.
#[derive(Default)]
pub struct Oracle {
    pub blocks: BTreeMap<u64, (Pin, [Option<u64>; 3], u64)>,
}

impl Oracle {
    pub fn apply(&mut self, events: &Events) {
        for e in events.iter() {
            let t = e.tier as usize;
            match e.kind {
                EventKind::Inserted => {
                    let b = self.blocks.entry(e.id).or_insert((e.pin, [None; 3], e.parent));
                    b.0 = e.pin;
                    b.1[t] = Some(e.size);
                }
                EventKind::Removed => {
                    if let Some(b) = self.blocks.get_mut(&e.id) {
                        b.1[t] = None;
                        if b.1.iter().all(Option::is_none) {
                            self.blocks.remove(&e.id);
                        }
                    }
                }
                EventKind::PinChanged => {
                    if let Some(b) = self.blocks.get_mut(&e.id) {
                        b.0 = e.pin;
                    }
                }
                EventKind::Accessed | EventKind::Missed => {}
            }
        }
    }

    pub fn resident(&self, tier: Tier) -> Vec<u64> {
        self.blocks.iter().filter(|(_, b)| b.1[tier as usize].is_some()).map(|(&id, _)| id).collect()
    }
}

impl IndexView for Oracle {
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
        self.blocks.get(&id).and_then(|b| b.1[tier as usize])
    }
    fn pin(&self, id: u64) -> Pin {
        self.blocks.get(&id).map_or(Pin::None, |b| b.0)
    }
    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64 {
        self.blocks
            .iter()
            .filter(|(id, b)| b.0 != Pin::Hard && exclude.binary_search(id).is_err())
            .filter_map(|(_, b)| b.1[tier as usize])
            .sum()
    }
    fn resident_children(&self, id: u64) -> Vec<u64> {
        self.blocks.iter().filter(|(_, b)| b.2 == id).map(|(&c, _)| c).collect()
    }
    fn snapshot(&self) -> Events {
        let mut ev = Events::new();
        for (&id, b) in &self.blocks {
            for t in Tier::ALL {
                if let Some(size) = b.1[t as usize] {
                    ev.push(Event::inserted(id, size, t, b.2).with_pin(b.0));
                }
            }
        }
        ev
    }
}

/// Small deterministic PRNG (xorshift*), so scenarios are the same everywhere.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The key hash of the `n`th key of a scenario (keys come back under fresh ids).
pub fn key_of(n: u64) -> u64 {
    key_hash(0, n.to_string().as_bytes())
}

/// A batch of `n` plausible events against `oracle`: chains of inserts (DRAM, some SSD copies;
/// some re-puts of earlier keys under fresh ids), reads, misses, a few removals and pin changes.
pub fn random_batch(rng: &mut Rng, oracle: &Oracle, next_id: &mut u64, n: usize) -> Events {
    let mut ev = Events::new();
    let ids: Vec<u64> = oracle.blocks.keys().copied().collect();
    let mut last: Option<u64> = None;
    for _ in 0..n {
        let r = rng.below(100);
        let time = 1_000 * *next_id + rng.below(1_000);
        if r < 45 || ids.is_empty() {
            let id = *next_id;
            *next_id += 1;
            // Keys are numbered like ids; one put in 8 brings back an earlier key.
            let key = if rng.below(8) == 0 { key_of(rng.below(id)) } else { key_of(id) };
            // Continue the chain being built most of the time.
            let parent = match last {
                Some(p) if rng.below(4) != 0 => p,
                _ => NO_PARENT,
            };
            let pin = match rng.below(20) {
                0 => Pin::Soft,
                1 => Pin::Hard,
                _ => Pin::None,
            };
            let size = 100 + 10 * rng.below(5);
            let e = Event::inserted(id, size, Tier::Dram, parent).with_tokens(16).with_pin(pin).with_key(key);
            ev.push(e.with_time(time));
            if rng.below(5) == 0 {
                ev.push(Event { tier: Tier::Ssd, ..e }.with_time(time));
            }
            last = Some(id);
        } else if r < 85 {
            let id = ids[rng.below(ids.len() as u64) as usize];
            ev.push(Event::accessed(id, Tier::Dram).with_key(key_of(id)).with_count(1).with_time(time));
        } else if r < 90 {
            let parent = if rng.below(2) == 0 { ids[rng.below(ids.len() as u64) as usize] } else { NO_PARENT };
            ev.push(Event::missed(key_of(rng.below(*next_id + 100)), rng.below(40) as u32, parent).with_time(time));
        } else if r < 96 {
            let id = ids[rng.below(ids.len() as u64) as usize];
            ev.push(Event::removed(id, Tier::Ssd));
        } else {
            let id = ids[rng.below(ids.len() as u64) as usize];
            ev.push(Event::pin_changed(id, if rng.below(2) == 0 { Pin::None } else { Pin::Soft }));
        }
    }
    ev
}
