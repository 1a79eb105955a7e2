//! A bounded set of remembered keys (a "ghost" list), oldest forgotten first: ARC's B1/B2 in
//! chain-experts, and the ghost admission filter.

use crate::hash::IdMap;
use std::collections::VecDeque;

#[derive(Debug, Default, Clone)]
pub(crate) struct Ghosts {
    keys: IdMap<u64, ()>,
    order: VecDeque<u64>,
}

impl Ghosts {
    /// Remember `key`, forgetting the oldest keys beyond `cap` (at least 1).
    pub(crate) fn put(&mut self, key: u64, cap: usize) {
        while self.keys.len() >= cap.max(1) {
            match self.order.pop_front() {
                Some(old) => {
                    self.keys.remove(&old);
                }
                None => break,
            }
        }
        if self.keys.insert(key, ()).is_none() {
            self.order.push_back(key);
        }
        // Keys taken back out leave stale entries behind: drop them once they dominate.
        if self.order.len() > 2 * self.keys.len() + 64 {
            let keys = &self.keys;
            self.order.retain(|k| keys.contains_key(k));
        }
    }

    /// Forget `key`; true when it was remembered.
    pub(crate) fn take(&mut self, key: u64) -> bool {
        self.keys.remove(&key).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}
