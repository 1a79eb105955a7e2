//! Buffers a same-host server reads and writes directly, and the client's link to its shm socket.
//!
//! A [`Buffer`] is a sealed memfd mapped into this process. On a connection that uses the
//! same-host transport it is shared with the server when it is made (and again after a
//! reconnect), so that `put_from` and `get_into` move no bytes over any socket: the server copies
//! between its segment and the buffer. On any other connection the same calls send the bytes in
//! band over QUIC, so code written against buffers works everywhere.

use crate::error::{ClientError, Result};
use kvpool_transport::memfd::SharedBuffer;
use kvpool_transport::shm::ShmClient;
use kvpool_transport::RegionId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

pub(crate) struct BufferInner {
    pub(crate) id: u64,
    pub(crate) mem: SharedBuffer,
    /// The client that shares it; `None` once that client is gone.
    pub(crate) owner: Weak<Registry>,
}

/// Memory for zero-copy transfers with a same-host server (see the module docs).
pub struct Buffer {
    pub(crate) inner: Arc<BufferInner>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer").field("id", &self.inner.id).field("len", &self.len()).finish()
    }
}

impl Buffer {
    pub fn len(&self) -> usize {
        self.inner.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.mem.is_empty()
    }

    /// Start of the buffer in this process (for numpy or torch views, as Mooncake's
    /// `register_buffer` addresses).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.mem.as_ptr()
    }

    /// The bytes. A `get_into` writes into the buffer only while it runs.
    pub fn as_slice(&self) -> &[u8] {
        self.inner.mem.as_slice()
    }

    /// The bytes, to fill before a `put_from`.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as `inner`; `&mut self` excludes other borrows made
        // through this handle, and the client never touches the bytes itself outside a call.
        unsafe { std::slice::from_raw_parts_mut(self.inner.mem.as_ptr(), self.inner.mem.len()) }
    }

    /// Stop sharing the buffer with the server now (it is also unshared when dropped).
    /// Transfers already running on it finish; later ones that name it fail with a typed error.
    pub fn unshare(&self) {
        if let Some(reg) = self.inner.owner.upgrade() {
            reg.forget(self.inner.id);
        }
    }

    /// A part of the buffer, for a transfer.
    pub fn slice(&self, offset: usize, len: usize) -> Result<BufSlice<'_>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(BufSlice { buffer: self, offset, len }),
            _ => Err(ClientError::Config(format!("slice {offset}+{len} is outside a buffer of {} bytes", self.len()))),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Some(reg) = self.inner.owner.upgrade() {
            reg.forget(self.inner.id);
        }
    }
}

/// A part of a [`Buffer`]: where a value comes from or goes to.
#[derive(Debug, Clone, Copy)]
pub struct BufSlice<'a> {
    pub buffer: &'a Buffer,
    pub offset: usize,
    pub len: usize,
}

impl BufSlice<'_> {
    pub(crate) fn wire(&self) -> kvpool_proto::BufSlice {
        kvpool_proto::BufSlice { region: self.buffer.inner.id, offset: self.offset as u64, len: self.len as u64 }
    }

    /// The bytes (for the in-band path).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buffer.as_slice()[self.offset..self.offset + self.len]
    }

    /// The bytes, writable (for the in-band path, while a `get_into` runs).
    ///
    /// # Safety
    /// No other reference to these bytes may be in use during the call.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.buffer.as_ptr().add(self.offset), self.len)
    }
}

/// Buffers of one client, and its link to the server's shm socket when it has one.
#[derive(Default)]
pub(crate) struct Registry {
    buffers: Mutex<HashMap<u64, Weak<BufferInner>>>,
    link: Mutex<Option<ShmClient>>,
    next: std::sync::atomic::AtomicU64,
}

