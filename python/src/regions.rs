//! Registered address ranges: Mooncake's `register_buffer(ptr, size)`.
//!
//! Transfers that name raw addresses (`put_from`, `get_into` and their batch and multi-buffer
//! forms) are checked against these ranges before any byte is touched: an address range that
//! is not entirely inside one registered range is refused with an error, never dereferenced.
//! A range may be backed by a kvpool shared buffer (then the server copies straight between its
//! segment and that memory); the backing is kept alive while the range stays registered. A range
//! may also be device memory (a GPU's or an NPU's, as its runtime said at registration): its bytes
//! are only ever moved by that runtime's copies, never read from the host.

use kvpool_devmem::Location;
use std::collections::BTreeMap;

/// Why a registration or an address range was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("the range {start:#x}+{len} is empty or wraps around the address space")]
    BadRange { start: usize, len: usize },
    #[error("the range {start:#x}+{len} overlaps the registered buffer {other:#x}+{other_len}")]
    Overlap { start: usize, len: usize, other: usize, other_len: usize },
    #[error("no buffer is registered at {0:#x}")]
    NotRegistered(usize),
    #[error("{ptr:#x}+{len} is not inside one registered buffer")]
    Outside { ptr: usize, len: usize },
    #[error("{start:#x}+{len} is not host memory this process can read and write: {why}")]
    NotHostMemory { start: usize, len: usize, why: String },
    #[error("destination {a:#x}+{a_len} overlaps destination {b:#x}+{b_len} of the same call")]
    Aliased { a: usize, a_len: usize, b: usize, b_len: usize },
}

/// What a registered range is.
#[derive(Debug, Clone)]
pub enum Mem<B> {
    /// Host memory of this process.
    Host,
    /// Inside this kvpool shared buffer, at this offset.
    Shared(B, usize),
    /// Memory of this device.
    Device(Location),
}

/// One registered range.
#[derive(Debug, Clone)]
pub struct Region<B> {
    pub start: usize,
    pub len: usize,
    pub mem: Mem<B>,
}

/// Where the bytes of a checked address range are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place<'a, B> {
    /// Inside a kvpool shared buffer, at this offset: zero-copy on a same-host connection.
    Shared(&'a B, usize),
    /// Ordinary memory of this process.
    Plain,
    /// Device memory: moved by its runtime only.
    Device(Location),
}

/// The registered ranges of one client, disjoint, by start address.
#[derive(Debug)]
pub struct Regions<B> {
    map: BTreeMap<usize, Region<B>>,
}

impl<B> Default for Regions<B> {
    fn default() -> Self {
        Regions { map: BTreeMap::new() }
    }
}

impl<B> Regions<B> {
    /// Register `[start, start + len)`. Ranges may not overlap (Mooncake refuses a second
    /// registration of the same memory too).
    pub fn add(&mut self, start: usize, len: usize, mem: Mem<B>) -> Result<(), RegionError> {
        let end = match start.checked_add(len) {
            Some(e) if len > 0 && start > 0 => e,
            _ => return Err(RegionError::BadRange { start, len }),
        };
        if let Some(r) = self.map.range(..end).next_back() {
            if r.1.start + r.1.len > start {
                return Err(RegionError::Overlap { start, len, other: r.1.start, other_len: r.1.len });
            }
        }
        self.map.insert(start, Region { start, len, mem });
        Ok(())
    }

    /// Unregister the range that starts at `start`.
    pub fn remove(&mut self, start: usize) -> Result<Region<B>, RegionError> {
        self.map.remove(&start).ok_or(RegionError::NotRegistered(start))
    }

    /// The registered range holding all of `[ptr, ptr + len)`.
    pub fn find(&self, ptr: usize, len: usize) -> Result<&Region<B>, RegionError> {
        let outside = RegionError::Outside { ptr, len };
        let end = ptr.checked_add(len).ok_or(outside.clone())?;
        match self.map.range(..=ptr).next_back() {
            Some((_, r)) if end <= r.start + r.len => Ok(r),
            _ => Err(outside),
        }
    }

    /// Check `[ptr, ptr + len)` and say where its bytes are.
    pub fn place(&self, ptr: usize, len: usize) -> Result<Place<'_, B>, RegionError> {
        let r = self.find(ptr, len)?;
        Ok(match &r.mem {
            Mem::Shared(b, off) => Place::Shared(b, off + (ptr - r.start)),
            Mem::Host => Place::Plain,
            Mem::Device(loc) => Place::Device(*loc),
        })
    }

    /// Every range, in address order.
    pub fn iter(&self) -> impl Iterator<Item = &Region<B>> {
        self.map.values()
    }
}

