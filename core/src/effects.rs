//! What must happen outside the core, returned as data: copies to free and metadata to write.

use crate::blocks::BlockRecord;

/// Copies that left the index: the caller frees the DRAM copy (by dropping it) and releases and
/// deletes the SSD copy (locator, size), outside any lock.
#[derive(Debug)]
pub struct Dropped<D> {
    pub dram: Option<D>,
    pub ssd: Option<(u64, u64)>,
}

/// A change to the persisted metadata, to be applied in the order the index produced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaOp {
    Put { tenant: u32, key: Box<[u8]>, record: BlockRecord },
    Remove { tenant: u32, key: Box<[u8]> },
}