impl Registry {
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    pub(crate) fn linked(&self) -> bool {
        self.link.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Track a new buffer and share it with the server if linked.
    pub(crate) fn adopt(&self, b: &Arc<BufferInner>) -> Result<()> {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner()).insert(b.id, Arc::downgrade(b));
        if let Some(link) = self.link.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            link.add(&[(RegionId(b.id), &b.mem)]).map_err(|e| ClientError::Io(format!("sharing a buffer: {e}")))?;
        }
        Ok(())
    }

    fn forget(&self, id: u64) {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        if let Some(link) = self.link.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = link.remove(&[RegionId(id)]);
        }
    }

    /// A new link (after attach or reconnect): every live buffer is shared on it.
    pub(crate) fn relink(&self, link: Option<ShmClient>) -> Result<()> {
        let mut slot = self.link.lock().unwrap_or_else(|p| p.into_inner());
        *slot = None;
        let Some(link) = link else { return Ok(()) };
        let live: Vec<Arc<BufferInner>> =
            self.buffers.lock().unwrap_or_else(|p| p.into_inner()).values().filter_map(Weak::upgrade).collect();
        let regions: Vec<_> = live.iter().map(|b| (RegionId(b.id), &b.mem)).collect();
        link.add(&regions).map_err(|e| ClientError::Io(format!("sharing buffers: {e}")))?;
        *slot = Some(link);
        Ok(())
    }
}

