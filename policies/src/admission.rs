//! Admission policies besides the threshold: seen-twice (flash protection for SSD, as NVIDIA
//! Dynamo's KVBM does) and a size range (foyer's filter).

use crate::hash::IdMap;
use kvpool_policy_sdk::{AdmissionPolicy, Admit, AdmitBatch, EventKind, Events, FromParams, ParamError, Params, Tier};
use std::collections::VecDeque;

fn tier_param(p: &Params, key: &str, default: Option<Tier>) -> Result<Option<Tier>, ParamError> {
    match p.get(key).map(str::trim) {
        None => Ok(default),
        Some("any" | "all") => Ok(None),
        Some(v) => Tier::ALL
            .into_iter()
            .find(|t| t.name() == v)
            .map(Some)
            .ok_or_else(|| ParamError(format!("parameter {key}={v:?} is not one of device, dram, ssd, any"))),
    }
}

/// Admit a block into the guarded tier (SSD by default) only from its second sighting on:
/// a sighting is an admission request for that tier or a read (`Accessed`) of the block in any
/// tier, counted per key hash (block ids are fresh for every put). Other tiers are admitted as
/// asked. The sightings table keeps at most `max_tracked` keys (default 1,048,576), forgetting
/// the oldest first.
#[derive(Debug)]
pub struct SeenTwice {
    tier: Tier,
    min_sightings: u32,
    max_tracked: usize,
    sightings: IdMap<u64, u32>,
    order: VecDeque<u64>,
}

impl SeenTwice {
    pub fn new(tier: Tier, min_sightings: u32, max_tracked: usize) -> SeenTwice {
        SeenTwice {
            tier,
            min_sightings: min_sightings.max(1),
            max_tracked: max_tracked.max(1),
            sightings: IdMap::default(),
            order: VecDeque::new(),
        }
    }

    /// Count a sighting of `key`; returns the count including this one.
    fn sight(&mut self, key: u64) -> u32 {
        if let Some(n) = self.sightings.get_mut(&key) {
            *n = n.saturating_add(1);
            return *n;
        }
        while self.sightings.len() >= self.max_tracked {
            match self.order.pop_front() {
                Some(old) => {
                    self.sightings.remove(&old);
                }
                None => break,
            }
        }
        self.sightings.insert(key, 1);
        self.order.push_back(key);
        1
    }
}

impl Default for SeenTwice {
    fn default() -> SeenTwice {
        SeenTwice::new(Tier::Ssd, 2, 1 << 20)
    }
}

impl FromParams for SeenTwice {
    /// `tier` (default ssd), `min_sightings` (default 2), `max_tracked` (default 1048576).
    fn from_params(p: &Params) -> Result<SeenTwice, ParamError> {
        let tier = tier_param(p, "tier", Some(Tier::Ssd))?.unwrap_or(Tier::Ssd);
        let min = p.get_u64("min_sightings", 2)?.min(u32::MAX as u64) as u32;
        let max = p.get_u64("max_tracked", 1 << 20)?.clamp(1, 1 << 26) as usize;
        Ok(SeenTwice::new(tier, min, max))
    }
}

impl AdmissionPolicy for SeenTwice {
    fn on_events(&mut self, events: &Events) {
        for e in events.iter() {
            if e.kind == EventKind::Accessed {
                self.sight(e.key);
            }
        }
    }

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        batch
            .iter()
            .map(|r| {
                if r.tier != self.tier || self.sight(r.key) >= self.min_sightings {
                    Admit::Into(r.tier)
                } else {
                    Admit::Reject
                }
            })
            .collect()
    }
}

/// Admit blocks whose size lies in `[min_bytes, max_bytes]`; with `tier` set, only requests for
/// that tier are filtered and the others pass.
#[derive(Debug, Clone)]
pub struct SizeRange {
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub tier: Option<Tier>,
}

impl Default for SizeRange {
    fn default() -> SizeRange {
        SizeRange { min_bytes: 0, max_bytes: u64::MAX, tier: None }
    }
}

impl FromParams for SizeRange {
    /// `min_bytes` (default 0), `max_bytes` (default unlimited), `tier` (default any).
    fn from_params(p: &Params) -> Result<SizeRange, ParamError> {
        let min_bytes = p.get_u64("min_bytes", 0)?;
        let max_bytes = p.get_u64("max_bytes", u64::MAX)?;
        if min_bytes > max_bytes {
            return Err(ParamError(format!("min_bytes {min_bytes} > max_bytes {max_bytes}")));
        }
        Ok(SizeRange { min_bytes, max_bytes, tier: tier_param(p, "tier", None)? })
    }
}

impl AdmissionPolicy for SizeRange {
    fn on_events(&mut self, _events: &Events) {}

    fn admit(&mut self, batch: &AdmitBatch) -> Vec<Admit> {
        batch
            .iter()
            .map(|r| {
                let filtered = self.tier.is_none_or(|t| t == r.tier);
                if !filtered || (self.min_bytes..=self.max_bytes).contains(&r.size) {
                    Admit::Into(r.tier)
                } else {
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

    fn req(id: u64, size: u64, tier: Tier) -> AdmitRequest {
        AdmitRequest::new(id, size, 16, 16, tier, NO_PARENT)
    }

    #[test]
    fn seen_twice_guards_ssd_only() {
        let mut p = SeenTwice::default();
        let b: AdmitBatch =
            [req(1, 10, Tier::Ssd), req(2, 10, Tier::Dram), req(1, 10, Tier::Ssd)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Reject, Admit::Into(Tier::Dram), Admit::Into(Tier::Ssd)]);
        // A read counts as a sighting.
        p.on_events(&[Event::accessed(3, Tier::Dram)].into_iter().collect());
        let b: AdmitBatch = [req(3, 10, Tier::Ssd), req(4, 10, Tier::Ssd)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Into(Tier::Ssd), Admit::Reject]);
        // Sightings follow the key: the same key under a fresh id is a second sighting.
        let b: AdmitBatch =
            [req(50, 10, Tier::Ssd).with_key(7), req(51, 10, Tier::Ssd).with_key(7)].into_iter().collect();
        assert_eq!(p.admit(&b), vec![Admit::Reject, Admit::Into(Tier::Ssd)]);
    }

    #[test]
    fn seen_twice_is_bounded() {
        let mut p = SeenTwice::new(Tier::Ssd, 2, 2);
        let b: AdmitBatch = [1, 2, 3, 1].iter().map(|&i| req(i, 1, Tier::Ssd)).collect();
        // 1 was forgotten when 3 arrived: its next request is a first sighting again.
        assert_eq!(p.admit(&b), vec![Admit::Reject; 4]);
        assert!(p.sightings.len() <= 2);
        assert!(SeenTwice::from_params(&Params::from_pairs([("tier", "flash")])).is_err());
    }

    #[test]
    fn size_range() {
        let mut p =
            SizeRange::from_params(&Params::from_pairs([("min_bytes", "10"), ("max_bytes", "100"), ("tier", "ssd")]))
                .unwrap();
        let b: AdmitBatch =
            [req(1, 5, Tier::Ssd), req(2, 50, Tier::Ssd), req(3, 500, Tier::Ssd), req(4, 500, Tier::Dram)]
                .into_iter()
                .collect();
        assert_eq!(p.admit(&b), vec![Admit::Reject, Admit::Into(Tier::Ssd), Admit::Reject, Admit::Into(Tier::Dram)]);
        assert!(SizeRange::from_params(&Params::from_pairs([("min_bytes", "10"), ("max_bytes", "1")])).is_err());
    }
}
