//! What every tier of a node has in common, so that the store treats DRAM and SSD (and a device
//! tier later) alike: a capacity carved into extents by an allocator, with watermarks, and
//! extents that are reserved, filled, read and given back.
//!
//! [`Space`] is the accounting half (object safe: the store keeps a list of them for gauges,
//! placement input and the watermark sweep). [`Medium`] adds the bytes: an extent type of the
//! tier's own (a `DramBlock` that frees itself when its last reference drops, an SSD
//! offset that the index persists) and the copies in and out of it.

use kvpool_policy_sdk::Tier;
use tokio::sync::Notify;

#[derive(Debug, thiserror::Error)]
pub enum MediumError {
    #[error("{len} bytes at {at} do not fit an extent of {extent} bytes")]
    OutOfExtent { at: u64, len: u64, extent: u64 },
    #[error(transparent)]
    Ssd(#[from] super::ssd::SsdError),
}

/// A tier's space: how much there is, how much is taken, and at what granularity.
pub trait Space: Send + Sync {
    fn tier(&self) -> Tier;
    fn capacity(&self) -> u64;
    /// Bytes handed out, reservations of writes in flight included.
    fn used(&self) -> u64;
    /// Bytes a block of `len` occupies (allocation granularity).
    fn footprint(&self, len: u64) -> u64;
    /// Woken when space comes back, for writers that wait for room; `None` when the tier's
    /// space only comes back through eviction.
    fn freed(&self) -> Option<&Notify> {
        None
    }
    /// Copies in this tier outlive a restart (their records are in sled): space that a removed
    /// copy held is reused only once the record's removal is durable.
    fn persistent(&self) -> bool {
        false
    }

    fn free(&self) -> u64 {
        self.capacity().saturating_sub(self.used())
    }
}

/// A tier's bytes: extents reserved, written, read, given back.
pub trait Medium: Space {
    /// One block's room in this tier.
    type Extent: Send + 'static;

    /// Room for `len` bytes, or `None` when no free range is large enough.
    fn reserve(&self, len: u64) -> Option<Self::Extent>;
    /// Give an extent back (it holds no block any more).
    fn release(&self, extent: Self::Extent);
    /// Copy `data` into the extent at byte `at`.
    fn write(&self, extent: &mut Self::Extent, at: u64, data: &[u8]) -> Result<(), MediumError>;
    /// Copy the extent's bytes from byte `at` into `buf` (the caller checks the checksum).
    fn read_into(&self, extent: &Self::Extent, at: u64, buf: &mut [u8]) -> Result<(), MediumError>;

    /// The first `len` bytes of the extent, in a buffer of their own.
    fn read(&self, extent: &Self::Extent, len: u64) -> Result<Vec<u8>, MediumError> {
        let mut buf = vec![0u8; len as usize];
        self.read_into(extent, 0, &mut buf)?;
        Ok(buf)
    }
}

fn fits(at: u64, len: usize, extent: u64) -> Result<(), MediumError> {
    match at.checked_add(len as u64) {
        Some(end) if end <= extent => Ok(()),
        _ => Err(MediumError::OutOfExtent { at, len: len as u64, extent }),
    }
}

impl Space for std::sync::Arc<super::dram::DramTier> {
    fn tier(&self) -> Tier {
        Tier::Dram
    }
    fn capacity(&self) -> u64 {
        super::dram::DramTier::capacity(self)
    }
    fn used(&self) -> u64 {
        super::dram::DramTier::used(self)
    }
    fn footprint(&self, len: u64) -> u64 {
        super::dram::DramTier::footprint(len)
    }
    fn freed(&self) -> Option<&Notify> {
        Some(&self.freed)
    }
}

impl Medium for std::sync::Arc<super::dram::DramTier> {
    type Extent = super::dram::DramBlock;

