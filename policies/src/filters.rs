//! Admission by key history, which key hashes make possible in the live server (block ids are
//! fresh for every put, so two puts of one key used to look like two unrelated blocks):
//!
//! - [`Doorkeeper`]: TinyLFU's frequency sketch (Einziger et al., TOS'17) over key hashes,
//!   counting reads and misses; a block is admitted once its key was wanted `min_count` times
//!   (its own lookup miss counts one), so one-off blocks never take room;
//! - [`GhostAdmission`]: S3-FIFO's ghost (SOSP'23) as an admission rule: a key is admitted when
//!   it comes back within a window of recently rejected or evicted keys as long as the tier.
//!
//! Both only filter under pressure: while a tier has evicted nothing for a while (it has room),
//! everything is admitted, since keeping a block costs nothing then. Both suit traffic with many
//! one-off blocks (documents read once, scans) and SSD tiers (flash wear), and both cost the
//! first reuse of every block: on chat, where a turn's blocks are reused by the next turn or
//! never, that is most of the hits (see `bench/RESULTS.md`).

use crate::ghosts::Ghosts;
use crate::hash::IdMap;
use kvpool_policy_sdk::{AdmissionPolicy, Admit, AdmitBatch, EventKind, Events, FromParams, ParamError, Params, Tier};

/// Which tiers a filter applies to, and whether each is under pressure.
#[derive(Debug, Clone)]
struct Pressure {
    /// Tiers filtered (`None`: all).
    tier: Option<Tier>,
    /// Per tier: events seen since the last removal.
    since_removal: [u64; 3],
    /// Per tier: resident copies.
    resident: [u64; 3],
    /// Whether a tier has ever evicted.
    evicted: [bool; 3],
}

impl Pressure {
    fn new(tier: Option<Tier>) -> Pressure {
        Pressure { tier, since_removal: [0; 3], resident: [0; 3], evicted: [false; 3] }
    }

    fn observe(&mut self, events: &Events) {
        for e in events.iter() {
            let t = e.tier as usize;
            match e.kind {
                EventKind::Inserted => {
                    self.resident[t] += 1;
                    self.since_removal[t] += 1;
                }
                EventKind::Removed => {
                    self.resident[t] = self.resident[t].saturating_sub(1);
                    self.since_removal[t] = 0;
                    self.evicted[t] = true;
                }
                _ => self.since_removal[t] += 1,
            }
        }
    }

    /// Whether requests for `tier` are filtered now: a filtered tier that removed a block
    /// within the last tier-full of events.
    fn filtering(&self, tier: Tier) -> bool {
        let t = tier as usize;
        self.tier.is_none_or(|f| f == tier) && self.evicted[t] && self.since_removal[t] <= self.resident[t].max(64)
    }

    fn total(&self) -> u64 {
        self.resident.iter().sum()
    }
}

fn tier_param(p: &Params) -> Result<Option<Tier>, ParamError> {
    match p.get("tier").map(str::trim) {
        None | Some("any" | "all") => Ok(None),
        Some(v) => Tier::ALL
            .into_iter()
            .find(|t| t.name() == v)
            .map(Some)
            .ok_or_else(|| ParamError(format!("parameter tier={v:?} is not one of device, dram, ssd, any"))),
    }
}

/// TinyLFU's frequency sketch over key hashes: a doorkeeper Bloom filter that absorbs the first
/// occurrence of every key (most keys are seen once), then a count-min sketch of counters
/// saturating at 15 (conservative update) for the keys seen again. Every `sample` additions
/// the counters are halved and the doorkeeper cleared, so old popularity fades.
#[derive(Debug, Clone)]
pub struct Sketch {
    rows: [Vec<u8>; 4],
    mask: u64,
    door: Vec<u64>,
    door_mask: u64,
    added: u64,
    sample: u64,
}

impl Sketch {
    /// A sketch for a pool of about `blocks` blocks: a sample of ten pool-fulls of additions
    /// (as TinyLFU sizes it), a doorkeeper of 8 bits per sampled key, counters for half of them.
    pub fn for_blocks(blocks: usize) -> Sketch {
        let sample = 10 * blocks.max(64) as u64;
        let width = (sample as usize / 2).next_power_of_two();
        let bits = (8 * sample as usize).next_power_of_two();
        Sketch {
            rows: std::array::from_fn(|_| vec![0u8; width]),
            mask: width as u64 - 1,
            door: vec![0u64; bits / 64],
            door_mask: bits as u64 - 1,
            added: 0,
            sample,
        }
    }

