//! The DRAM tier: one pre-allocated segment per node, carved by an offset allocator, so that a
//! transport can register it once and move bytes in and out of it one-sidedly.
//!
//! Space is handed out as [`DramBlock`]s. A block frees its range when the last reference drops:
//! the index holds one, every in-flight read holds another, so removing or evicting a block that
//! is being read never frees memory under the reader.

use offset_allocator::{Allocation, Allocator};
use parking_lot::Mutex;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// Allocation unit. The allocator counts in u32 units, so this bounds the segment size.
pub const UNIT: u64 = 256;
/// Largest segment: u32::MAX units.
pub const MAX_SEGMENT: u64 = UNIT * (u32::MAX as u64);
/// The allocator keeps a 32-byte node per possible allocation, all allocated and touched up
/// front: size the table to the segment (every unit its own block, plus the free ranges
/// between them) instead of a fixed count, so a small segment does not pay for a large table
/// and a large one is never short of nodes.
fn max_allocs(units: u32) -> u32 {
    units.saturating_add(2).clamp(1024, u32::MAX - 2)
}

/// The raw segment memory: an anonymous private mapping, so pages are zero and cost nothing
/// until first written (a heap allocation of this alignment would be zeroed up front, touching
/// every page of the segment at start).
struct Segment {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the segment is plain memory; disjoint ranges are handed to one writer each by the
// allocator, and readers only see ranges of committed (immutable) blocks.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: mapped in `DramTier::new` with this length.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

pub struct DramTier {
    seg: Segment,
    capacity: u64,
    alloc: Mutex<Allocator>,
    used: AtomicU64,
    /// Woken whenever space is returned, for puts waiting on eviction.
    pub freed: Notify,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot allocate a DRAM segment of {0} bytes")]
pub struct SegmentAllocError(pub u64);

impl DramTier {
    /// A segment of `capacity` bytes. With `populate`, every page is faulted in now (as memory
    /// registered for a transport must be), so that no put pays for first-touch page faults.
    pub fn new(capacity: u64, populate: bool) -> Result<Arc<DramTier>, SegmentAllocError> {
        let units = (capacity / UNIT).min(u32::MAX as u64) as u32;
        let capacity = units as u64 * UNIT;
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a fresh anonymous mapping (page aligned); config validation requires >= 1 MiB.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                capacity as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                if populate { MapFlags::PRIVATE | MapFlags::POPULATE } else { MapFlags::PRIVATE | MapFlags::NORESERVE },
            )
        }
        .map_err(|_| SegmentAllocError(capacity))?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(SegmentAllocError(capacity))?;
        Ok(Arc::new(DramTier {
            seg: Segment { ptr, len: capacity as usize },
            capacity,
            alloc: Mutex::new(Allocator::with_max_allocs(units, max_allocs(units))),
            used: AtomicU64::new(0),
            freed: Notify::new(),
        }))
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Address and length of the whole segment, for registering it with a transport once.
    pub fn segment(&self) -> (usize, usize) {
        (self.seg.ptr.as_ptr() as usize, self.seg.len)
    }

    /// Bytes handed out (allocator granularity included).
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes a value of `len` occupies.
    pub fn footprint(len: u64) -> u64 {
        len.max(1).div_ceil(UNIT) * UNIT
    }

    /// Reserve room for `len` bytes, or `None` when no free range is large enough.
    pub fn allocate(self: &Arc<Self>, len: u64) -> Option<DramBlock> {
        let units = u32::try_from(len.max(1).div_ceil(UNIT)).ok()?;
        // Lengths are kept in 4 bytes (the handle's size is per resident block); values are
        // bounded far below by `limits.max_value_size`.
        let len = u32::try_from(len).ok()?;
        let mut a = self.alloc.lock();
        let allocation = a.allocate(units)?;
        let units = a.allocation_size(allocation);
        drop(a);
        self.used.fetch_add(units as u64 * UNIT, Ordering::Relaxed);
        Some(DramBlock { tier: self.clone(), allocation, len, units })
    }

    /// Largest single range that could be allocated now.
    pub fn largest_free(&self) -> u64 {
        self.alloc.lock().storage_report().largest_free_region as u64 * UNIT
    }
}

/// A range of the segment holding (or about to hold) one block's bytes. Every resident block
/// has one on the heap (behind the index's [`SharedBlock`]): the offset comes from the
/// allocation and the room is kept in units, so that it takes 24 bytes and, with a
/// `triomphe::Arc`'s one count, fills a 32-byte allocation (std's `Arc` adds a weak count: 48).
pub struct DramBlock {
    tier: Arc<DramTier>,
    allocation: Allocation,
    len: u32,
    /// Units the allocator handed out (at least the length's).
    units: u32,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<DramBlock>() <= 24);

/// A committed block's shared handle: the index holds one, each in-flight read another.
pub type SharedBlock = triomphe::Arc<DramBlock>;

impl DramBlock {
    pub fn len(&self) -> u64 {
        u64::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn offset(&self) -> u64 {
        self.allocation.offset as u64 * UNIT
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the range lies inside the segment and stays allocated while `self` lives.
        // Writers only get `bytes_mut` on a block they own exclusively (before it is shared).
        unsafe { std::slice::from_raw_parts(self.tier.seg.ptr.as_ptr().add(self.offset() as usize), self.len as usize) }
    }

    /// Write access while the block is still exclusively owned (before it is committed and shared).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` proves no other reference to this range exists:
        // the allocator never hands out overlapping ranges.
        unsafe {
            std::slice::from_raw_parts_mut(self.tier.seg.ptr.as_ptr().add(self.offset() as usize), self.len as usize)
        }
    }
}

impl std::fmt::Debug for DramBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramBlock").field("offset", &self.offset()).field("len", &self.len).finish()
    }
}

impl Drop for DramBlock {
    fn drop(&mut self) {
        self.tier.alloc.lock().free(self.allocation);
        self.tier.used.fetch_sub(self.units as u64 * UNIT, Ordering::Relaxed);
        self.tier.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_within_capacity_and_frees_on_drop() {
        let t = DramTier::new(1 << 20, false).unwrap();
        let mut blocks = Vec::new();
        while let Some(mut b) = t.allocate(100_000) {
            b.bytes_mut().fill(7);
            blocks.push(b);
        }
        assert!(!blocks.is_empty());
        assert!(t.used() <= t.capacity());
        let n = blocks.len();
        blocks.clear();
        assert_eq!(t.used(), 0);
        let again: Vec<_> = std::iter::from_fn(|| t.allocate(100_000)).collect();
        assert_eq!(again.len(), n);
        assert!(again.iter().all(|b| b.bytes().len() == 100_000));
    }
}
