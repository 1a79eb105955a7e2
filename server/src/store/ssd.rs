//! The SSD tier: one segment file carved into 4 KiB-aligned extents, read and written with
//! positioned I/O. A block copy is an extent; its locator is the extent's byte offset.
//!
//! Crash safety comes from the order of operations and from the metadata, not from the file:
//! an extent's bytes are complete before any record names it (the record is written after the
//! write returns, and with `ssd.fsync` after the data reached the disk), every read is checked
//! against the block's checksum, and at start the free space is rebuilt from the records that
//! survived (newest first, so a record whose extent was reused by a newer block loses it).
//!
//! Free space is a best-fit map of free ranges, hand-written because recovery must claim the
//! exact extents records name, which the offset-allocator crate (used for DRAM) cannot do.

use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Allocation granularity and alignment (a file-system block).
pub const SSD_UNIT: u64 = 4096;
/// Name of the segment file in the tier's directory.
pub const SEGMENT_FILE: &str = "blocks.kvs";

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("ssd tier i/o on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("ssd extent at {offset} of {len} bytes lies outside the segment ({capacity} bytes)")]
    OutOfRange { offset: u64, len: u64, capacity: u64 },
}

/// Free ranges, by offset and by size (for best fit).
#[derive(Debug, Default)]
struct FreeMap {
    by_offset: BTreeSet<(u64, u64)>,
    by_size: BTreeSet<(u64, u64)>,
    free: u64,
}

impl FreeMap {
    fn insert(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut offset, mut len) = (offset, len);
        // Merge with the free range before and after.
        if let Some(&(po, pl)) = self.by_offset.range(..(offset, 0)).next_back() {
            if po + pl == offset {
                self.take(po, pl);
                offset = po;
                len += pl;
            }
        }
        if let Some(&(no, nl)) = self.by_offset.range((offset + len, 0)..).next() {
            if no == offset + len {
                self.take(no, nl);
                len += nl;
            }
        }
        self.by_offset.insert((offset, len));
        self.by_size.insert((len, offset));
        self.free += len;
    }

    fn take(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&(offset, len));
        self.by_size.remove(&(len, offset));
        self.free -= len;
    }

    /// Best fit: the smallest free range that holds `len`.
    fn allocate(&mut self, len: u64) -> Option<u64> {
        let &(flen, foff) = self.by_size.range((len, 0)..).next()?;
        self.take(foff, flen);
        if flen > len {
            self.insert(foff + len, flen - len);
        }
        Some(foff)
    }

    /// Claim many extents (offset, length) in priority order: one that overlaps an earlier one
    /// of the list, or anything not free, is refused. On a map that is one free range (a tier
    /// at recovery) this sorts and sweeps once instead of splitting the range per extent.
    fn claim_all(&mut self, extents: &[(u64, u64)]) -> Vec<bool> {
        let whole = match (self.by_offset.len(), self.by_offset.first()) {
            (1, Some(&r)) => r,
            _ => return extents.iter().map(|&(o, l)| self.claim(o, l)).collect(),
        };
        let (fo, fend) = (whole.0, whole.0 + whole.1);
        let mut ok = vec![false; extents.len()];
        let mut order: Vec<usize> = (0..extents.len())
            .filter(|&i| {
                let (o, l) = extents[i];
                l > 0 && o >= fo && o.checked_add(l).is_some_and(|e| e <= fend)
            })
            .collect();
        order.sort_unstable_by_key(|&i| (extents[i].0, i));
        let mut kept: Vec<(u64, u64)> = Vec::with_capacity(order.len());
        let mut i = 0;
        while i < order.len() {
            // A cluster: extents that overlap, directly or through each other.
            let (o, l) = extents[order[i]];
            let (mut j, mut end) = (i + 1, o + l);
            while j < order.len() && extents[order[j]].0 < end {
                end = end.max(extents[order[j]].0 + extents[order[j]].1);
                j += 1;
            }
            if j == i + 1 {
                ok[order[i]] = true;
                kept.push((o, l));
            } else {
                // Rare (a crash between an extent's reuse and the old record's removal):
                // the earlier in the list wins, greedily.
                let mut members = order[i..j].to_vec();
                members.sort_unstable();
                let mut taken: Vec<(u64, u64)> = Vec::new();
                for m in members {
                    let (mo, ml) = extents[m];
                    if taken.iter().all(|&(to, tl)| mo + ml <= to || to + tl <= mo) {
                        taken.push((mo, ml));
                        ok[m] = true;
                    }
                }
                taken.sort_unstable();
                kept.extend(taken);
            }
            i = j;
        }
        // What is left free: the gaps between the kept extents.
        self.take(whole.0, whole.1);
        let mut at = fo;
        for (o, l) in kept {
            self.insert(at, o - at);
            at = o + l;
        }
        self.insert(at, fend - at);
        ok
    }

    /// Claim exactly `offset .. offset + len`; false when any of it is not free.
    fn claim(&mut self, offset: u64, len: u64) -> bool {
        let Some(&(fo, fl)) = self.by_offset.range(..=(offset, u64::MAX)).next_back() else { return false };
        if fo > offset || fo + fl < offset + len {
            return false;
        }
        self.take(fo, fl);
        self.insert(fo, offset - fo);
        self.insert(offset + len, fo + fl - offset - len);
        true
    }
}