    fn reserve(&self, len: u64) -> Option<super::dram::DramBlock> {
        self.allocate(len)
    }
    fn release(&self, extent: super::dram::DramBlock) {
        // The range goes back to the allocator when the block drops.
        drop(extent);
    }
    fn write(&self, extent: &mut super::dram::DramBlock, at: u64, data: &[u8]) -> Result<(), MediumError> {
        fits(at, data.len(), extent.len())?;
        extent.bytes_mut()[at as usize..at as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read_into(&self, extent: &super::dram::DramBlock, at: u64, buf: &mut [u8]) -> Result<(), MediumError> {
        fits(at, buf.len(), extent.len())?;
        buf.copy_from_slice(&extent.bytes()[at as usize..at as usize + buf.len()]);
        Ok(())
    }
}

/// An extent of the SSD segment file: where a block's bytes are, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdExtent {
    pub offset: u64,
    pub len: u64,
}

impl Space for super::ssd::SsdTier {
    fn tier(&self) -> Tier {
        Tier::Ssd
    }
    fn capacity(&self) -> u64 {
        super::ssd::SsdTier::capacity(self)
    }
    fn used(&self) -> u64 {
        super::ssd::SsdTier::used(self)
    }
    fn footprint(&self, len: u64) -> u64 {
        super::ssd::SsdTier::footprint(len)
    }
    fn persistent(&self) -> bool {
        true
    }
}

impl Medium for super::ssd::SsdTier {
    type Extent = SsdExtent;

    fn reserve(&self, len: u64) -> Option<SsdExtent> {
        self.try_reserve(len).map(|offset| SsdExtent { offset, len })
    }
    fn release(&self, extent: SsdExtent) {
        self.free(extent.offset, extent.len);
    }
    fn write(&self, extent: &mut SsdExtent, at: u64, data: &[u8]) -> Result<(), MediumError> {
        fits(at, data.len(), extent.len)?;
        Ok(super::ssd::SsdTier::write(self, extent.offset + at, data)?)
    }
    fn read_into(&self, extent: &SsdExtent, at: u64, buf: &mut [u8]) -> Result<(), MediumError> {
        fits(at, buf.len(), extent.len)?;
        Ok(super::ssd::SsdTier::read_into(self, extent.offset + at, buf)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same sequence against both tiers: reserve, write in two pieces, read back, bounds,
    /// release, accounting.
    fn exercise<M: Medium>(m: &M) {
        let before = m.used();
        let mut e = m.reserve(10_000).expect("room");
        assert_eq!(m.used(), before + m.footprint(10_000));
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        m.write(&mut e, 4_000, &data[4_000..]).unwrap();
        m.write(&mut e, 0, &data[..4_000]).unwrap();
        let mut back = vec![0u8; 10_000];
        m.read_into(&e, 0, &mut back).unwrap();
        assert_eq!(back, data);
        let mut tail = [0u8; 10];
        m.read_into(&e, 9_990, &mut tail).unwrap();
        assert_eq!(&tail[..], &data[9_990..]);
        assert!(matches!(m.write(&mut e, 9_999, b"xy"), Err(MediumError::OutOfExtent { .. })));
        assert!(matches!(m.read_into(&e, u64::MAX, &mut tail), Err(MediumError::OutOfExtent { .. })));
        assert!(m.reserve(m.capacity() + 1).is_none());
        m.release(e);
        assert_eq!(m.used(), before);
        assert_eq!(m.free(), m.capacity() - before);
    }

    #[test]
    fn dram_and_ssd_behave_alike_behind_the_trait() {
        let dram = super::super::dram::DramTier::new(4 << 20, false).unwrap();
        assert_eq!(Space::tier(&dram), Tier::Dram);
        assert!(dram.freed().is_some());
        exercise(&dram);
        let dir = tempfile::tempdir().unwrap();
        let ssd = super::super::ssd::SsdTier::open(dir.path(), 4 << 20, false).unwrap();
        assert_eq!(Space::tier(&ssd), Tier::Ssd);
        assert!(ssd.freed().is_none() && ssd.persistent() && !dram.persistent());
        exercise(&ssd);
    }
}
