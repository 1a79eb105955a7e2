//! The DRAM tier: one pre-allocated segment per node, carved by an offset allocator, so that a
//! transport can register it once and move bytes in and out of it one-sidedly.
//!
//! Space is handed out as [`DramBlock`]s, owned by their writer. A committed block becomes a
//! [`DramRef`], 12 bytes kept inline in the index's record (no heap handle per resident
//! block). A read pins the range ([`DramTier::pin`], under the index's lock); when the index lets
//! a block go it hands the range back ([`DramTier::release_ref`]), and the range is freed at once or,
//! while reads hold it, when the last of them ends. So removing or evicting a block that is being
//! read never frees memory under the reader.

use offset_allocator::{Allocation, Allocator};
use parking_lot::Mutex;
use std::collections::HashMap;
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
// SAFETY: as for `Send`: shared access goes through that same discipline.
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
    /// Committed ranges that reads hold, by offset (in units): only those, so a few entries.
    readers: Mutex<HashMap<u32, Readers>>,
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
                if populate { MapFlags::PRIVATE } else { MapFlags::PRIVATE | MapFlags::NORESERVE },
            )
        }
        .map_err(|_| SegmentAllocError(capacity))?;
        // Huge pages where the kernel allows them (THP "madvise" or "always"): a 1 MiB block
        // then spans one or two TLB entries instead of 256, which copies feel. Best effort.
        // SAFETY: advice on the mapping just made.
        let _ = unsafe { rustix::mm::madvise(p, capacity as usize, rustix::mm::Advice::LinuxHugepage) };
        if populate {
            // SAFETY: as above. Faults every page in now, as MAP_POPULATE would, but after the
            // advice so that the pages can be huge. Kernels before 5.14 lack it: touch them.
            match unsafe { rustix::mm::madvise(p, capacity as usize, rustix::mm::Advice::LinuxPopulateWrite) } {
                Ok(()) => {}
                Err(rustix::io::Errno::INVAL) => {
                    for off in (0..capacity as usize).step_by(4096) {
                        // SAFETY: within the fresh mapping.
                        unsafe { p.cast::<u8>().add(off).write_volatile(0) };
                    }
                }
                Err(_) => {
                    // SAFETY: the mapping made above, not yet shared with anything.
                    let _ = unsafe { rustix::mm::munmap(p, capacity as usize) };
                    return Err(SegmentAllocError(capacity));
                }
            }
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(SegmentAllocError(capacity))?;
        Ok(Arc::new(DramTier {
            seg: Segment { ptr, len: capacity as usize },
            capacity,
            alloc: Mutex::new(Allocator::with_max_allocs(units, max_allocs(units))),
            used: AtomicU64::new(0),
            readers: Mutex::new(HashMap::new()),
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
        Some(DramBlock { held: Held { tier: self.clone(), r: DramRef { allocation, len } }, committed: false })
    }

    /// Pin a committed range for a read: it stays allocated until the returned handle drops,
    /// even if the index lets it go meanwhile. Call it while the index still holds `r` (under
    /// its lock), so that `r` cannot have been released.
    pub fn pin(self: &Arc<Self>, r: DramRef) -> PinnedBlock {
        self.readers.lock().entry(r.allocation.offset).or_insert(Readers { count: 0, released: false }).count += 1;
        PinnedBlock(Held { tier: self.clone(), r })
    }

    /// The index let go of `r`: free it now, or when the last read of it ends. Each committed
    /// range is released exactly once.
    pub fn release_ref(&self, r: DramRef) {
        let mut readers = self.readers.lock();
        match readers.get_mut(&r.allocation.offset) {
            Some(e) => {
                debug_assert!(!e.released, "a range released twice");
                e.released = true;
            }
            None => {
                drop(readers);
                self.free(r.allocation);
            }
        }
    }

    /// A read holds `r` (its memory would not come free if the index let it go now).
    pub fn in_use(&self, r: &DramRef) -> bool {
        self.readers.lock().contains_key(&r.allocation.offset)
    }

    fn free(&self, allocation: Allocation) {
        let mut a = self.alloc.lock();
        let units = a.allocation_size(allocation);
        a.free(allocation);
        drop(a);
        self.used.fetch_sub(units as u64 * UNIT, Ordering::Relaxed);
        self.freed.notify_waiters();
    }

    fn range(&self, r: &DramRef) -> &[u8] {
        // SAFETY: a committed range lies inside the segment; callers hold it allocated (the
        // index's reference under its lock, or a pin), and nobody writes a committed range.
        unsafe { std::slice::from_raw_parts(self.seg.ptr.as_ptr().add(r.offset() as usize), r.len as usize) }
    }

    /// Largest single range that could be allocated now.
    pub fn largest_free(&self) -> u64 {
        self.alloc.lock().storage_report().largest_free_region as u64 * UNIT
    }
}

#[derive(Debug)]
struct Readers {
    count: u32,
    /// The index let the range go: free it when the count drops to 0.
    released: bool,
}

/// A committed block's range as the index holds it: inline in the record, 12 bytes (as an
/// `Option` too: the allocator's node index has a niche).
#[derive(Clone, Copy)]
pub struct DramRef {
    allocation: Allocation,
    len: u32,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Option<DramRef>>() <= 12);

/// What a block's record keeps of its [`DramRef`]: the range without its length, which is the
/// block's size. 8 bytes, as an `Option` too.
#[derive(Clone, Copy)]
pub struct DramKept(Allocation);

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Option<DramKept>>() <= 8);

impl DramRef {
    pub fn kept(&self) -> DramKept {
        DramKept(self.allocation)
    }

    /// The range again, from what the record kept and the block's size (below 4 GiB: the
    /// index refuses larger values).
    pub fn restore(kept: DramKept, len: u64) -> DramRef {
        DramRef { allocation: kept.0, len: u32::try_from(len).unwrap_or(u32::MAX) }
    }

    pub fn len(&self) -> u64 {
        u64::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset in the segment.
    pub fn offset(&self) -> u64 {
        self.allocation.offset as u64 * UNIT
    }
}

impl std::fmt::Debug for DramRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramRef").field("offset", &self.offset()).field("len", &self.len).finish()
    }
}