pub struct SsdTier {
    path: PathBuf,
    file: File,
    capacity: u64,
    fsync: bool,
    free: Mutex<FreeMap>,
}

impl SsdTier {
    /// Open (or create) the segment file of `capacity` bytes in `dir`. All space starts free;
    /// recovery claims the extents that records name with [`SsdTier::adopt`].
    pub fn open(dir: &Path, capacity: u64, fsync: bool) -> Result<SsdTier, SsdError> {
        let io = |source| SsdError::Io { path: dir.to_owned(), source };
        fs::create_dir_all(dir).map_err(io)?;
        let capacity = capacity / SSD_UNIT * SSD_UNIT;
        let path = dir.join(SEGMENT_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|source| SsdError::Io { path: path.clone(), source })?;
        // Sparse: space is only taken on disk as blocks are written.
        file.set_len(capacity).map_err(|source| SsdError::Io { path: path.clone(), source })?;
        let mut free = FreeMap::default();
        free.insert(0, capacity);
        Ok(SsdTier { path, file, capacity, fsync, free: Mutex::new(free) })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.capacity - self.free.lock().free
    }

    pub fn footprint(len: u64) -> u64 {
        len.max(1).div_ceil(SSD_UNIT) * SSD_UNIT
    }

    /// Reserve an extent for `len` bytes; `None` when no free range is large enough.
    pub fn try_reserve(&self, len: u64) -> Option<u64> {
        self.free.lock().allocate(Self::footprint(len))
    }

    /// Give an extent back.
    pub fn free(&self, offset: u64, len: u64) {
        self.free.lock().insert(offset, Self::footprint(len));
    }

    /// Claim the extent a recovered record names; false when it lies outside the segment or
    /// overlaps an extent claimed before (recovery claims newest records first).
    pub fn adopt(&self, offset: u64, len: u64) -> bool {
        self.adopt_all(&[(offset, len)])[0]
    }

    /// [`SsdTier::adopt`] for many extents (offset, block length) at once, in priority order:
    /// where two overlap, the earlier in the list keeps its extent. Recovery claims every
    /// record's extent this way, in one sweep.
    pub fn adopt_all(&self, extents: &[(u64, u64)]) -> Vec<bool> {
        // Misaligned or out-of-range extents become empty ones, which are never claimed.
        let fps: Vec<(u64, u64)> = extents
            .iter()
            .map(|&(offset, len)| {
                let fp = Self::footprint(len);
                let fits =
                    offset.is_multiple_of(SSD_UNIT) && offset.checked_add(fp).is_some_and(|e| e <= self.capacity);
                (offset, if fits { fp } else { 0 })
            })
            .collect();
        self.free.lock().claim_all(&fps)
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), SsdError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(SsdError::OutOfRange { offset, len, capacity: self.capacity }),
        }
    }

    fn io(&self) -> impl FnOnce(io::Error) -> SsdError + '_ {
        move |source| SsdError::Io { path: self.path.clone(), source }
    }

    /// Write a block's bytes into its reserved extent (and sync them with `ssd.fsync`).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), SsdError> {
        self.check(offset, data.len() as u64)?;
        self.file.write_all_at(data, offset).map_err(self.io())?;
        if self.fsync {
            self.file.sync_data().map_err(self.io())?;
        }
        Ok(())
    }

    /// Read into a buffer of exactly the block's length.
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<(), SsdError> {
        self.check(offset, buf.len() as u64)?;
        self.file.read_exact_at(buf, offset).map_err(self.io())
    }

    /// The segment file (tests flip bytes in it).
    pub fn file_path(&self) -> &Path {
        &self.path
    }
}

