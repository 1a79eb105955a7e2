//! Device memory in the client: which runtime claims a registered range, and the staged
//! transfers of items with pieces in device memory (see [`crate::devstage`]).
//!
//! A client's runtimes come from the environment at its first registration
//! ([`kvpool_devmem::Runtimes::from_env`]); its staging buffers are kvpool shared buffers
//! (`alloc_buffer`): a same-host server copies straight between its segment and them, and
//! elsewhere their bytes go in band.

use super::client::Client;
use super::error::{Error, Res};
use crate::devstage::{At, Piece, StageMem, Staged};
use crate::regions::{Place, Regions};
use kvpool_client::blocking::Client as Blocking;
use kvpool_client::{BufSlice, Buffer, ErrorCode, PutMode, PutOptions};
use kvpool_devmem::{DevmemError, Location, Memory, Runtimes};
use std::sync::Arc;

/// Default bytes per staging chunk: large enough that a copy and a transfer each cost far more
/// than their calls, small enough that two in flight per call stay cheap to pin.
pub(super) const DEVICE_CHUNK: usize = 16 << 20;

/// The status of an item whose device copy failed (the client's `last_device_error` says why).
pub(super) const DEVICE_ERROR: &str = "device-error";

impl StageMem for Buffer {
    fn base(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn size(&self) -> usize {
        self.len()
    }
}

/// What the runtimes say a range is.
pub(super) enum Claim {
    /// Device memory.
    Device(Location),
    /// Host memory a runtime allocated or pinned (or managed memory): readable from the host.
    Host,
}

impl Client {
    /// This client's runtimes (read from the environment once).
    pub(super) fn runtimes(&self) -> Res<&Runtimes> {
        self.devices.get_or_init(Runtimes::from_env).as_ref().map_err(|e| Error::Device(e.clone()))
    }

    /// What the runtimes say `[ptr, ptr + size)` is; None when none claims it. A runtime that
    /// cannot answer (no device, no driver) claims nothing.
    pub(super) fn claim(&self, ptr: usize, size: usize) -> Res<Option<Claim>> {
        for rt in self.runtimes()?.iter() {
            match rt.classify_range(ptr, size) {
                Ok(Memory::Device(d)) => return Ok(Some(Claim::Device(Location { kind: rt.kind(), device: d }))),
                Ok(Memory::Host | Memory::Managed) => return Ok(Some(Claim::Host)),
                Ok(Memory::Unregistered) => {}
                Err(e @ DevmemError::Refused { .. }) => return Err(Error::Device(e)),
                Err(e) => tracing::debug!("{e}"),
            }
        }
        Ok(None)
    }

    fn device_failure(&self, e: DevmemError) -> &'static str {
        tracing::warn!("device copy failed: {e}");
        *self.device_error.lock() = Some(e.to_string());
        DEVICE_ERROR
    }

    /// Put items with pieces in device memory through the staging buffers.
    pub(super) fn put_staged(
        &self,
        client: &Blocking,
        keys: &[Vec<u8>],
        opts: &[PutOptions],
        mode: PutMode,
        staged: &[(usize, Vec<Piece>)],
    ) -> Res<Vec<&'static str>> {
        let rts = self.runtimes()?;
        let items: Vec<Vec<Piece>> = staged.iter().map(|s| s.1.clone()).collect();
        let mut alloc = |len: usize| -> Res<Buffer> { Ok(client.alloc_buffer(len)?) };
        let mut send = |buf: &Buffer, entries: &[(usize, usize, usize)]| -> Res<Vec<&'static str>> {
            let e: Vec<(&[u8], BufSlice<'_>, PutOptions)> = entries
                .iter()
                .map(|&(j, off, len)| {
                    let i = staged[j].0;
                    Ok((keys[i].as_slice(), buf.slice(off, len)?, opts[i].clone()))
                })
                .collect::<Res<_>>()?;
            Ok(client.put_from_batch(&e, mode)?.into_iter().map(ErrorCode::name).collect())
        };
        // SAFETY: every host piece lies in a registered host range and every device piece in a
        // range its runtime called device memory of that device at registration; the caller holds
        // the registry's read lock for the whole call (unregister waits for it), and whoever
        // registered a range promised it stays valid until unregistered.
        let out = unsafe { self.staging.put(rts, &items, self.max_batch(), &mut alloc, &mut send) }?;
        Ok(out
            .into_iter()
            .map(|o| match o {
                Staged::Done(s) => s,
                Staged::Failed(e) => self.device_failure(e),
            })
            .collect())
    }

    /// Get items with pieces in device memory through the staging buffers.
    pub(super) fn get_staged(
        &self,
        client: &Blocking,
        keys: &[Vec<u8>],
        staged: &[(usize, Vec<Piece>)],
    ) -> Res<Vec<(&'static str, u64)>> {
        let rts = self.runtimes()?;
        let items: Vec<Vec<Piece>> = staged.iter().map(|s| s.1.clone()).collect();
        let mut alloc = |len: usize| -> Res<Buffer> { Ok(client.alloc_buffer(len)?) };
        type Got = Vec<((&'static str, u64), Option<usize>)>;
        let mut recv = |buf: &Buffer, entries: &[(usize, usize, usize)]| -> Res<Got> {
            let ks: Vec<&[u8]> = entries.iter().map(|&(j, ..)| keys[staged[j].0].as_slice()).collect();
            let dests: Vec<BufSlice<'_>> =
                entries.iter().map(|&(_, off, cap)| buf.slice(off, cap)).collect::<Result<_, _>>()?;
            let got = client.get_into_batch(&ks, &dests)?;
            Ok(got
                .into_iter()
                .map(|r| ((r.status.name(), r.size), (r.status == ErrorCode::Ok).then_some(r.size as usize)))
                .collect())
        };
        // SAFETY: as in put_staged; the destinations of the call were checked not to overlap.
        let out = unsafe { self.staging.get(rts, &items, self.max_batch(), &mut alloc, &mut recv) }?;
        Ok(out
            .into_iter()
            .map(|o| match o {
                Staged::Done(s) => s,
                Staged::Failed(e) => (self.device_failure(e), 0),
            })
            .collect())
    }
}

/// The pieces of an item that has one in device memory, as the staged path takes them
/// (contiguous pieces of one registration joined); None for an item without device memory.
/// Every piece was checked to lie inside one registration.
pub(super) fn device_pieces(regions: &Regions<Arc<Buffer>>, pieces: &[(usize, usize)]) -> Option<Vec<Piece>> {
    let at = |ptr: usize, len: usize| match regions.place(ptr, len) {
        Ok(Place::Device(loc)) => Some(At::Device(loc)),
        Ok(_) => Some(At::Host),
        Err(_) => None,
    };
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for &(ptr, len) in pieces {
        let here = at(ptr, len)?;
        if let Some(last) = out.last_mut() {
            if last.at == here
                && last.ptr.checked_add(last.len) == Some(ptr)
                && at(last.ptr, last.len + len) == Some(here)
            {
                last.len += len;
                continue;
            }
        }
        out.push(Piece { ptr, len, at: here });
    }
    out.iter().any(|p| matches!(p.at, At::Device(_))).then_some(out)
}
