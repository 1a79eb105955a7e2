//! Raw-address transfers of device memory: staged through pinned host buffers and pipelined
//! with the transfer.
//!
//! A put of items that have pieces in device memory copies those pieces device-to-host into a
//! staging buffer and sends the buffer; a get receives into a staging buffer and copies the
//! pieces host-to-device. Pieces in host memory are copied by the CPU into (or out of) the same
//! buffer, so an item may mix both. Nothing here ever reads a device address from the host.
//!
//! - **Staging.** Buffers of at least `chunk` bytes (`M`: the binding's are kvpool shared buffers,
//!   which a same-host server reads and writes directly, and which go in band elsewhere), kept
//!   in a pool per client up to `keep` bytes. Each buffer is page-locked by every runtime that
//!   copies with it (`cudaHostRegister`, `aclrtHostRegister`), once, and has its own stream per
//!   device, so waiting for one buffer's copies never waits for another's.
//! - **Chunks.** Items are grouped into chunks of at most `chunk` bytes and the server's batch
//!   limit (an item larger than `chunk` is a chunk of its own); a call uses two buffers.
//! - **Put.** The copies of chunk i+1 are queued before chunk i is waited for and sent, so the
//!   device fills one buffer while the other goes to the server. Chunk i is sent only after the
//!   fence recorded behind its copies (a CUDA event, an ACL stream sync) was waited for.
//! - **Get.** Chunk i+1 is received into the other buffer while chunk i's host-to-device copies
//!   run; before a buffer is received into again, the fence of its previous copies is waited
//!   for, and every fence is waited for before the call returns: the bytes are on the device
//!   when it does.
//! - **Failures.** A copy that cannot be queued, or whose fence reports an error, fails its item
//!   ([`Staged::Failed`]), never the call; the transfer's own errors end the call (after waiting
//!   for every copy in flight, so no buffer is reused or freed under a running copy).

use kvpool_devmem::{DevmemError, Direction, Fence, Kind, Location, Pinned, Runtime, Runtimes, Stream};
use parking_lot::Mutex;

/// Where a piece of an item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Host,
    Device(Location),
}

/// A piece of an item: `len` bytes at `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub ptr: usize,
    pub len: usize,
    pub at: At,
}

/// Memory a staging buffer is made of.
pub trait StageMem {
    fn base(&self) -> *mut u8;
    fn size(&self) -> usize;
}

/// What became of one staged item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Staged<S> {
    /// Sent or received; the transfer's answer for it.
    Done(S),
    /// A device copy of it failed.
    Failed(DevmemError),
}

/// An item in a staging buffer: `(item, offset in the buffer, length)`.
pub type Entry = (usize, usize, usize);

/// Per chunk, its items.
pub type Chunk = Vec<Entry>;

/// What sends a chunk: a staging buffer and its entries in, one status per entry out.
pub type SendFn<'a, M, S, E> = dyn FnMut(&M, &[Entry]) -> Result<Vec<S>, E> + 'a;

/// What receives a chunk: per entry a status and, where the value's bytes are now in the buffer
/// at the entry's offset, their count.
pub type RecvFn<'a, M, S, E> = dyn FnMut(&M, &[Entry]) -> Result<Vec<(S, Option<usize>)>, E> + 'a;

