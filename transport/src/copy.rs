//! Transfers between host memory regions of one process, done by a small pool of copy threads.
//!
//! This is the server side of the same-host transport: its own ("local", in the transport's
//! terms) region is the DRAM segment, and a peer's regions are the client buffers imported by
//! [`crate::shm`]. It is also the reference implementation of [`Transport`] that the trait's
//! contract is tested against.

use crate::{
    check_bounds, Caps, MemKind, Op, PeerId, Region, RegionId, Transport, TransportError, Xfer, XferId, XferStatus,
};
use parking_lot::{Mutex, RwLock};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

/// Descriptors are split into pieces of at most this size so that one large block is copied by
/// several threads at once.
const PIECE: usize = 1 << 20;

type Keep = Arc<dyn Any + Send + Sync>;

#[derive(Clone)]
struct Entry {
    addr: usize,
    len: usize,
    /// Owner of the memory (an imported mapping): kept alive by every transfer that uses it.
    owner: Option<Keep>,
}

struct XferState {
    remaining: AtomicUsize,
    cancelled: AtomicBool,
    failed: Mutex<Option<TransportError>>,
    /// Signalled when the last piece is done (a waiter finds the permit if it comes late).
    done: Arc<tokio::sync::Notify>,
}

impl XferState {
    fn piece_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}

/// Batches of at most this many bytes are copied at once by the poster instead of the pool:
/// handing them to a thread costs more than the copy.
const INLINE: u64 = 256 << 10;

/// Bytes copied between two hashings of the destination: small enough that the bytes just
/// written are still in L1 when they are read back for the hash.
const HASH_CHUNK: usize = 32 << 10;

/// Per-descriptor xxh3-64 of the bytes a [`CopyEngine::post_hashed`] batch wrote, read
/// back from the destination right after each chunk was copied (so hashing costs no second
/// trip to memory). Valid once the batch has settled `Done`.
#[derive(Clone, Default)]
pub struct Digests(Arc<[AtomicU64]>);

impl Digests {
    fn new(n: usize) -> Digests {
        Digests((0..n).map(|_| AtomicU64::new(0)).collect())
    }