/// Files of the earlier layout (one file per block, `<id hex>.blk`) in `dir`: (id, length).
pub fn legacy_files(dir: &Path) -> Vec<(u64, u64, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id = u64::from_str_radix(name.strip_suffix(".blk")?, 16).ok()?;
            Some((id, e.metadata().ok()?.len(), e.path()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(t: &SsdTier, offset: u64, len: u64) -> Vec<u8> {
        crate::store::tier::Medium::read(t, &crate::store::tier::SsdExtent { offset, len }, len).unwrap()
    }

    #[test]
    fn best_fit_merges_and_claims_exact_extents() {
        let mut f = FreeMap::default();
        f.insert(0, 100 * SSD_UNIT);
        let a = f.allocate(10 * SSD_UNIT).unwrap();
        let b = f.allocate(20 * SSD_UNIT).unwrap();
        let c = f.allocate(10 * SSD_UNIT).unwrap();
        assert_eq!((a, b, c), (0, 10 * SSD_UNIT, 30 * SSD_UNIT));
        f.insert(b, 20 * SSD_UNIT);
        // Best fit: the 20-unit hole, not the 60-unit tail.
        assert_eq!(f.allocate(15 * SSD_UNIT), Some(b));
        f.insert(b, 15 * SSD_UNIT);
        f.insert(a, 10 * SSD_UNIT);
        f.insert(c, 10 * SSD_UNIT);
        // Everything merged back into one range.
        assert_eq!(f.by_offset.len(), 1);
        assert_eq!(f.free, 100 * SSD_UNIT);
        assert!(f.claim(40 * SSD_UNIT, 5 * SSD_UNIT));
        assert!(!f.claim(42 * SSD_UNIT, SSD_UNIT), "already claimed");
        assert!(!f.claim(99 * SSD_UNIT, 2 * SSD_UNIT), "past the end");
        assert_eq!(f.free, 95 * SSD_UNIT);
    }

    /// The sweep gives the same answer and the same free space as claiming one by one, in
    /// priority order, overlaps and out-of-range extents included.
    #[test]
    fn bulk_claims_agree_with_one_by_one() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..200 {
            let n = 1 + rnd(60) as usize;
            let extents: Vec<(u64, u64)> = (0..n)
                .map(|_| {
                    let len = if rnd(10) == 0 { 0 } else { (1 + rnd(4)) * SSD_UNIT };
                    ((rnd(110)) * SSD_UNIT, len)
                })
                .collect();
            let whole = || {
                let mut f = FreeMap::default();
                f.insert(0, 100 * SSD_UNIT);
                f
            };
            let (mut one, mut bulk) = (whole(), whole());
            let want: Vec<bool> = extents.iter().map(|&(o, l)| l > 0 && one.claim(o, l)).collect();
            assert_eq!(bulk.claim_all(&extents), want, "round {round}: {extents:?}");
            assert_eq!(bulk.free, one.free);
            assert_eq!(bulk.by_offset, one.by_offset);
            assert_eq!(bulk.by_size, one.by_size);
        }
    }

    #[test]
    fn extents_hold_bytes_and_space_is_accounted() {
        let dir = tempfile::tempdir().unwrap();
        let t = SsdTier::open(dir.path(), 1 << 20, false).unwrap();
        let e = t.try_reserve(5000).unwrap();
        assert_eq!(t.used(), 8192);
        t.write(e, &[7u8; 5000]).unwrap();
        assert_eq!(read(&t, e, 5000), vec![7u8; 5000]);
        t.free(e, 5000);
        assert_eq!(t.used(), 0);
        assert!(t.try_reserve(2 << 20).is_none());
        assert!(t.write(1 << 20, &[1]).is_err());
        // Recovery claims what records name, once.
        let t = SsdTier::open(dir.path(), 1 << 20, false).unwrap();
        assert!(t.adopt(e, 5000));
        assert!(!t.adopt(e + 4096, 10), "overlaps");
        assert!(!t.adopt(7, 10), "unaligned");
        assert_eq!(read(&t, e, 5000), vec![7u8; 5000]);
    }
}
