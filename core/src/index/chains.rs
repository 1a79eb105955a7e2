//! Prefix chains: each block's resident children, the parent key of blocks whose parent is
//! not resident, chain depths, and the subtree the chain rule takes along with a victim.

use super::Index;
use crate::blocks::{Block, CopyHandle, Kids};
use kvpool_policy_sdk::{Pin, NO_DEPTH};
use std::sync::Arc;
use std::time::Instant;

impl<D: CopyHandle> Index<D> {
    /// The resident children of `b`.
    pub(super) fn kids_of<'a>(&'a self, b: &'a Block<D>) -> &'a [u64] {
        match b.kids {
            Kids::NONE => &[],
            Kids::MANY => self.many_kids.get(&b.id).map_or(&[], Vec::as_slice),
            _ => std::slice::from_ref(&b.kids.0),
        }
    }

    pub(super) fn add_kid(&mut self, parent: u64, child: u64) {
        let p = self.blocks.get_mut(parent).expect("an indexed parent");
        match p.kids {
            Kids::NONE => p.kids = Kids(child),
            Kids::MANY => self.many_kids.entry(parent).or_default().push(child),
            Kids(one) => {
                p.kids = Kids::MANY;
                self.many_kids.insert(parent, vec![one, child]);
            }
        }
    }

    pub(super) fn remove_kid(&mut self, parent: u64, child: u64) {
        let Some(p) = self.blocks.get_mut(parent) else { return };
        match p.kids {
            Kids::MANY => {
                let Some(v) = self.many_kids.get_mut(&parent) else { return };
                v.retain(|&c| c != child);
                if let [one] = v[..] {
                    p.kids = Kids(one);
                    self.many_kids.remove(&parent);
                }
            }
            Kids(one) if one == child => p.kids = Kids::NONE,
            _ => {}
        }
    }

    /// The children of block `id` (no longer indexed), whose list was `kids`.
    pub(super) fn take_kids(&mut self, id: u64, kids: Kids) -> Vec<u64> {
        match kids {
            Kids::NONE => Vec::new(),
            Kids::MANY => self.many_kids.remove(&id).unwrap_or_default(),
            Kids(one) => vec![one],
        }
    }

    /// The parent key `b` was put under, if any.
    pub(super) fn parent_key(&self, b: &Block<D>) -> Option<Arc<[u8]>> {
        match self.blocks.get(b.parent) {
            Some(p) => Some(self.blocks.key(p).into()),
            None => self.orphan_keys.get(&b.id).cloned(),
        }
    }

    /// Depth of a block whose parent is `parent` (a resident id or none) and whose parent key
    /// is `parent_key`.
    pub(super) fn depth_under(&self, parent: u64, parent_key: Option<&[u8]>) -> u32 {
        match (parent_key, self.blocks.get(parent)) {
            (None, _) => 0,
            (Some(_), Some(p)) if p.depth != NO_DEPTH => p.depth + 1,
            _ => NO_DEPTH,
        }
    }

    /// Resident descendants of `id` in pre-order (`id` first), or `None` when one of them is
    /// leased, in flight or hard-pinned (the chain rule then keeps `id`).
    pub(super) fn free_subtree(&self, id: u64, now: Instant) -> Option<Vec<u64>> {
        let mut sub = vec![id];
        let mut i = 0;
        while i < sub.len() {
            let b = self.blocks.get(sub[i]).expect("resident");
            for &c in self.kids_of(b) {
                let cb = self.blocks.get(c)?;
                if self.is_leased(c, now) || cb.moving || cb.pin == Pin::Hard {
                    return None;
                }
                sub.push(c);
            }
            i += 1;
        }
        Some(sub)
    }
}