    /// Position `i` (0..4) of `key` in a table of `mask + 1` slots: key hashes are already
    /// uniform, so a rotation and an odd multiplier per position spread them independently.
    fn slot(key: u64, i: usize, mask: u64) -> usize {
        let h = key
            .rotate_left(16 * i as u32)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15 ^ (i as u64).wrapping_mul(0x632b_e59b_0000_0002));
        ((h >> 17) & mask) as usize
    }

    fn door_has(&self, key: u64) -> bool {
        (0..4).all(|i| {
            let b = Sketch::slot(key ^ 0x5bd1_e995, i, self.door_mask);
            self.door[b / 64] & (1 << (b % 64)) != 0
        })
    }

    fn counters(&self, key: u64) -> u8 {
        (0..4).map(|r| self.rows[r][Sketch::slot(key, r, self.mask)]).min().unwrap_or(0)
    }

    /// How often `key` was added lately (0 to 16).
    pub fn estimate(&self, key: u64) -> u8 {
        if self.door_has(key) {
            1 + self.counters(key)
        } else {
            0
        }
    }

    /// Count one occurrence of `key`.
    pub fn add(&mut self, key: u64) {
        if !self.door_has(key) {
            for i in 0..4 {
                let b = Sketch::slot(key ^ 0x5bd1_e995, i, self.door_mask);
                self.door[b / 64] |= 1 << (b % 64);
            }
        } else {
            let est = self.counters(key);
            if est < 15 {
                for r in 0..4 {
                    let i = Sketch::slot(key, r, self.mask);
                    if self.rows[r][i] == est {
                        self.rows[r][i] += 1;
                    }
                }
            }
        }
        self.added += 1;
        if self.added >= self.sample {
            self.added = 0;
            for row in &mut self.rows {
                for c in row.iter_mut() {
                    *c >>= 1;
                }
            }
            self.door.iter_mut().for_each(|w| *w = 0);
        }
    }

    /// Additions between two halvings.
    pub fn sample(&self) -> u64 {
        self.sample
    }
}

/// TinyLFU-style admission: admit a block when its key's count (reads and misses, decayed)
/// reaches `min_count` (default 2: seen before this request). Parameters: `min_count`, `tier`
/// (default any), `blocks` (pool size the sketch is made for; default 0 = the resident blocks,
/// at least 1024, the sketch remade, empty, each time the pool doubles).
#[derive(Debug, Clone)]
pub struct Doorkeeper {
    min_count: u8,
    fixed: bool,
    sketch: Sketch,
    pressure: Pressure,
}

impl Doorkeeper {
    pub fn new(min_count: u8, tier: Option<Tier>, blocks: usize) -> Doorkeeper {
        Doorkeeper {
            min_count: min_count.max(1),
            fixed: blocks != 0,
            sketch: Sketch::for_blocks(blocks.max(1024)),
            pressure: Pressure::new(tier),
        }
    }

    /// Grow the sketch with the pool.
    fn fit(&mut self) {
        if !self.fixed && self.pressure.total() * 10 > 2 * self.sketch.sample() {
            self.sketch = Sketch::for_blocks(self.pressure.total() as usize * 2);
        }
    }
}

impl Default for Doorkeeper {
    fn default() -> Doorkeeper {
        Doorkeeper::new(2, None, 0)
    }
}

impl FromParams for Doorkeeper {
    fn from_params(p: &Params) -> Result<Doorkeeper, ParamError> {
        let min = p.get_u64("min_count", 2)?.clamp(1, 16) as u8;
        let blocks = p.get_u64("blocks", 0)?.min(1 << 26) as usize;
        Ok(Doorkeeper::new(min, tier_param(p)?, blocks))
    }
}

impl AdmissionPolicy for Doorkeeper {
    fn on_events(&mut self, events: &Events) {
        self.pressure.observe(events);
        self.fit();
        for e in events.iter() {
            match e.kind {
                // The host's count is a running total of requests for the key: top the sketch
                // up to it (that is how a warm snapshot seeds it).
                EventKind::Inserted => {
                    for _ in self.sketch.estimate(e.key)..e.count.min(16) as u8 {
                        self.sketch.add(e.key);
                    }
                }
                EventKind::Accessed => self.sketch.add(e.key),
                // In a snapshot, one row per remembered miss.
                EventKind::Missed => self.sketch.add(e.key),
                _ => {}
            }
        }
    }

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        batch
            .iter()
            .map(|r| {
                if !self.pressure.filtering(r.tier) || self.sketch.estimate(r.key) >= self.min_count {
                    Admit::Into(r.tier)
                } else {
                    Admit::Reject
                }
            })
            .collect()
    }
}

/// S3-FIFO's ghost as admission: a key is admitted when it is in the ghost, the keys this
/// policy rejected or the tier evicted most recently, as many as the tier holds (`ghost_pct`
/// percent of it, default 100); otherwise it is rejected and enters the ghost. Parameters:
/// `ghost_pct`, `tier` (default any).
#[derive(Debug, Clone)]
pub struct GhostAdmission {
    ghost_pct: u64,
    ghosts: Ghosts,
    /// Resident blocks by id -> key, to know the key of an evicted block.
    resident: IdMap<u64, u64>,
    pressure: Pressure,
}

impl GhostAdmission {
    pub fn new(ghost_pct: u64, tier: Option<Tier>) -> GhostAdmission {
        GhostAdmission {
            ghost_pct: ghost_pct.max(1),
            ghosts: Ghosts::default(),
            resident: IdMap::default(),
            pressure: Pressure::new(tier),
        }
    }

