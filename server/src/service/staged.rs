//! A put item between its plan and its commit, whatever carries its bytes: shared by the put
//! path (`put`), the value sources (`source`) and the session, where a one-sided put's items
//! wait between `PutIntent` and `PutDone`.

use crate::store::put::Placed;
use kvpool_proto::{ErrorCode, PutItem};

/// A put item on its way in: planned, and placed (or skipped, with its answer).
pub(super) struct Staged {
    /// The item as the client declared it.
    pub item: PutItem,
    /// Its plan and where its bytes land; `Err`: not stored, and this is its answer (the source
    /// drops its bytes, if it has any).
    pub placed: Result<Placed, ErrorCode>,
}
