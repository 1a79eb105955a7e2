//! Prefix chains: each block's resident children, the parent key of blocks whose parent is
//! not resident, chain depths, and the subtree the chain rule takes along with a victim.

use super::Index;
use crate::blocks::{Block, CopyHandle, Kids};
use crate::table::slot_of;
use kvpool_policy_sdk::{Pin, NO_DEPTH, NO_PARENT};
use std::sync::Arc;
use std::time::Instant;

impl<D: CopyHandle> Index<D> {
    /// The resident children of block `id` (whose record is `b`).
    pub(super) fn kids_of<'a>(&'a self, id: u64, b: &Block<D>) -> impl Iterator<Item = u64> + 'a {
        let (one, many) = match b.kids {
            Kids::NONE => (None, &[][..]),
            Kids::MANY => (None, self.many_kids.get(&id).map_or(&[][..], Vec::as_slice)),
            Kids(slot) => (self.blocks.id_at(slot), &[][..]),
        };
        one.into_iter().chain(many.iter().copied())
    }

    /// Add `child` (resident, or held for a block being published) to `parent`'s children.
    pub(super) fn add_kid(&mut self, parent: u64, child: u64) {
        let Some(kids) = self.blocks.get(parent).map(|p| p.kids) else { return };
        let kids = match kids {
            Kids::NONE => Kids(slot_of(child)),
            Kids::MANY => {
                self.many_kids.entry(parent).or_default().push(child);
                Kids::MANY
            }
            Kids(one) => {
                let one = self.blocks.id_at(one).expect("a resident child");
                self.many_kids.insert(parent, vec![one, child]);
                Kids::MANY
            }
        };
        self.blocks.get_mut(parent).expect("found above").kids = kids;
    }

    pub(super) fn remove_kid(&mut self, parent: u64, child: u64) {
        let Some(p) = self.blocks.get_mut(parent) else { return };
        match p.kids {
            Kids::MANY => {
                let Some(v) = self.many_kids.get_mut(&parent) else { return };
                v.retain(|&c| c != child);
                if let [one] = v[..] {
                    p.kids = Kids(slot_of(one));
                    self.many_kids.remove(&parent);
                }
            }
            Kids(one) if one == slot_of(child) => p.kids = Kids::NONE,
            _ => {}
        }
    }

    /// The children of block `id` (no longer indexed; its children still are), whose list was
    /// `kids`.
    pub(super) fn take_kids(&mut self, id: u64, kids: Kids) -> Vec<u64> {
        match kids {
            Kids::NONE => Vec::new(),
            Kids::MANY => self.many_kids.remove(&id).unwrap_or_default(),
            Kids(one) => self.blocks.id_at(one).into_iter().collect(),
        }
    }

    /// The parent key block `id` (whose record is `b`) was put under, if any.
    pub(super) fn parent_key(&self, id: u64, b: &Block<D>) -> Option<Arc<[u8]>> {
        match self.blocks.get(b.parent) {
            Some(p) => Some(self.blocks.key(p).into()),
            None => self.orphan_keys.get(&id).cloned(),
        }
    }

    /// The top of `id`'s chain: its furthest resident ancestor (`id` itself for a block with no
    /// resident parent). Walks at most as many links as there are blocks.
    pub(super) fn root_of(&self, id: u64) -> u64 {
        let mut cur = id;
        for _ in 0..=self.blocks.len() {
            match self.blocks.get(cur).map(|b| b.parent) {
                Some(p) if p != NO_PARENT && self.blocks.contains(p) => cur = p,
                _ => break,
            }
        }
        cur
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
            // Chains are trees (publication and recovery never link a loop); should one ever
            // not be, the victim stays rather than the walk going round for ever.
            if sub.len() > self.blocks.len() {
                return None;
            }
            let b = self.blocks.get(sub[i]).expect("resident");
            for c in self.kids_of(sub[i], b) {
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
