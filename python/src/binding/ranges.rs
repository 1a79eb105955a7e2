//! Raw-address transfers (`put_from`, `get_into` and their `_multi` forms): each item's ranges
//! checked against the registrations and moved by the cheapest path (zero-copy through a shared
//! buffer, in place, or gathered and scattered through a staging buffer); items with a range in
//! device memory go through the device staging of `device.rs`.

use super::client::Client;
use super::device::device_pieces;
use super::error::Res;
use crate::devstage::Piece;
use crate::regions::{self, Place, Regions};
use kvpool_client::blocking::Client as Blocking;
use kvpool_client::{BufSlice, Buffer, ErrorCode, PutEntry, PutMode, PutOptions};
use parking_lot::Mutex;
use std::sync::Arc;

/// Shared buffers kept for multi-buffer transfers that must gather or scatter their pieces.
#[derive(Default)]
pub(super) struct Stage {
    pool: Mutex<Vec<Buffer>>,
}

/// Staging memory kept for reuse, in bytes.
pub(super) const STAGE_KEEP: usize = 256 << 20;

impl Stage {
    pub(super) fn take(&self, client: &Blocking, len: usize) -> Res<Buffer> {
        let mut pool = self.pool.lock();
        if let Some(i) = pool.iter().position(|b| b.len() >= len) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        Ok(client.alloc_buffer(len.max(1 << 20).next_power_of_two())?)
    }

    pub(super) fn give_back(&self, b: Buffer) {
        let mut pool = self.pool.lock();
        let held: usize = pool.iter().map(Buffer::len).sum();
        if held + b.len() <= STAGE_KEEP {
            pool.push(b);
        }
    }
}

/// One item of a raw-address transfer after its ranges were checked.
pub(super) enum Route {
    /// Refused before any byte moved.
    Refused(&'static str),
    /// One range inside a kvpool shared buffer: the server copies directly (same host).
    Shared(Arc<Buffer>, usize, usize),
    /// One range of ordinary memory: `put_batch` / `get_batch_into` (staged through shared
    /// memory by the client on the same host, in band over QUIC elsewhere).
    Plain(usize, usize),
    /// Several ranges: gathered into (or scattered from) a staging buffer.
    Pieces(Vec<(usize, usize)>),
    /// Some range in device memory: copied by its runtime through pinned staging buffers.
    Device(Vec<Piece>),
}

impl Client {
    /// Check every item's ranges against the registrations and choose its path.
    fn route(regions: &Regions<Arc<Buffer>>, pieces: &[Vec<(usize, usize)>]) -> Vec<Route> {
        pieces
            .iter()
            .map(|p| {
                for &(ptr, len) in p {
                    if regions.place(ptr, len).is_err() {
                        return Route::Refused("invalid-argument");
                    }
                }
                if let Some(pieces) = device_pieces(regions, p) {
                    return Route::Device(pieces);
                }
                let joined = regions::coalesce(p);
                match joined.as_slice() {
                    [] => Route::Plain(0, 0),
                    [(ptr, len)] => match regions.place(*ptr, *len) {
                        Ok(Place::Shared(b, off)) => Route::Shared(b.clone(), off, *len),
                        Ok(Place::Plain) => Route::Plain(*ptr, *len),
                        // Adjacent registrations joined into one range (a device one cannot
                        // be here: checked above): move the pieces apart.
                        Ok(Place::Device(_)) | Err(_) => Route::Pieces(p.clone()),
                    },
                    _ => Route::Pieces(joined),
                }
            })
            .collect()
    }

    /// Put values given as address ranges (one or more pieces per key, concatenated).
    pub(super) fn put_ranges(
        &self,
        keys: &[Vec<u8>],
        pieces: &[Vec<(usize, usize)>],
        opts: &[PutOptions],
        mode: PutMode,
    ) -> Res<Vec<&'static str>> {
        let client = self.live()?;
        let regions = self.regions.read();
        let routes = Self::route(&regions, pieces);
        let mut out: Vec<&'static str> = vec!["ok"; keys.len()];
        let (mut shared, mut plain, mut gather, mut device) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, r) in routes.iter().enumerate() {
            match r {
                Route::Refused(code) => out[i] = code,
                Route::Shared(..) => shared.push(i),
                Route::Plain(..) => plain.push(i),
                Route::Pieces(_) => gather.push(i),
                Route::Device(p) => device.push((i, p.clone())),
            }
        }
        if !device.is_empty() {
            for (&(i, _), st) in device.iter().zip(self.put_staged(client, keys, opts, mode, &device)?) {
                out[i] = st;
            }
        }
        let chunk = self.max_batch();
        for part in shared.chunks(chunk) {
            let entries: Vec<(&[u8], BufSlice<'_>, PutOptions)> = part
                .iter()
                .map(|&i| match &routes[i] {
                    Route::Shared(b, off, len) => Ok((keys[i].as_slice(), b.slice(*off, *len)?, opts[i].clone())),
                    _ => unreachable!("shared items only"),
                })
                .collect::<Res<_>>()?;
            for (&i, st) in part.iter().zip(client.put_from_batch(&entries, mode)?) {
                out[i] = st.name();
            }
        }
        for part in plain.chunks(chunk) {
            let entries: Vec<PutEntry<'_>> = part
                .iter()
                .map(|&i| match routes[i] {
                    Route::Plain(ptr, len) => PutEntry { key: &keys[i], value: raw(ptr, len), opts: opts[i].clone() },
                    _ => unreachable!("plain items only"),
                })
                .collect();
            for (&i, st) in part.iter().zip(client.put_batch(&entries, mode)?) {
                out[i] = st.name();
            }
        }
        for part in gather.chunks(chunk) {
            let lens: Vec<usize> = part
                .iter()
                .map(|&i| match &routes[i] {
                    Route::Pieces(p) => p.iter().map(|x| x.1).sum(),
                    _ => unreachable!("gathered items only"),
                })
                .collect();
            let mut stage = self.stage.take(client, lens.iter().sum())?;
            let mut at = 0;
            for &i in part {
                if let Route::Pieces(p) = &routes[i] {
                    for &(ptr, len) in p {
                        stage.as_mut_slice()[at..at + len].copy_from_slice(raw(ptr, len));
                        at += len;
                    }
                }
            }
            let mut at = 0;
            let mut entries = Vec::with_capacity(part.len());
            for (&i, &len) in part.iter().zip(&lens) {
                entries.push((keys[i].as_slice(), stage.slice(at, len)?, opts[i].clone()));
                at += len;
            }
            let r = client.put_from_batch(&entries, mode);
            drop(entries);
            self.stage.give_back(stage);
            for (&i, st) in part.iter().zip(r?) {
                out[i] = st.name();
            }
        }
        Ok(out)
    }

