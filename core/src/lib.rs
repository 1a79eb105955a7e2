//! kvpool's core with no I/O: the block index of a pool node (keys, prefix chains, leases, pins,
//! copies per tier, per-tenant counters) and its policy slots.
//!
//! Nothing here touches a socket, a file, sled or the clock: time is passed in, copies are
//! opaque handles, and whatever must happen outside (free a copy, delete a file, write a sled
//! record) comes back as data ([`Dropped`], [`MetaOp`]). The index is what policies are shown
//! through the SDK's [`IndexView`](kvpool_policy_sdk::IndexView), the one view the core's
//! eviction slot and the Wasm host's guard share. The server wraps an [`Index`] and
//! [`Policies`] in two locks, so that reads never wait on a policy call; [`Pool`] drives both
//! in one thread, the way the benchmark's replay and the unit tests do.

#![forbid(unsafe_code)]

mod blocks;
mod changes;
mod effects;
mod index;
mod policies;
mod pool;
mod put;
mod table;
#[cfg(test)]
mod tests;

pub use blocks::{BlockRecord, CopyHandle, MAX_KEY_LEN};
pub use changes::{Change, ChangeBatch, ChangeKind, ChangeLog, ChangeRef, ChangeWindow};
pub use effects::{Dropped, MetaOp};
pub use index::evict::{Demoted, Evicted};
pub use index::put::{Commit, Pending, PinRequest, Planned, PutPlan, PutRefusal, PutSpec};
pub use index::recover::Recovered;
pub use index::{Granularity, Index, Located, RemoveStatus, TenantCounters, DEFAULT_MISS_MEMORY};
pub use policies::{Admitter, Evictor, Native, NewSlot, Placer, Policies};
pub use pool::Pool;
pub use put::{placed_tiers, placement_batch, plan_put, PutDecision, PutSides};
