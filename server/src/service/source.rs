//! The value-source seam: how a put's value bytes arrive where [`stage`] placed them, and come
//! out hashed. One implementation per way bytes travel: the request's stream (QUIC, the Unix
//! control socket, the TCP bulk channel: all one [`RequestRecv`]), the copy engine (shared
//! memory), one-sided writes. A transport that moves bytes some other way (HIXL) is one more
//! here, and the put path itself does not change.
//!
//!
//! [`stage`]: super::put

use super::shared::Shared;
use super::shm::{copy, register, xfer, DataPath};
use super::staged::Staged;
use super::stream::{discard, expect_end, read_hashed_by, Fail, RequestRecv};
use crate::store::put::Landing;
use kvpool_proto::BufSlice;
use kvpool_transport::{Op, PeerId, RegionId, Transport, Xfer};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::time::Instant as Deadline;

/// Where a put's value bytes come from.
///
/// The put path calls [`begin`](ValueSource::begin) once the items are planned,
/// [`arrive`](ValueSource::arrive) for each item in order once it is placed (or skipped),
/// and [`settle`](ValueSource::settle) once every item has one. A stream moves each value as
/// it arrives; a batch source (a copy engine) notes where each goes and moves them all in
/// `settle`. Either way, an item's `sum` is the hash of its bytes as they landed, when the
/// source could take it.
pub(super) trait ValueSource: Send {
    /// The items are planned: until when DRAM space may be waited for (`space_by`, or earlier
    /// when the source's own deadline comes first).
    fn begin(&mut self, space_by: Deadline) -> Deadline {
        space_by
    }

    /// Items planned for SSD get a DRAM range too: the bytes must land in the segment (they are
    /// written there one-sidedly), and the block is demoted later.
    fn lands_in_dram(&self) -> bool {
        false
    }

    /// The next item is placed (or skipped).
    fn arrive(&mut self, staged: &mut Staged) -> impl Future<Output = Result<(), Fail>> + Send;

    /// Every item is placed: the bytes are all in when this returns.
    fn settle(&mut self, staged: Vec<Staged>) -> impl Future<Output = Result<Vec<Staged>, Fail>> + Send;
}

/// The values follow the request frame on its stream (QUIC, the Unix control socket, or the TCP
/// bulk channel), item by item: each goes straight from the stream where it was placed, hashed
/// piece by piece as it lands. Bytes of a skipped item are read and dropped.
pub(super) struct StreamSource<'a, R> {
    recv: &'a mut R,
    total: u64,
    /// The bytes must arrive at the minimum rate.
    bytes_by: Deadline,
    started: Instant,
    metrics: &'a crate::metrics::Metrics,
}

impl<'a, R: RequestRecv> StreamSource<'a, R> {
    pub fn new(recv: &'a mut R, total: u64, s: &'a Shared) -> Self {
        let bytes_by = Deadline::now() + s.timeouts.transfer(total);
        StreamSource { recv, total, bytes_by, started: Instant::now(), metrics: &s.metrics }
    }
}

impl<R: RequestRecv> ValueSource for StreamSource<'_, R> {
    fn begin(&mut self, space_by: Deadline) -> Deadline {
        self.started = Instant::now();
        space_by.min(self.bytes_by)
    }

    async fn arrive(&mut self, st: &mut Staged) -> Result<(), Fail> {
        match &mut st.placed {
            Err(_) => discard(self.recv, st.item.size, self.bytes_by).await,
            Ok(placed) => {
                // Straight from the stream into the segment (or the SSD buffer): no staging copy.
                let buf = placed.bytes_mut();
                placed.sum = Some(read_hashed_by(self.recv, buf, self.bytes_by, "the declared value bytes").await?);
                Ok(())
            }
        }
    }

    async fn settle(&mut self, staged: Vec<Staged>) -> Result<Vec<Staged>, Fail> {
        expect_end(self.recv, self.bytes_by).await?;
        self.metrics.transferred(self.recv.transport(), "in", self.total, self.started.elapsed());
        Ok(staged)
    }
}

/// The values are in the client's shared buffers (same host): the copy engine moves them all in
/// one batch, its threads hashing each block as it lands in server memory.
pub(super) struct ShmSource<'a> {
    dp: &'a DataPath,
    peer: PeerId,
    sources: std::vec::IntoIter<BufSlice>,
    xfers: Vec<Xfer>,
    /// SSD-bound buffers registered with the engine for this batch.
    temps: Vec<RegionId>,
    timeout: Duration,
    metrics: &'a crate::metrics::Metrics,
}

impl<'a> ShmSource<'a> {
    /// `sources`: one shared-buffer slice per item, in item order.
    pub fn new(
        dp: &'a DataPath,
        peer: PeerId,
        sources: Vec<BufSlice>,
        timeout: Duration,
        metrics: &'a crate::metrics::Metrics,
    ) -> Self {
        ShmSource { dp, peer, sources: sources.into_iter(), xfers: Vec::new(), temps: Vec::new(), timeout, metrics }
    }
}

impl Drop for ShmSource<'_> {
    /// Registrations of a put that failed before its batch was posted.
    fn drop(&mut self) {
        for r in self.temps.drain(..) {
            let _ = self.dp.transport.deregister(r);
        }
    }
}

impl ValueSource for ShmSource<'_> {
    async fn arrive(&mut self, st: &mut Staged) -> Result<(), Fail> {
        // The put checked there is one source per item.
        let Some(src) = self.sources.next() else { return Ok(()) };
        let size = st.item.size;
        let Ok(placed) = &mut st.placed else { return Ok(()) };
        match &mut placed.landing {
            Landing::Dram(blk) => self.xfers.push(xfer(self.dp.segment, blk.offset(), &src, size)),
            Landing::Ssd(v) => {
                let t: &dyn Transport = &*self.dp.transport;
                // SAFETY: the buffer is owned by the staged item, which `copy` holds until the
                // batch settled (and the registration is dropped then, or on our drop).
                let r = unsafe { register(t, v) }?;
                self.temps.push(r);
                self.xfers.push(xfer(r, 0, &src, size));
            }
        }
        Ok(())
    }

    async fn settle(&mut self, staged: Vec<Staged>) -> Result<Vec<Staged>, Fail> {
        let temps = std::mem::take(&mut self.temps);
        let (mut staged, sums) =
            copy(self.dp, self.peer, Op::Read, &self.xfers, staged, temps, self.timeout, self.metrics).await?;
        // The copy threads hashed each block as it landed in server memory: that is its checksum.
        let mut sums = (0..sums.len()).map(|i| sums.get(i));
        for placed in staged.iter_mut().filter_map(|st| st.placed.as_mut().ok()) {
            placed.sum = sums.next();
        }
        Ok(staged)
    }
}

/// One-sided: the values are written later, into the granted DRAM ranges, by `Write` requests
/// or a transport such as HIXL that writes into the segment directly. Nothing moves during the
/// put itself; the staged items wait in the session until `PutDone`, which hashes each block
/// when it commits it (no copy of ours saw the bytes land).
pub(super) struct Granted;

impl ValueSource for Granted {
    fn lands_in_dram(&self) -> bool {
        true
    }

    async fn arrive(&mut self, _: &mut Staged) -> Result<(), Fail> {
        Ok(())
    }

    async fn settle(&mut self, staged: Vec<Staged>) -> Result<Vec<Staged>, Fail> {
        Ok(staged)
    }
}
