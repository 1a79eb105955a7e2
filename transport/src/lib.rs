//! One-sided, batched, asynchronous transfers between registered memory regions: the seam where
//! shared memory, HIXL (Ascend) and other data paths plug into kvpool.
//!
//! The shape follows HIXL's `hixl::Hixl` and NVIDIA NIXL's agent API (see
//! `shared/design/hixl.md`): register memory once ([`Transport::register`]), exchange opaque
//! metadata with a peer ([`Transport::local_metadata`], [`Transport::connect`]), post a batch of
//! (local region, remote region, offset, length) descriptors for one peer and one direction
//! ([`Transport::post`]), poll ([`Transport::status`]) or await ([`wait`]) its completion, and
//! cancel it on timeout ([`Transport::cancel`]).
//!
//! As with HIXL, the caller keeps every region a transfer touches valid until that transfer has
//! settled (completed, failed, or cancelled and reported as such): the transport never frees or
//! reuses memory itself.
//!
//! Backends here: [`copy::CopyEngine`], an engine of copy threads between host regions of
//! one process (the server side of the same-host transport, and a stand-in in tests), and
//! [`shm`], which imports a client's memfd-backed buffers into it over a Unix socket.

pub mod copy;
pub mod memfd;
pub mod shm;

use std::time::Duration;

/// A registered region of this agent (local) or of a connected peer (remote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// A posted transfer batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct XferId(pub u64);

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Host,
    /// Accelerator memory (HBM); only backends with `Caps::device_memory` accept it.
    Device {
        device: u32,
    },
}

/// Memory to register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub addr: usize,
    pub len: usize,
    pub kind: MemKind,
}

/// Direction of a batch, seen from the local side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Remote memory into local memory.
    Read,
    /// Local memory into remote memory.
    Write,
}

/// One descriptor of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Xfer {
    pub local: RegionId,
    pub local_offset: u64,
    pub remote: RegionId,
    pub remote_offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    Pending,
    Done,
    Failed(TransportError),
}

/// What a backend can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Registers accelerator memory.
    pub device_memory: bool,
    /// Peers must be on this host.
    pub same_host_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("unknown region {0:?}")]
    UnknownRegion(RegionId),
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    #[error("unknown transfer {0:?} (finished transfers are reported once, then forgotten)")]
    UnknownXfer(XferId),
    #[error("descriptor out of bounds: offset {offset} + {len} bytes in a region of {region_len}")]
    OutOfBounds { offset: u64, len: u64, region_len: u64 },
    #[error("{0} memory is not supported by this transport")]
    Unsupported(&'static str),
    #[error("peer metadata not accepted: {0}")]
    BadMetadata(String),
    #[error("transfer cancelled")]
    Cancelled,
    #[error("transfer did not complete within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Io(String),
}

/// A data path between this agent's registered memory and its peers'.
pub trait Transport: Send + Sync {
    fn name(&self) -> &'static str;
    fn caps(&self) -> Caps;

    /// Register memory for transfers.
    ///
    /// # Safety
    /// `region` must stay valid memory, readable and writable, until it is deregistered and no
    /// transfer that names it is still pending.
    unsafe fn register(&self, region: Region) -> Result<RegionId, TransportError>;

    fn deregister(&self, id: RegionId) -> Result<(), TransportError>;

    /// Opaque bytes a peer needs to reach this agent.
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError>;

    /// Connect to the peer that `metadata` describes.
    fn connect(&self, metadata: &[u8]) -> Result<PeerId, TransportError>;

    /// Forget a peer; its regions are released once no transfer uses them.
    fn disconnect(&self, peer: PeerId) -> Result<(), TransportError>;

    /// Post a batch to one peer in one direction; every descriptor is checked before anything
    /// moves.
    fn post(&self, peer: PeerId, op: Op, batch: &[Xfer]) -> Result<XferId, TransportError>;

    /// State of a batch. A batch reported `Done` or `Failed` is forgotten afterwards.
    fn status(&self, xfer: XferId) -> Result<XferStatus, TransportError>;

    /// Stop a batch: descriptors not started are skipped; the batch reports `Failed(Cancelled)`
    /// once the ones already running have finished.
    fn cancel(&self, xfer: XferId);

    /// A signal raised when the batch settles, for backends that can give one ([`wait`] polls
    /// the others).
    fn completion(&self, _xfer: XferId) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }
}

/// Await a batch, polling with backoff; on timeout it is cancelled, and this returns once it
/// has settled (so the caller may then release the memory).
pub async fn wait(t: &dyn Transport, xfer: XferId, timeout: Duration) -> Result<(), TransportError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = Duration::from_micros(50);
    let mut cancelled = false;
    let signal = t.completion(xfer);
    loop {
        match t.status(xfer)? {
            XferStatus::Done => return if cancelled { Err(TransportError::Timeout(timeout)) } else { Ok(()) },
            XferStatus::Failed(TransportError::Cancelled) if cancelled => return Err(TransportError::Timeout(timeout)),
            XferStatus::Failed(e) => return Err(e),
            XferStatus::Pending => {}
        }
        if !cancelled && tokio::time::Instant::now() >= deadline {
            t.cancel(xfer);
            cancelled = true;
        }
        match &signal {
            // The signal keeps a permit when it fires before this wait begins.
            Some(n) if !cancelled => {
                let _ = tokio::time::timeout_at(deadline, n.notified()).await;
            }
            _ => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }
}

/// Check that `offset .. offset + len` lies in a region of `region_len` bytes.
pub(crate) fn check_bounds(offset: u64, len: u64, region_len: u64) -> Result<(), TransportError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds { offset, len, region_len }),
    }
}
