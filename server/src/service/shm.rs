//! The copy engine for same-host clients: the DRAM segment is its own region, the client's
//! attached shared buffers its peer's. Puts (`PutFrom`) and gets (`GetInto`) post one batch of
//! copies each through [`copy`].

use super::session::Session;
use super::stream::{error, invalid, unsupported, Fail};
use kvpool_proto::{BufSlice, ErrorCode};
use kvpool_transport::copy::Digests;
use kvpool_transport::{MemKind, Op, Region, RegionId, Transport, Xfer};
use std::sync::Arc;
use std::time::Duration;

/// The copy engine for same-host clients: the DRAM segment is its own region.
pub struct DataPath {
    pub transport: Arc<kvpool_transport::copy::CopyEngine>,
    pub segment: RegionId,
    /// The Unix socket same-host clients attach their buffers through; `None` when disabled.
    pub shm: Option<kvpool_transport::shm::ShmServer>,
    /// The same-host control channel (requests over a Unix socket); `None` when disabled.
    pub local: Option<super::control::LocalControl>,
}

/// The data path and this connection's attached peer, or why shm cannot be used.
pub(super) fn shm_peer<'a>(
    session: &Session,
    data_path: Option<&'a DataPath>,
) -> Result<(&'a DataPath, kvpool_transport::PeerId), Fail> {
    let dp = data_path.filter(|d| d.shm.is_some()).ok_or_else(|| unsupported("no shared-memory transport"))?;
    let peer = session
        .shm_peer()
        .ok_or_else(|| unsupported("no shared buffers attached on this connection (ShmAttach first)"))?;
    Ok((dp, peer))
}

/// Register a heap buffer with the engine for one transfer.
///
/// # Safety
/// The buffer must stay where it is, unfreed, until the registration is dropped: its owner
/// outlives the transfer ([`copy`] holds it until the batch settled) and deregisters it then.
pub(super) unsafe fn register(t: &dyn Transport, v: &[u8]) -> Result<RegionId, Fail> {
    // SAFETY: as the caller promised.
    unsafe { t.register(Region { addr: v.as_ptr() as usize, len: v.len(), kind: MemKind::Host }) }
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))
}

/// A copy between `ours` (at `offset`) and a client's buffer slice `theirs`.
pub(super) fn xfer(ours: RegionId, offset: u64, theirs: &BufSlice, len: u64) -> Xfer {
    Xfer { local: ours, local_offset: offset, remote: RegionId(theirs.region), remote_offset: theirs.offset, len }
}

/// Post one batch and wait for it in a task that owns `held` (the memory the batch touches), so
/// that a cancelled request can never free that memory under a running copy. The temporary
/// registrations `temps` are dropped once the batch settled. Returns the xxh3-64 of each
/// descriptor's bytes as written, which the copy threads compute while the bytes are in cache.
#[allow(clippy::too_many_arguments)]
pub(super) async fn copy<H: Send + 'static>(
    dp: &DataPath,
    peer: kvpool_transport::PeerId,
    op: Op,
    xfers: &[Xfer],
    held: H,
    temps: Vec<RegionId>,
    timeout: Duration,
    metrics: &crate::metrics::Metrics,
) -> Result<(H, Digests), Fail> {
    let t = dp.transport.clone();
    let started = std::time::Instant::now();
    let bytes: u64 = xfers.iter().map(|x| x.len).sum();
    let direction = if op == Op::Read { "in" } else { "out" };
    let unregister = |t: &kvpool_transport::copy::CopyEngine, temps: &[RegionId]| {
        for &r in temps {
            let _ = t.deregister(r);
        }
    };
    if xfers.is_empty() {
        unregister(&t, &temps);
        return Ok((held, Digests::default()));
    }
    let (id, sums) = match t.post_hashed(peer, op, xfers) {
        Ok(x) => x,
        Err(e) => {
            unregister(&t, &temps);
            return Err(invalid(format!("transfer refused: {e}")));
        }
    };
    // Small batches are copied during the post: nothing to wait for.
    if let Ok(kvpool_transport::XferStatus::Done) = t.status(id) {
        unregister(&t, &temps);
        metrics.transferred("shm", direction, bytes, started.elapsed());
        return Ok((held, sums));
    }
    let task = tokio::spawn(async move {
        let r = kvpool_transport::wait(&*t, id, timeout).await;
        unregister(&t, &temps);
        (r, held)
    });
    match task.await {
        Ok((Ok(()), held)) => {
            metrics.transferred("shm", direction, bytes, started.elapsed());
            Ok((held, sums))
        }
        Ok((Err(kvpool_transport::TransportError::Timeout(_)), _)) => {
            Err(Fail::Reply(error(ErrorCode::Timeout, "the copy did not finish in time")))
        }
        Ok((Err(e), _)) => Err(Fail::Reply(error(ErrorCode::Internal, format!("copy failed: {e}")))),
        Err(e) => Err(Fail::Reply(error(ErrorCode::Internal, format!("copy task failed: {e}")))),
    }
}