impl crate::Client {
    /// A buffer for zero-copy transfers (a sealed memfd of `len` bytes, zero-filled). On a
    /// same-host connection the server reads and writes it directly.
    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        let reg = &self.inner.registry;
        let id = reg.next_id();
        let mem = SharedBuffer::new(len, "kvpool-buffer").map_err(|e| ClientError::Io(format!("memfd: {e}")))?;
        let inner = Arc::new(BufferInner { id, mem, owner: Arc::downgrade(reg) });
        reg.adopt(&inner)?;
        Ok(Buffer { inner })
    }

    /// The data path block bytes take on the current connection: `"shm"`, `"tls"` or `"tcp"`
    /// (the TCP bulk channel, once it has a connection open; small puts still go on QUIC), or
    /// `"quic"`.
    pub fn transport_in_use(&self) -> &'static str {
        if self.inner.registry.linked() {
            return "shm";
        }
        self.current().bulk.as_ref().and_then(|b| b.in_use()).unwrap_or("quic")
    }

    /// The path requests without bulk bytes take on the current connection: `"local"` (the
    /// server's same-host control socket) or `"quic"`.
    pub fn control_in_use(&self) -> &'static str {
        let s = self.current();
        if s.local.as_ref().is_some_and(|l| l.usable()) {
            "local"
        } else {
            "quic"
        }
    }

    /// Put blocks whose values are in buffers. Same-host: the server copies them from the
    /// buffers (no bytes cross a socket); otherwise they are sent over QUIC. One status per entry.
    pub async fn put_from_batch<K: AsRef<[u8]>>(
        &self,
        entries: &[(K, BufSlice<'_>, crate::PutOptions)],
        mode: kvpool_proto::PutMode,
    ) -> Result<Vec<kvpool_proto::ErrorCode>> {
        if let Some(cc) = self.cluster() {
            // Through a master the bytes go to the nodes over the network.
            let puts: Vec<crate::PutEntry<'_>> = entries
                .iter()
                .map(|(k, s, o)| crate::PutEntry { key: k.as_ref(), value: s.bytes(), opts: o.clone() })
                .collect();
            return cc.put_batch(&puts, mode, 1).await;
        }
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        for (_, slice, _) in entries {
            self.check_owned(slice.buffer)?;
        }
        if !self.inner.registry.linked() {
            let puts: Vec<crate::PutEntry<'_>> = entries
                .iter()
                .map(|(k, s, o)| crate::PutEntry { key: k.as_ref(), value: s.bytes(), opts: o.clone() })
                .collect();
            return self.put_batch_inband(&puts, mode).await;
        }
        self.put_from_wire(entries, mode).await
    }

    /// `PutFrom`: the server copies the values out of the shared buffers.
    async fn put_from_wire<K: AsRef<[u8]>>(
        &self,
        entries: &[(K, BufSlice<'_>, crate::PutOptions)],
        mode: kvpool_proto::PutMode,
    ) -> Result<Vec<kvpool_proto::ErrorCode>> {
        let items = self.put_items(entries.iter().map(|(k, s, o)| (k.as_ref(), s.len as u64, o)))?;
        let req = kvpool_proto::Request::PutFrom(kvpool_proto::PutFromRequest {
            mode,
            items,
            sources: entries.iter().map(|(_, s, _)| s.wire()).collect(),
        });
        match self.call(req).await? {
            kvpool_proto::Response::Put(l) if l.results.len() == entries.len() => Ok(l.results),
            other => Err(crate::unexpected("Put", &other)),
        }
    }

    /// Get blocks into buffers (`dests[i]` for `keys[i]`; its `len` is the room there).
    /// Same-host: the server copies them in; otherwise they come over QUIC. Checksums are
    /// verified in both cases.
    pub async fn get_into_batch<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        dests: &[BufSlice<'_>],
    ) -> Result<Vec<crate::GetIntoResult>> {
        if keys.len() != dests.len() {
            return Err(ClientError::Config(format!("{} keys but {} destinations", keys.len(), dests.len())));
        }
        if let Some(cc) = self.cluster() {
            // SAFETY: as below: distinct parts of buffers this call borrows, which nothing else
            // touches while it runs.
            let mut bufs: Vec<&mut [u8]> = dests.iter().map(|d| unsafe { d.bytes_mut() }).collect();
            return cc.get_batch_into(keys, &mut bufs).await;
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        for d in dests {
            self.check_owned(d.buffer)?;
        }
        if !self.inner.registry.linked() {
            // SAFETY: the destinations are distinct parts of buffers this call borrows; nothing
            // else reads or writes them while it runs.
            let mut bufs: Vec<&mut [u8]> = dests.iter().map(|d| unsafe { d.bytes_mut() }).collect();
            return self.get_batch_into_inband(keys, &mut bufs).await;
        }
        self.get_into_wire(keys, dests).await
    }

    /// `GetInto`: the server copies the values into the shared buffers and hashes them there;
    /// checksums are verified again here when `verify_shm_gets` is set.
    async fn get_into_wire<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        dests: &[BufSlice<'_>],
    ) -> Result<Vec<crate::GetIntoResult>> {
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        let req = kvpool_proto::Request::GetInto(kvpool_proto::GetIntoRequest {
            keys: keys.iter().map(|k| k.as_ref().to_vec()).collect(),
            dests: dests.iter().map(BufSlice::wire).collect(),
        });
        let items = match self.call(req).await? {
            kvpool_proto::Response::Filled(g) if g.items.len() == keys.len() => g.items,
            other => return Err(crate::unexpected("Filled", &other)),
        };
        let mut out = Vec::with_capacity(items.len());
        for ((item, d), k) in items.into_iter().zip(dests).zip(keys) {
            if item.status == kvpool_proto::ErrorCode::Ok {
                if item.size > d.len as u64 {
                    return Err(ClientError::Protocol("server filled more than the destination holds".into()));
                }
                if self.inner.cfg.verify_shm_gets {
                    crate::get::verify(k.as_ref(), item.checksum, &d.bytes()[..item.size as usize])?;
                }
            }
            out.push(crate::GetIntoResult { status: item.status, size: item.size, tier: item.tier, lease_ms: 0 });
        }
        Ok(out)
    }

    fn check_owned(&self, b: &Buffer) -> Result<()> {
        match b.inner.owner.upgrade() {
            Some(r) if Arc::ptr_eq(&r, &self.inner.registry) => Ok(()),
            _ => Err(ClientError::Config("the buffer belongs to another client".into())),
        }
    }
}

/// Most bytes one staged request carries; larger batches are split.
const STAGE_MAX: usize = 256 << 20;
/// Staging buffers kept for reuse, in bytes.
const STAGE_KEEP: usize = 512 << 20;

/// Shared buffers for calls that pass ordinary slices: on a same-host connection their bytes are
/// copied once into (or out of) a shared buffer, and the server does the rest; still no bytes
/// cross a socket.
#[derive(Default)]
pub(crate) struct Staging {
    pool: Mutex<Vec<Buffer>>,
}

impl Staging {
    fn take(&self, client: &crate::Client, len: usize) -> Result<Buffer> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = pool.iter().position(|b| b.len() >= len) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        client.alloc_buffer(len.max(1 << 20).next_power_of_two())
    }

    fn give_back(&self, b: Buffer) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = pool.iter().map(Buffer::len).sum();
        if held + b.len() <= STAGE_KEEP {
            pool.push(b);
        }
    }
}

impl crate::Client {
    /// `put_batch` on a same-host connection: values staged into shared buffers.
    pub(crate) async fn put_batch_staged(
        &self,
        entries: &[crate::PutEntry<'_>],
        mode: kvpool_proto::PutMode,
    ) -> Result<Vec<kvpool_proto::ErrorCode>> {
        let mut out = Vec::with_capacity(entries.len());
        for run in runs_of(entries.iter().map(|e| e.value.len())) {
            let part = &entries[run];
            let total: usize = part.iter().map(|e| e.value.len()).sum();
            let mut stage = self.inner.staging.take(self, total)?;
            let mut at = 0;
            for e in part {
                stage.as_mut_slice()[at..at + e.value.len()].copy_from_slice(e.value);
                at += e.value.len();
            }
            let mut at = 0;
            let mut slices = Vec::with_capacity(part.len());
            for e in part {
                slices.push((e.key, BufSlice { buffer: &stage, offset: at, len: e.value.len() }, e.opts.clone()));
                at += e.value.len();
            }
            let r = self.put_from_wire(&slices, mode).await;
            drop(slices);
            self.inner.staging.give_back(stage);
            out.extend(r?);
        }
        Ok(out)
    }

    /// `get_batch_into` on a same-host connection: values land in shared buffers, then are
    /// copied out.
    pub(crate) async fn get_batch_into_staged<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<crate::GetIntoResult>> {
        let mut out = Vec::with_capacity(keys.len());
        for run in runs_of(bufs.iter().map(|b| b.len())) {
            let total: usize = bufs[run.clone()].iter().map(|b| b.len()).sum();
            let stage = self.inner.staging.take(self, total)?;
            let mut at = 0;
            let mut dests = Vec::with_capacity(run.len());
            for b in &bufs[run.clone()] {
                dests.push(BufSlice { buffer: &stage, offset: at, len: b.len() });
                at += b.len();
            }
            let r = self.get_into_wire(&keys[run.clone()], &dests).await;
            if let Ok(items) = &r {
                for ((item, d), b) in items.iter().zip(&dests).zip(bufs[run.clone()].iter_mut()) {
                    if item.status == kvpool_proto::ErrorCode::Ok {
                        let n = item.size as usize;
                        b[..n].copy_from_slice(&d.bytes()[..n]);
                    }
                }
            }
            drop(dests);
            self.inner.staging.give_back(stage);
            out.extend(r?);
        }
        Ok(out)
    }
}

/// Split a batch into runs of at most `STAGE_MAX` bytes (an item larger than that is alone).
fn runs_of(sizes: impl Iterator<Item = usize>) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut n) = (0, 0, 0);
    for (i, size) in sizes.enumerate() {
        if i > start && bytes + size > STAGE_MAX {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += size;
        n = i + 1;
    }
    if n > start {
        out.push(start..n);
    }
    out
}