/// Group items of these lengths into chunks of at most `chunk` bytes and `max_items` items, in
/// order; an item longer than `chunk` is a chunk of its own.
pub fn plan(lens: &[usize], chunk: usize, max_items: usize) -> Vec<Chunk> {
    let mut out: Vec<Chunk> = Vec::new();
    let mut cur: Chunk = Vec::new();
    let mut at = 0;
    for (i, &len) in lens.iter().enumerate() {
        if !cur.is_empty() && (at + len > chunk || cur.len() >= max_items.max(1)) {
            out.push(std::mem::take(&mut cur));
            at = 0;
        }
        cur.push((i, at, len));
        at += len;
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// One staging buffer with its pins and streams.
struct Slot<M> {
    streams: Vec<Stream>,
    pins: Vec<Pinned>,
    /// Runtimes that failed to pin it: not asked again (copies still work, through the driver's
    /// own staging).
    unpinnable: Vec<Kind>,
    /// Last: dropped after the streams (which wait for their copies) and the pins.
    mem: M,
}

fn runtime(rts: &Runtimes, kind: Kind) -> Result<&Runtime, DevmemError> {
    rts.get(kind).ok_or_else(|| DevmemError::Refused { runtime: kind, what: "the runtime is not loaded".into() })
}

impl<M: StageMem> Slot<M> {
    fn stream(&mut self, rts: &Runtimes, loc: Location) -> Result<&Stream, DevmemError> {
        if let Some(i) = self.streams.iter().position(|s| s.location() == loc) {
            return Ok(&self.streams[i]);
        }
        let rt = runtime(rts, loc.kind)?;
        if !self.pins.iter().any(|p| p.kind() == loc.kind) && !self.unpinnable.contains(&loc.kind) {
            // SAFETY: `mem` outlives the pin: pins are dropped before it (field order).
            match unsafe { rt.pin(self.mem.base(), self.mem.size(), loc.device) } {
                Ok(p) => self.pins.push(p),
                Err(e) => {
                    tracing::warn!("staging buffer not page-locked, device copies will be slower: {e}");
                    self.unpinnable.push(loc.kind);
                }
            }
        }
        self.streams.push(rt.stream(loc.device)?);
        Ok(self.streams.last().expect("just pushed"))
    }
}

/// The copies queued for one chunk, not yet waited for.
struct Batch {
    entries: Chunk,
    fences: Vec<(Fence, Vec<usize>)>,
    failed: Vec<(usize, DevmemError)>,
}

impl Batch {
    /// Wait for every copy; failed items are recorded in `out`. The entries whose copies all
    /// succeeded.
    fn settle<S>(self, out: &mut [Option<Staged<S>>]) -> Chunk {
        let mut failed = self.failed;
        for (fence, items) in self.fences {
            if let Err(e) = fence.wait() {
                failed.extend(items.into_iter().map(|i| (i, e.clone())));
            }
        }
        for (i, e) in failed {
            out[i].get_or_insert(Staged::Failed(e));
        }
        self.entries.into_iter().filter(|e| out[e.0].is_none()).collect()
    }
}

/// Queue the copies of `entries` (`(item, offset, bytes)`) between their pieces and `slot`.
///
/// # Safety
/// As [`Staging::put`] (device to host) and [`Staging::get`] (host to device); the entries lie
/// inside the slot's memory.
unsafe fn queue<M: StageMem>(
    slot: &mut Slot<M>,
    rts: &Runtimes,
    items: &[Vec<Piece>],
    entries: Chunk,
    dir: Direction,
) -> Batch {
    let base = slot.mem.base();
    let mut failed = Vec::new();
    let mut used: Vec<(Location, Vec<usize>)> = Vec::new();
    'items: for &(i, off, bytes) in &entries {
        let (mut at, mut left) = (off, bytes);
        for p in &items[i] {
            let n = p.len.min(left);
            if n == 0 {
                break;
            }
            // SAFETY: `at + n` stays inside the entry, which lies inside the slot.
            let host = unsafe { base.add(at) };
            match (p.at, dir) {
                // SAFETY: a host piece is readable (put) or writable and not aliased (get) for
                // the call (the caller's contract), and does not overlap the slot.
                (At::Host, Direction::DeviceToHost) => unsafe {
                    std::ptr::copy_nonoverlapping(p.ptr as *const u8, host, n)
                },
                // SAFETY: as above.
                (At::Host, Direction::HostToDevice) => unsafe {
                    std::ptr::copy_nonoverlapping(host, p.ptr as *mut u8, n)
                },
                (At::Device(loc), _) => {
                    // SAFETY: the slot's bytes are neither read nor written by us until this
                    // batch is settled (the fences below), and the slot outlives that.
                    let queued = slot.stream(rts, loc).and_then(|s| unsafe { s.copy(dir, p.ptr, host, n) });
                    if let Err(e) = queued {
                        failed.push((i, e));
                        continue 'items;
                    }
                    match used.iter_mut().find(|u| u.0 == loc) {
                        Some(u) => u.1.push(i),
                        None => used.push((loc, vec![i])),
                    }
                }
            }
            at += n;
            left -= n;
        }
    }
    let mut fences = Vec::new();
    for (loc, its) in used {
        let stream = slot.stream(rts, loc).expect("made above");
        match stream.fence() {
            Ok(f) => fences.push((f, its)),
            Err(e) => {
                // Without a fence the copies must still be over before the slot is reused.
                let _ = stream.synchronize();
                failed.extend(its.into_iter().map(|i| (i, e.clone())));
            }
        }
    }
    Batch { entries, fences, failed }
}

/// The staging buffers of one client.
pub struct Staging<M> {
    chunk: usize,
    keep: usize,
    pool: Mutex<Vec<Slot<M>>>,
}

impl<M: StageMem> Staging<M> {
    /// Chunks of `chunk` bytes; up to `keep` bytes of buffers kept between calls.
    pub fn new(chunk: usize, keep: usize) -> Self {
        Staging { chunk: chunk.max(1), keep, pool: Mutex::new(Vec::new()) }
    }

    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Buffers of at least `need` bytes for `n` chunks (two at most).
    fn take<E>(&self, n: usize, need: usize, alloc: &mut dyn FnMut(usize) -> Result<M, E>) -> Result<Vec<Slot<M>>, E> {
        let mut slots = Vec::with_capacity(n.min(2));
        {
            let mut pool = self.pool.lock();
            while slots.len() < n.min(2) {
                let Some(i) = pool.iter().position(|s| s.mem.size() >= need) else { break };
                slots.push(pool.swap_remove(i));
            }
        }
        while slots.len() < n.min(2) {
            match alloc(need.max(self.chunk)) {
                Ok(mem) => slots.push(Slot { streams: Vec::new(), pins: Vec::new(), unpinnable: Vec::new(), mem }),
                Err(e) => {
                    self.give_back(slots);
                    return Err(e);
                }
            }
        }
        Ok(slots)
    }

    fn give_back(&self, slots: Vec<Slot<M>>) {
        let mut pool = self.pool.lock();
        for s in slots {
            let held: usize = pool.iter().map(|s| s.mem.size()).sum();
            if held + s.mem.size() <= self.keep {
                pool.push(s);
            }
        }
    }

    /// Put `items` (each the concatenation of its pieces): `send` gets a staging buffer and the
    /// chunk's entries whose bytes are in it, and answers one status per entry. One outcome per
    /// item.
    ///
    /// # Safety
    /// Host pieces are readable for the whole call; device pieces are device memory of the
    /// runtime and device their [`At`] names (the runtime checks the addresses) and stay
    /// allocated for the whole call.
    pub unsafe fn put<S, E>(
        &self,
        rts: &Runtimes,
        items: &[Vec<Piece>],
        max_items: usize,
        alloc: &mut dyn FnMut(usize) -> Result<M, E>,
        send: &mut SendFn<'_, M, S, E>,
    ) -> Result<Vec<Staged<S>>, E> {
        let lens: Vec<usize> = items.iter().map(|p| p.iter().map(|x| x.len).sum()).collect();
        let chunks = plan(&lens, self.chunk, max_items);
        let mut slots = self.take(chunks.len(), need(&chunks), alloc)?;
        let mut out: Vec<Option<Staged<S>>> = items.iter().map(|_| None).collect();
        let mut chunks = chunks.into_iter();
        let mut cur = chunks.next().map(|c| {
            // SAFETY: the caller's contract on the pieces; every chunk fits a slot (`need`).
            unsafe { queue(&mut slots[0], rts, items, c, Direction::DeviceToHost) }
        });
        let mut k = 0;
        let result = loop {
            let Some(batch) = cur.take() else { break Ok(()) };
            // The next chunk's copies run while this one is waited for and sent.
            let next = chunks.next().map(|c| {
                // SAFETY: as above; the other slot's last chunk was sent already (sends are
                // synchronous), so nothing reads it.
                unsafe { queue(&mut slots[1 - k], rts, items, c, Direction::DeviceToHost) }
            });
            let ready = batch.settle(&mut out);
            if !ready.is_empty() {
                match send(&slots[k].mem, &ready) {
                    Ok(st) => {
                        for (e, s) in ready.iter().zip(st) {
                            out[e.0] = Some(Staged::Done(s));
                        }
                    }
                    Err(e) => {
                        if let Some(n) = next {
                            n.settle(&mut out);
                        }
                        break Err(e);
                    }
                }
            }
            cur = next;
            k = 1 - k;
        };
        self.give_back(slots);
        result?;
        Ok(out.into_iter().map(|o| o.expect("every item is in one chunk")).collect())
    }

    /// Get `items` (each filled piece by piece, in order): `recv` gets a staging buffer and the
    /// chunk's entries `(item, offset, capacity)` and answers per entry a status and, where the
    /// value's bytes are now in the buffer at the entry's offset, their count. One outcome per
    /// item; every host-to-device copy is complete when this returns.
    ///
    /// # Safety
    /// Host pieces are writable and not otherwise in use for the whole call, and no two pieces
    /// of the call overlap; device pieces as for [`Staging::put`].
    pub unsafe fn get<S, E>(
        &self,
        rts: &Runtimes,
        items: &[Vec<Piece>],
        max_items: usize,
        alloc: &mut dyn FnMut(usize) -> Result<M, E>,
        recv: &mut RecvFn<'_, M, S, E>,
    ) -> Result<Vec<Staged<S>>, E> {
        let caps: Vec<usize> = items.iter().map(|p| p.iter().map(|x| x.len).sum()).collect();
        let chunks = plan(&caps, self.chunk, max_items);
        let mut slots = self.take(chunks.len(), need(&chunks), alloc)?;
        let mut out: Vec<Option<Staged<S>>> = items.iter().map(|_| None).collect();
        let mut answered: Vec<Option<S>> = items.iter().map(|_| None).collect();
        let mut inflight: [Option<Batch>; 2] = [None, None];
        let mut result = Ok(());
        for (i, chunk) in chunks.into_iter().enumerate() {
            let k = i % 2;
            // This buffer's previous copies read it: they are over before it is received into.
            if let Some(b) = inflight[k].take() {
                b.settle(&mut out);
            }
            let got = match recv(&slots[k].mem, &chunk) {
                Ok(g) => g,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            let mut fill = Vec::with_capacity(chunk.len());
            for (&(item, off, cap), (st, bytes)) in chunk.iter().zip(got) {
                if let Some(n) = bytes {
                    fill.push((item, off, n.min(cap)));
                }
                answered[item] = Some(st);
            }
            // SAFETY: the caller's contract; the entries lie inside the slot (`need`).
            inflight[k] = Some(unsafe { queue(&mut slots[k], rts, items, fill, Direction::HostToDevice) });
        }
        for b in inflight.iter_mut().filter_map(Option::take) {
            b.settle(&mut out);
        }
        self.give_back(slots);
        result?;
        Ok(out
            .into_iter()
            .zip(answered)
            .map(|(o, a)| o.unwrap_or_else(|| Staged::Done(a.expect("every item is in one chunk"))))
            .collect())
    }
}

/// The buffer size every chunk fits in.
fn need(chunks: &[Chunk]) -> usize {
    chunks.iter().filter_map(|c| c.last().map(|&(_, off, len)| off + len)).max().unwrap_or(0)
}

#[cfg(test)]
mod tests;