    /// The digest of descriptor `i` of the batch.
    pub fn get(&self, i: usize) -> u64 {
        self.0[i].load(Ordering::Acquire)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Copy `len` bytes from `src` to `dst` and return the xxh3-64 of the bytes as written.
///
/// # Safety
/// As for `copy_nonoverlapping`: both ranges valid, distinct memory.
unsafe fn copy_hashed(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    let mut done = 0;
    while done < len {
        let n = (len - done).min(HASH_CHUNK);
        // SAFETY: within the ranges the caller vouches for.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n);
            h.update(std::slice::from_raw_parts(dst.add(done), n));
        }
        done += n;
    }
    h.digest()
}

/// One piece of a batch: a copy, and where its digest goes when the batch is hashed.
struct Job {
    src: usize,
    dst: usize,
    len: usize,
    hash: Option<(Digests, usize)>,
    state: Arc<XferState>,
    _keep: Vec<Keep>,
}

impl Job {
    fn run(&self) {
        // SAFETY: both ranges were bounds-checked against registered regions at post time, the
        // owners of imported memory are held by the job, and the poster keeps its own regions
        // valid until the batch settles. Local and peer memory are distinct allocations, so
        // they never overlap.
        unsafe {
            match &self.hash {
                None => std::ptr::copy_nonoverlapping(self.src as *const u8, self.dst as *mut u8, self.len),
                Some((d, i)) => {
                    let sum = copy_hashed(self.src as *const u8, self.dst as *mut u8, self.len);
                    d.0[*i].store(sum, Ordering::Release);
                }
            }
        }
    }
}

#[derive(Default)]
struct Inner {
    local: RwLock<HashMap<u64, Entry>>,
    peers: RwLock<HashMap<u64, HashMap<u64, Entry>>>,
    xfers: Mutex<HashMap<u64, Arc<XferState>>>,
    next: AtomicU64,
}

/// An in-process copy engine implementing [`Transport`].
pub struct CopyEngine {
    inner: Arc<Inner>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CopyEngine {
    /// An engine with `threads` copy threads (at least one).
    pub fn new(threads: usize) -> CopyEngine {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("kvpool-copy-{i}"))
                    .spawn(move || loop {
                        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        if !job.state.cancelled.load(Ordering::Relaxed) {
                            job.run();
                        }
                        job.state.piece_done();
                    })
                    .expect("spawn copy thread")
            })
            .collect();
        CopyEngine { inner: Arc::new(Inner::default()), jobs: Mutex::new(Some(tx)), threads }
    }

    /// As [`Transport::post`], and also hash what is written: once the batch is `Done`,
    /// [`Digests::get`]`(i)` is the xxh3-64 of descriptor `i`'s bytes as they landed in the
    /// destination. A descriptor is then copied by one thread (its hash runs in order), so a
    /// batch with fewer descriptors than threads uses fewer threads than [`Transport::post`].
    pub fn post_hashed(&self, peer: PeerId, op: Op, batch: &[Xfer]) -> Result<(XferId, Digests), TransportError> {
        let digests = Digests::new(batch.len());
        let id = self.post_inner(peer, op, batch, Some(&digests))?;
        Ok((id, digests))
    }

    fn post_inner(
        &self,
        peer: PeerId,
        op: Op,
        batch: &[Xfer],
        hash: Option<&Digests>,
    ) -> Result<XferId, TransportError> {
        let mut pieces: Vec<Job> = Vec::new();
        let id = self.next();
        let state = Arc::new(XferState {
            remaining: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
            failed: Mutex::new(None),
            done: Arc::new(tokio::sync::Notify::new()),
        });
        {
            let local = self.inner.local.read();
            let peers = self.inner.peers.read();
            let remote = peers.get(&peer.0).ok_or(TransportError::UnknownPeer(peer))?;
            for (i, x) in batch.iter().enumerate() {
                let l = local.get(&x.local.0).ok_or(TransportError::UnknownRegion(x.local))?;
                let r = remote.get(&x.remote.0).ok_or(TransportError::UnknownRegion(x.remote))?;
                check_bounds(x.local_offset, x.len, l.len as u64)?;
                check_bounds(x.remote_offset, x.len, r.len as u64)?;
                let (la, ra) = (l.addr + x.local_offset as usize, r.addr + x.remote_offset as usize);
                let (src, dst) = match op {
                    Op::Read => (ra, la),
                    Op::Write => (la, ra),
                };
                let keep: Vec<Keep> = [&l.owner, &r.owner].into_iter().flatten().cloned().collect();
                let len = x.len as usize;
                if let Some(d) = hash {
                    let hash = Some((d.clone(), i));
                    pieces.push(Job { src, dst, len, hash, state: state.clone(), _keep: keep });
                    continue;
                }
                let mut done = 0usize;
                while done < len {
                    let n = (len - done).min(PIECE);
                    let (src, dst) = (src + done, dst + done);
                    pieces.push(Job { src, dst, len: n, hash: None, state: state.clone(), _keep: keep.clone() });
                    done += n;
                }
            }
        }
        let inline = pieces.iter().map(|p| p.len as u64).sum::<u64>() <= INLINE;
        if inline {
            self.inner.xfers.lock().insert(id, state);
            for job in &pieces {
                job.run();
            }
            return Ok(XferId(id));
        }
        state.remaining.store(pieces.len(), Ordering::Release);
        self.inner.xfers.lock().insert(id, state.clone());
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(|| TransportError::Io("transport is shut down".into()))?;
        for job in pieces {
            if tx.send(job).is_err() {
                // No thread will run it: fail the batch, and count the piece as done.
                *state.failed.lock() = Some(TransportError::Io("copy threads are gone".into()));
                state.piece_done();
            }
        }
        Ok(XferId(id))
    }

    fn next(&self) -> u64 {
        self.inner.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A new peer with no regions yet (a same-host client about to share its buffers).
    pub fn new_peer(&self) -> PeerId {
        let id = self.next();
        self.inner.peers.write().insert(id, HashMap::new());
        PeerId(id)
    }

    /// Add a region of a peer under the peer's own id for it, kept alive by `owner`.
    pub fn add_peer_region(
        &self,
        peer: PeerId,
        id: RegionId,
        addr: usize,
        len: usize,
        owner: Keep,
    ) -> Result<(), TransportError> {
        let mut peers = self.inner.peers.write();
        let regions = peers.get_mut(&peer.0).ok_or(TransportError::UnknownPeer(peer))?;
        regions.insert(id.0, Entry { addr, len, owner: Some(owner) });
        Ok(())
    }

    /// Drop a peer's region; transfers already posted keep its memory until they finish.
    pub fn remove_peer_region(&self, peer: PeerId, id: RegionId) -> Result<(), TransportError> {
        let mut peers = self.inner.peers.write();
        let regions = peers.get_mut(&peer.0).ok_or(TransportError::UnknownPeer(peer))?;
        regions.remove(&id.0).map(|_| ()).ok_or(TransportError::UnknownRegion(id))
    }

    /// Regions a peer has, with their lengths.
    pub fn peer_regions(&self, peer: PeerId) -> Vec<(RegionId, usize)> {
        self.inner
            .peers
            .read()
            .get(&peer.0)
            .map(|r| r.iter().map(|(&id, e)| (RegionId(id), e.len)).collect())
            .unwrap_or_default()
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.jobs.lock().take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Transport for CopyEngine {
    fn name(&self) -> &'static str {
        "copy"
    }

    fn caps(&self) -> Caps {
        Caps { device_memory: false, same_host_only: true }
    }

    unsafe fn register(&self, region: Region) -> Result<RegionId, TransportError> {
        if region.kind != MemKind::Host {
            return Err(TransportError::Unsupported("device"));
        }
        let id = self.next();
        self.inner.local.write().insert(id, Entry { addr: region.addr, len: region.len, owner: None });
        Ok(RegionId(id))
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        self.inner.local.write().remove(&id.0).map(|_| ()).ok_or(TransportError::UnknownRegion(id))
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        Err(TransportError::Unsupported("remote peers of an in-process"))
    }

    /// `metadata` is the 8-byte little-endian id of a peer made with [`CopyEngine::new_peer`].
    fn connect(&self, metadata: &[u8]) -> Result<PeerId, TransportError> {
        let id = <[u8; 8]>::try_from(metadata)
            .map(u64::from_le_bytes)
            .map_err(|_| TransportError::BadMetadata("expected an 8-byte peer id".into()))?;
        if self.inner.peers.read().contains_key(&id) {
            Ok(PeerId(id))
        } else {
            Err(TransportError::UnknownPeer(PeerId(id)))
        }
    }

    fn disconnect(&self, peer: PeerId) -> Result<(), TransportError> {
        self.inner.peers.write().remove(&peer.0).map(|_| ()).ok_or(TransportError::UnknownPeer(peer))
    }

    fn post(&self, peer: PeerId, op: Op, batch: &[Xfer]) -> Result<XferId, TransportError> {
        self.post_inner(peer, op, batch, None)
    }

    fn status(&self, xfer: XferId) -> Result<XferStatus, TransportError> {
        let mut xfers = self.inner.xfers.lock();
        let state = xfers.get(&xfer.0).ok_or(TransportError::UnknownXfer(xfer))?;
        if state.remaining.load(Ordering::Acquire) > 0 {
            return Ok(XferStatus::Pending);
        }
        let st = if let Some(e) = state.failed.lock().clone() {
            XferStatus::Failed(e)
        } else if state.cancelled.load(Ordering::Relaxed) {
            XferStatus::Failed(TransportError::Cancelled)
        } else {
            XferStatus::Done
        };
        xfers.remove(&xfer.0);
        Ok(st)
    }

    fn cancel(&self, xfer: XferId) {
        if let Some(s) = self.inner.xfers.lock().get(&xfer.0) {
            s.cancelled.store(true, Ordering::Relaxed);
        }
    }

    fn completion(&self, xfer: XferId) -> Option<Arc<tokio::sync::Notify>> {
        self.inner.xfers.lock().get(&xfer.0).map(|s| s.done.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn region(v: &mut [u8]) -> Region {
        Region { addr: v.as_mut_ptr() as usize, len: v.len(), kind: MemKind::Host }
    }

    #[tokio::test]
    async fn batches_move_bytes_both_ways_and_bounds_are_checked() {
        let t = CopyEngine::new(2);
        let mut seg = vec![0u8; 8 << 20];
        let mut client: Vec<u8> = (0..(3 << 20)).map(|i| (i % 251) as u8).collect();
        // SAFETY: both vectors outlive every transfer below (each is awaited).
        let seg_id = unsafe { t.register(region(&mut seg)) }.unwrap();
        let peer = t.new_peer();
        let owner: Keep = Arc::new(());
        t.add_peer_region(peer, RegionId(7), client.as_mut_ptr() as usize, client.len(), owner).unwrap();
        let peer = t.connect(&peer.0.to_le_bytes()).unwrap();
        // Pull 3 MiB (several pieces) from the client into the segment at 1 MiB.
        let x = Xfer { local: seg_id, local_offset: 1 << 20, remote: RegionId(7), remote_offset: 0, len: 3 << 20 };
        let id = t.post(peer, Op::Read, &[x]).unwrap();
        crate::wait(&t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&seg[1 << 20..4 << 20], &client[..]);
        assert!(matches!(t.status(id), Err(TransportError::UnknownXfer(_))), "reported once");
        // Push back a different range.
        seg[(1 << 20)..(1 << 20) + 10].copy_from_slice(b"0123456789");
        let x = Xfer { local: seg_id, local_offset: 1 << 20, remote: RegionId(7), remote_offset: 100, len: 10 };
        let id = t.post(peer, Op::Write, &[x]).unwrap();
        crate::wait(&t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&client[100..110], b"0123456789");
        // Out of bounds on either side, unknown regions and peers: refused before anything moves.
        let bad = Xfer { local: seg_id, local_offset: 0, remote: RegionId(7), remote_offset: 3 << 20, len: 1 };
        assert!(matches!(t.post(peer, Op::Write, &[bad]), Err(TransportError::OutOfBounds { .. })));
        let bad = Xfer { local: seg_id, local_offset: u64::MAX, remote: RegionId(7), remote_offset: 0, len: 2 };
        assert!(matches!(t.post(peer, Op::Write, &[bad]), Err(TransportError::OutOfBounds { .. })));
        let bad = Xfer { local: seg_id, local_offset: 0, remote: RegionId(8), remote_offset: 0, len: 1 };
        assert!(matches!(t.post(peer, Op::Write, &[bad]), Err(TransportError::UnknownRegion(RegionId(8)))));
        assert!(matches!(t.post(PeerId(999), Op::Write, &[]), Err(TransportError::UnknownPeer(_))));
        // A removed region cannot be named again.
        t.remove_peer_region(peer, RegionId(7)).unwrap();
        let x = Xfer { local: seg_id, local_offset: 0, remote: RegionId(7), remote_offset: 0, len: 1 };
        assert!(t.post(peer, Op::Write, &[x]).is_err());
        t.disconnect(peer).unwrap();
    }

    #[tokio::test]
    async fn hashed_batches_report_the_digest_of_each_descriptor() {
        let t = CopyEngine::new(2);
        let mut seg = vec![0u8; 16 << 20];
        let mut client: Vec<u8> = (0..(6 << 20)).map(|i| (i * 7 % 253) as u8).collect();
        // SAFETY: both vectors outlive every transfer below (each is awaited).
        let seg_id = unsafe { t.register(region(&mut seg)) }.unwrap();
        let peer = t.new_peer();
        t.add_peer_region(peer, RegionId(1), client.as_mut_ptr() as usize, client.len(), Arc::new(())).unwrap();
        let x = |lo: u64, ro: u64, len: u64| Xfer {
            local: seg_id,
            local_offset: lo,
            remote: RegionId(1),
            remote_offset: ro,
            len,
        };
        // Sizes across the chunk size, an empty one, and a batch big enough for the threads.
        let reads = [x(0, 0, 5 << 20), x(5 << 20, 100, (32 << 10) + 1), x(6 << 20, 7, 0), x(7 << 20, 3, 1000)];
        let (id, d) = t.post_hashed(peer, Op::Read, &reads).unwrap();
        crate::wait(&t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(d.len(), reads.len());
        for (i, r) in reads.iter().enumerate() {
            let got = &seg[r.local_offset as usize..(r.local_offset + r.len) as usize];
            assert_eq!(got, &client[r.remote_offset as usize..(r.remote_offset + r.len) as usize]);
            assert_eq!(d.get(i), xxhash_rust::xxh3::xxh3_64(got), "descriptor {i}");
        }
        // A small batch is copied inline, and hashed the same way, here from the segment out.
        seg[..64].copy_from_slice(&[9u8; 64]);
        let (id, d) = t.post_hashed(peer, Op::Write, &[x(0, 4096, 64)]).unwrap();
        crate::wait(&t, id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&client[4096..4160], &[9u8; 64]);
        assert_eq!(d.get(0), xxhash_rust::xxh3::xxh3_64(&[9u8; 64]));
        // Bounds are checked before anything moves, as for plain posts.
        assert!(matches!(t.post_hashed(peer, Op::Write, &[x(0, 6 << 20, 1)]), Err(TransportError::OutOfBounds { .. })));
    }

    #[test]
    fn device_memory_is_refused() {
        let t = CopyEngine::new(1);
        let r = Region { addr: 0x1000, len: 10, kind: MemKind::Device { device: 0 } };
        // SAFETY: refused before the memory could be used.
        assert_eq!(unsafe { t.register(r) }, Err(TransportError::Unsupported("device")));
    }
}