/// Refuse destinations of one call that overlap each other (two values written to the same
/// bytes). Empty ranges never overlap anything.
pub fn check_disjoint(ranges: &mut [(usize, usize)]) -> Result<(), RegionError> {
    ranges.sort_unstable();
    let mut last: Option<(usize, usize)> = None;
    for &(p, l) in ranges.iter().filter(|r| r.1 > 0) {
        if let Some((a, a_len)) = last {
            if a + a_len > p {
                return Err(RegionError::Aliased { a, a_len, b: p, b_len: l });
            }
        }
        last = Some((p, l));
    }
    Ok(())
}

/// Join address ranges that follow each other in memory (`[(p, 8), (p + 8, 8)]` is one range of
/// 16 bytes): a multi-buffer value laid out contiguously moves as one slice.
pub fn coalesce(pieces: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(pieces.len());
    for &(p, l) in pieces {
        match out.last_mut() {
            Some((q, m)) if q.checked_add(*m) == Some(p) => *m += l,
            _ => out.push((p, l)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_lie_inside_one_registration() {
        let mut r: Regions<u32> = Regions::default();
        r.add(0x1000, 0x100, Mem::Host).unwrap();
        r.add(0x1100, 0x100, Mem::Shared(7, 0x40)).unwrap();
        let gpu = Location { kind: kvpool_devmem::Kind::Cuda, device: 1 };
        r.add(0x1400, 0x100, Mem::Device(gpu)).unwrap();
        assert_eq!(r.place(0x1000, 0x100), Ok(Place::Plain));
        assert_eq!(r.place(0x1180, 0x10), Ok(Place::Shared(&7, 0xc0)));
        assert_eq!(r.place(0x1410, 0x10), Ok(Place::Device(gpu)));
        assert!(r.place(0x13f0, 0x20).is_err());
        // Spans two adjacent registrations: refused, each is a separate buffer.
        assert_eq!(r.place(0x10f0, 0x20), Err(RegionError::Outside { ptr: 0x10f0, len: 0x20 }));
        // Before, after, one byte past the end, address-space wrap.
        assert!(r.place(0xfff, 1).is_err());
        assert!(r.place(0x1300, 1).is_err());
        assert!(r.place(0x11ff, 2).is_err());
        assert!(r.place(usize::MAX - 1, 4).is_err());
        // An empty range at the end of a registration is inside it.
        assert_eq!(r.place(0x1200, 0), Ok(Place::Shared(&7, 0x140)));
    }

    #[test]
    fn registrations_do_not_overlap_and_unregister_by_start() {
        let mut r: Regions<()> = Regions::default();
        r.add(0x2000, 0x100, Mem::Host).unwrap();
        assert!(matches!(r.add(0x20ff, 1, Mem::Host), Err(RegionError::Overlap { other: 0x2000, .. })));
        assert!(matches!(r.add(0x1f00, 0x101, Mem::Host), Err(RegionError::Overlap { .. })));
        assert!(matches!(r.add(0, 8, Mem::Host), Err(RegionError::BadRange { .. })));
        assert!(matches!(r.add(0x10, 0, Mem::Host), Err(RegionError::BadRange { .. })));
        r.add(0x1f00, 0x100, Mem::Host).unwrap();
        assert_eq!(r.iter().count(), 2);
        assert_eq!(r.remove(0x2010).unwrap_err(), RegionError::NotRegistered(0x2010));
        r.remove(0x2000).unwrap();
        assert!(r.place(0x2000, 1).is_err());
        assert!(r.place(0x1fff, 1).is_ok());
    }

    #[test]
    fn aliasing_destinations_are_found() {
        assert!(check_disjoint(&mut [(0x30, 0x10), (0x10, 0x20)]).is_ok());
        assert!(check_disjoint(&mut [(0x10, 0), (0x10, 0x10)]).is_ok());
        assert_eq!(
            check_disjoint(&mut [(0x30, 0x10), (0x10, 0x21)]),
            Err(RegionError::Aliased { a: 0x10, a_len: 0x21, b: 0x30, b_len: 0x10 })
        );
    }

    #[test]
    fn contiguous_pieces_coalesce() {
        assert_eq!(coalesce(&[(0x10, 8), (0x18, 8), (0x40, 4), (0x44, 0)]), vec![(0x10, 16), (0x40, 4)]);
        assert_eq!(coalesce(&[]), vec![]);
    }
}
