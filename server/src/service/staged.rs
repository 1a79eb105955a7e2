//! A put item between its plan and its commit, whatever carries its bytes: shared by the put
//! path (`put`), the value sources (`source`) and the session, where a
//! one-sided put's items wait between `PutIntent` and `PutDone`.

use crate::store::DramBlock;
use kvpool_proto::{ErrorCode, PutItem};

/// A put item on its way in: planned, given its room, and (once its bytes arrived) hashed.
pub(super) struct Staged {
    /// The item as the client declared it.
    pub item: PutItem,
    pub upsert: bool,
    pub room: Room,
    /// The xxh3-64 of the bytes as they landed, when the source hashed them; otherwise the
    /// commit hashes the block.
    pub sum: Option<u64>,
}

/// Where a staged item's bytes go.
pub(super) enum Room {
    /// Not stored: this is its answer (the source drops its bytes, if it has any).
    Skip(ErrorCode),
    /// The index id planned for it, and the DRAM range reserved for its bytes.
    Dram(u64, DramBlock),
    /// The index id planned for it, and the buffer its bytes wait in before the SSD write.
    Ssd(u64, Vec<u8>),
}

impl Room {
    /// The bytes the value fills; `None` when it is skipped.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            Room::Skip(_) => None,
            Room::Dram(_, b) => Some(b.bytes_mut()),
            Room::Ssd(_, v) => Some(v),
        }
    }
}