    fn remember(&mut self, key: u64) {
        let cap = ((self.pressure.total() * self.ghost_pct / 100) as usize).max(1024);
        self.ghosts.put(key, cap);
    }
}

impl Default for GhostAdmission {
    fn default() -> GhostAdmission {
        GhostAdmission::new(100, None)
    }
}

impl FromParams for GhostAdmission {
    fn from_params(p: &Params) -> Result<GhostAdmission, ParamError> {
        Ok(GhostAdmission::new(p.get_u64("ghost_pct", 100)?.clamp(1, 1000), tier_param(p)?))
    }
}

impl AdmissionPolicy for GhostAdmission {
    fn on_events(&mut self, events: &Events) {
        self.pressure.observe(events);
        for e in events.iter() {
            match e.kind {
                EventKind::Inserted => {
                    self.resident.insert(e.id, e.key);
                }
                EventKind::Removed => {
                    // Evicted (or moved away): a quick return is admitted.
                    if let Some(key) = self.resident.remove(&e.id) {
                        self.remember(key);
                    }
                }
                // A warm snapshot's misses seed the ghost.
                EventKind::Missed if e.count > 1 => self.remember(e.key),
                _ => {}
            }
        }
    }

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        batch
            .iter()
            .map(|r| {
                if !self.pressure.filtering(r.tier) || self.ghosts.take(r.key) {
                    Admit::Into(r.tier)
                } else {
                    self.remember(r.key);
                    Admit::Reject
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{AdmitRequest, Event, NO_PARENT};

    fn req(id: u64, key: u64) -> AdmitRequest {
        AdmitRequest::new(id, 1, 512, 512, Tier::Dram, NO_PARENT).with_key(key)
    }

    /// Fill a tier past its first eviction so the filters are under pressure.
    fn pressured(p: &mut dyn AdmissionPolicy) {
        let ins: Events =
            (1..=100).map(|i| Event::inserted(1000 + i, 1, Tier::Dram, NO_PARENT).with_key(9000 + i)).collect();
        p.on_events(&ins);
        p.on_events(&[Event::removed(1001, Tier::Dram)].into_iter().collect());
    }

    #[test]
    fn doorkeeper_admits_keys_seen_before_and_everything_when_idle() {
        let mut p = Doorkeeper::default();
        let b: AdmitBatch = [req(1, 5)].into_iter().collect();
        // No eviction yet: room to spare, everything goes in.
        assert_eq!(p.admit(&b), vec![Admit::Into(Tier::Dram)]);
        pressured(&mut p);
        // The put's own lookup miss: seen once, rejected.
        p.on_events(&[Event::missed(5, 1, NO_PARENT)].into_iter().collect());
        assert_eq!(p.admit(&b), vec![Admit::Reject]);
        // Wanted again (the next turn misses it again): admitted, under a fresh id too.
        p.on_events(&[Event::missed(5, 1, NO_PARENT)].into_iter().collect());
        let b: AdmitBatch = [req(2, 5), req(3, 6)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Into(Tier::Dram), Admit::Reject]);
        // Reads count as well.
        p.on_events(&[Event::accessed(77, Tier::Dram).with_key(6)].into_iter().collect());
        p.on_events(&[Event::missed(6, 1, NO_PARENT)].into_iter().collect());
        assert_eq!(p.admit(&[req(4, 6)].into_iter().collect()), vec![Admit::Into(Tier::Dram)]);
    }

    #[test]
    fn sketch_counts_and_forgets() {
        let mut s = Sketch::for_blocks(1000);
        let key = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for k in 0..5000 {
            s.add(key(k));
        }
        for _ in 0..9 {
            s.add(42);
        }
        assert_eq!(s.estimate(42), 9);
        // One-timers stay in the doorkeeper: estimates of 1, a few collisions at most.
        let ones = (0..5000).filter(|&k| s.estimate(key(k)) == 1).count();
        assert!(ones > 4900, "{ones}");
        assert!((5000..6000).filter(|&k| s.estimate(key(k)) > 0).count() < 50);
        // A reset halves the counters and clears the doorkeeper.
        for k in 0..s.sample() {
            s.add(key(100_000 + k % 7));
        }
        assert!(s.estimate(42) <= 5, "{}", s.estimate(42));
        assert_eq!(s.estimate(key(3)), 0);
    }

    #[test]
    fn ghost_admits_a_key_that_comes_back() {
        let mut p = GhostAdmission::default();
        pressured(&mut p);
        let b: AdmitBatch = [req(1, 5), req(2, 6)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Reject, Admit::Reject]);
        let b: AdmitBatch = [req(3, 5)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Into(Tier::Dram)]);
        // Once admitted it left the ghost: a third, unrelated rejection is needed again.
        assert_eq!(p.admit(&b), vec![Admit::Reject]);
        // An evicted block's key comes back in.
        p.on_events(&[Event::removed(1002, Tier::Dram)].into_iter().collect());
        assert_eq!(p.admit(&[req(4, 9002)].into_iter().collect()), vec![Admit::Into(Tier::Dram)]);
    }
}