/// A range of the segment with its tier: what a read ([`PinnedBlock`]) and a writer
/// ([`DramBlock`]) hold, and read through.
pub struct Held {
    tier: Arc<DramTier>,
    r: DramRef,
}

impl Held {
    pub fn len(&self) -> u64 {
        self.r.len()
    }

    pub fn is_empty(&self) -> bool {
        self.r.is_empty()
    }

    pub fn offset(&self) -> u64 {
        self.r.offset()
    }

    pub fn bytes(&self) -> &[u8] {
        self.tier.range(&self.r)
    }
}

/// A committed range held for a read: its bytes stay allocated while this lives.
pub struct PinnedBlock(Held);

impl std::ops::Deref for PinnedBlock {
    type Target = Held;
    fn deref(&self) -> &Held {
        &self.0
    }
}

impl Clone for PinnedBlock {
    fn clone(&self) -> PinnedBlock {
        self.tier.pin(self.r)
    }
}

impl std::fmt::Debug for PinnedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.r.fmt(f)
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        let off = self.r.allocation.offset;
        let mut readers = self.tier.readers.lock();
        let Some(e) = readers.get_mut(&off) else {
            debug_assert!(false, "a pin without its entry");
            return;
        };
        e.count -= 1;
        if e.count == 0 {
            let released = e.released;
            readers.remove(&off);
            drop(readers);
            if released {
                self.tier.free(self.r.allocation);
            }
        }
    }
}

/// A range of the segment being written by its one owner (a put, a promotion). Dropped
/// uncommitted, it frees its range; [`DramBlock::commit`] hands it to the index instead.
pub struct DramBlock {
    /// The range it will be once committed.
    held: Held,
    committed: bool,
}

impl std::ops::Deref for DramBlock {
    type Target = Held;
    fn deref(&self) -> &Held {
        &self.held
    }
}

impl DramBlock {
    /// The range, written, for the index to hold: it is no longer freed on drop but by
    /// [`DramTier::release_ref`].
    pub fn commit(mut self) -> DramRef {
        self.committed = true;
        self.held.r
    }

    /// Write access while the block is still exclusively owned (before it is committed and shared).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` proves no other reference to this range exists:
        // the allocator never hands out overlapping ranges.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.held.tier.seg.ptr.as_ptr().add(self.offset() as usize),
                self.held.r.len as usize,
            )
        }
    }
}

impl std::fmt::Debug for DramBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramBlock").field("offset", &self.offset()).field("len", &self.len()).finish()
    }
}

impl Drop for DramBlock {
    fn drop(&mut self) {
        if !self.committed {
            self.held.tier.free(self.held.r.allocation);
        }
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

    /// A committed range is freed when the index releases it, unless reads hold it: then when
    /// the last of them ends. Its bytes stay readable through every pin until then.
    #[test]
    fn a_released_range_outlives_its_readers_and_no_longer() {
        let t = DramTier::new(1 << 20, false).unwrap();
        let mut b = t.allocate(1000).unwrap();
        b.bytes_mut().fill(9);
        let r = b.commit();
        let used = t.used();
        assert!(used >= 1000);
        assert!(!t.in_use(&r));
        let p1 = t.pin(r);
        let p2 = p1.clone();
        assert!(t.in_use(&r));
        t.release_ref(r);
        assert_eq!(t.used(), used, "still held by two reads");
        drop(p1);
        assert_eq!(t.used(), used, "still held by one read");
        assert!(p2.bytes().iter().all(|&x| x == 9));
        drop(p2);
        assert_eq!(t.used(), 0, "freed with the last read");
        // Released with no read: freed at once; a pin that ends first changes nothing.
        let r = t.allocate(1000).unwrap().commit();
        drop(t.pin(r));
        assert_eq!(t.used(), used);
        t.release_ref(r);
        assert_eq!(t.used(), 0);
        assert!(t.readers.lock().is_empty());
        // An uncommitted block frees itself when dropped.
        drop(t.allocate(1000).unwrap());
        assert_eq!(t.used(), 0);
    }
}
