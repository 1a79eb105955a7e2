//! Removal: by key, by tenant, by pattern, and of blocks found corrupt.

use super::Store;
use kvpool_core::RemoveStatus;
use std::time::Instant;

impl Store {
    /// A block whose DRAM bytes failed their checksum on the way out: counted (for the server
    /// and its tenant) and removed, leased or not.
    pub fn drop_corrupt_key(&self, tenant: u32, key: &[u8]) {
        self.metrics.corrupt.inc();
        self.ix().note_corrupt(tenant);
        self.remove(tenant, &[key.to_vec()], true);
    }

    pub fn remove(&self, tenant: u32, keys: &[Vec<u8>], force: bool) -> Vec<RemoveStatus> {
        let mut ix = self.ix();
        let (status, dropped, meta) = ix.remove(tenant, keys, force, Instant::now());
        self.meta.enqueue(meta);
        drop(ix);
        self.release(dropped);
        status
    }

    /// Remove every block of the tenant; leased ones stay unless `force`. (removed, skipped)
    pub fn remove_all(&self, tenant: u32, force: bool) -> (u64, u64) {
        self.remove_matching(tenant, force, |_| true)
    }

    /// Remove the tenant's blocks whose key `matches`; leased ones stay unless `force`.
    /// (removed, skipped). One pass over the index under its lock.
    pub fn remove_matching(&self, tenant: u32, force: bool, matches: impl Fn(&[u8]) -> bool) -> (u64, u64) {
        let mut ix = self.ix();
        let (removed, skipped, dropped, meta) = ix.remove_all(tenant, force, Instant::now(), matches);
        self.meta.enqueue(meta);
        drop(ix);
        self.release(dropped);
        (removed, skipped)
    }
}