    /// Get values into address ranges (one or more pieces per key, filled in order).
    pub(super) fn get_ranges(&self, keys: &[Vec<u8>], pieces: &[Vec<(usize, usize)>]) -> Res<Vec<(&'static str, u64)>> {
        let client = self.live()?;
        let mut all: Vec<(usize, usize)> = pieces.iter().flatten().copied().collect();
        regions::check_disjoint(&mut all)?;
        let regions = self.regions.read();
        let routes = Self::route(&regions, pieces);
        let mut out: Vec<(&'static str, u64)> = vec![("ok", 0); keys.len()];
        let (mut shared, mut plain, mut scatter, mut device) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, r) in routes.iter().enumerate() {
            match r {
                Route::Refused(code) => out[i] = (code, 0),
                Route::Shared(..) => shared.push(i),
                Route::Plain(..) => plain.push(i),
                Route::Pieces(_) => scatter.push(i),
                Route::Device(p) => device.push((i, p.clone())),
            }
        }
        if !device.is_empty() {
            for (&(i, _), r) in device.iter().zip(self.get_staged(client, keys, &device)?) {
                out[i] = r;
            }
        }
        let chunk = self.max_batch();
        for part in shared.chunks(chunk) {
            let dests: Vec<BufSlice<'_>> = part
                .iter()
                .map(|&i| match &routes[i] {
                    Route::Shared(b, off, len) => Ok(b.slice(*off, *len)?),
                    _ => unreachable!("shared items only"),
                })
                .collect::<Res<_>>()?;
            let ks: Vec<&[u8]> = part.iter().map(|&i| keys[i].as_slice()).collect();
            for (&i, r) in part.iter().zip(client.get_into_batch(&ks, &dests)?) {
                out[i] = (r.status.name(), r.size);
            }
        }
        for part in plain.chunks(chunk) {
            let ks: Vec<&[u8]> = part.iter().map(|&i| keys[i].as_slice()).collect();
            let mut bufs: Vec<&mut [u8]> = part
                .iter()
                .map(|&i| match routes[i] {
                    Route::Plain(ptr, len) => raw_mut(ptr, len),
                    _ => unreachable!("plain items only"),
                })
                .collect();
            for (&i, r) in part.iter().zip(client.get_batch_into(&ks, &mut bufs)?) {
                out[i] = (r.status.name(), r.size);
            }
        }
        for part in scatter.chunks(chunk) {
            let lens: Vec<usize> = part
                .iter()
                .map(|&i| match &routes[i] {
                    Route::Pieces(p) => p.iter().map(|x| x.1).sum(),
                    _ => unreachable!("scattered items only"),
                })
                .collect();
            let stage = self.stage.take(client, lens.iter().sum())?;
            let mut at = 0;
            let mut dests = Vec::with_capacity(part.len());
            for &len in &lens {
                dests.push(stage.slice(at, len)?);
                at += len;
            }
            let ks: Vec<&[u8]> = part.iter().map(|&i| keys[i].as_slice()).collect();
            let r = client.get_into_batch(&ks, &dests);
            if let Ok(items) = &r {
                for ((&i, item), d) in part.iter().zip(items).zip(&dests) {
                    if item.status != ErrorCode::Ok {
                        continue;
                    }
                    let Route::Pieces(p) = &routes[i] else { unreachable!("scattered items only") };
                    let src = &stage.as_slice()[d.offset..d.offset + item.size as usize];
                    let mut from = 0;
                    for &(ptr, len) in p {
                        let n = len.min(src.len() - from);
                        raw_mut(ptr, n).copy_from_slice(&src[from..from + n]);
                        from += n;
                    }
                }
            }
            drop(dests);
            self.stage.give_back(stage);
            for (&i, item) in part.iter().zip(r?) {
                out[i] = (item.status.name(), item.size);
            }
        }
        Ok(out)
    }
}

/// Bytes at a checked address range of registered memory.
pub(super) fn raw<'a>(ptr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the range was checked to lie inside a registered range; the caller of
    // `register` promised that memory stays valid until it is unregistered, and unregistering
    // waits for transfers in flight (they hold the registry's read lock).
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
}

/// Writable bytes at a checked address range of registered memory (see [`raw`]); the
/// destinations of one call were checked not to overlap.
pub(super) fn raw_mut<'a>(ptr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: as for `raw`, plus `check_disjoint` on the call's destinations.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}
