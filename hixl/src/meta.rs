//! The opaque metadata a peer needs to reach this engine: its HIXL engine name and the memory it
//! registered (HIXL descriptors carry raw remote addresses, so a peer must know them).

use kvpool_transport::TransportError;
use serde::{Deserialize, Serialize};

const MAGIC: &str = "kvpool-hixl";
const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaRegion {
    /// The owner's RegionId.
    pub id: u64,
    pub addr: u64,
    pub len: u64,
    /// NPU of device memory; `None` for host memory.
    pub device: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerMeta {
    pub magic: String,
    pub version: u32,
    /// "hixl" or "standin": the two never talk to each other.
    pub backend: String,
    /// HIXL engine name, "ip:port".
    pub engine: String,
    pub regions: Vec<MetaRegion>,
}

impl PeerMeta {
    pub fn new(backend: &str, engine: &str, regions: Vec<MetaRegion>) -> PeerMeta {
        PeerMeta { magic: MAGIC.into(), version: VERSION, backend: backend.into(), engine: engine.into(), regions }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("metadata serialises")
    }

    pub fn decode(bytes: &[u8], backend: &str) -> Result<PeerMeta, TransportError> {
        let m: PeerMeta = serde_json::from_slice(bytes)
            .map_err(|e| TransportError::BadMetadata(format!("not kvpool HIXL metadata: {e}")))?;
        if m.magic != MAGIC || m.version != VERSION {
            return Err(TransportError::BadMetadata(format!(
                "metadata {:?} version {}, expected {MAGIC:?} version {VERSION}",
                m.magic, m.version
            )));
        }
        if m.backend != backend {
            return Err(TransportError::BadMetadata(format!(
                "the peer runs the {:?} library, this engine {:?}",
                m.backend, backend
            )));
        }
        if m.engine.is_empty() || m.regions.iter().any(|r| r.addr.checked_add(r.len).is_none()) {
            return Err(TransportError::BadMetadata("empty engine name or a region past the address space".into()));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let m = PeerMeta::new(
            "standin",
            "10.0.0.1:20001",
            vec![MetaRegion { id: 3, addr: 1 << 20, len: 4096, device: None }],
        );
        assert_eq!(PeerMeta::decode(&m.encode(), "standin").unwrap(), m);
        assert!(
            matches!(PeerMeta::decode(&m.encode(), "hixl"), Err(TransportError::BadMetadata(e)) if e.contains("standin"))
        );
        assert!(PeerMeta::decode(b"\x01\x02", "standin").is_err());
        let mut bad = m.clone();
        bad.regions[0].addr = u64::MAX;
        assert!(PeerMeta::decode(&bad.encode(), "standin").is_err());
        let mut bad = m;
        bad.version = 9;
        assert!(PeerMeta::decode(&bad.encode(), "standin").is_err());
    }
}
