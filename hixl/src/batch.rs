//! Grouping descriptors into HIXL descriptor lists.
//!
//! Each HIXL call carries one peer, one direction and a list of descriptors, and costs about the
//! same whether the list holds one small descriptor or dozens. So small descriptors (below
//! `merge_threshold`) of many posts to the same peer and op wait in one pending list and go out
//! together, up to `max_batch` per list; contiguous descriptors of one post become one; long ones
//! are split at `max_transfer` and sent in lists of their own so that small transfers never queue
//! behind them.

use crate::config::BatchPolicy;
use crate::ffi::RawDesc;
use std::collections::HashMap;
use std::time::Instant;

/// One descriptor of a job, tagged with the post it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub desc: RawDesc,
    pub xfer: u64,
}

/// One HIXL call's worth of work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub peer: u64,
    pub op: u32,
    pub pieces: Vec<Piece>,
    /// Resubmissions so far.
    pub attempts: u32,
    /// Not before this instant (backoff after a retryable failure).
    pub not_before: Option<Instant>,
}

impl Job {
    fn new(peer: u64, op: u32, pieces: Vec<Piece>) -> Job {
        Job { peer, op, pieces, attempts: 0, not_before: None }
    }
}

struct Pending {
    pieces: Vec<Piece>,
    since: Instant,
}

pub struct Batcher {
    policy: BatchPolicy,
    pending: HashMap<(u64, u32), Pending>,
}

/// Append `d` to `list`, extending the last piece instead when it belongs to the same post and
/// both sides are contiguous (and the result stays within `cap`). Returns whether a piece was
/// added.
fn push_coalesced(list: &mut Vec<Piece>, xfer: u64, d: RawDesc, cap: u64) -> bool {
    if let Some(last) = list.last_mut() {
        let l = &mut last.desc;
        if last.xfer == xfer
            && l.local_addr.checked_add(l.len) == Some(d.local_addr)
            && l.remote_addr.checked_add(l.len) == Some(d.remote_addr)
            && l.len.checked_add(d.len).is_some_and(|n| n <= cap)
        {
            l.len += d.len;
            return false;
        }
    }
    list.push(Piece { desc: d, xfer });
    true
}

impl Batcher {
    pub fn new(policy: BatchPolicy) -> Batcher {
        Batcher { policy, pending: HashMap::new() }
    }

    /// Take a post's descriptors. Jobs ready now are appended to `out`; small descriptors may
    /// stay pending. Returns how many pieces the post became (its completion count).
    pub fn add(&mut self, peer: u64, op: u32, xfer: u64, descs: &[RawDesc], now: Instant, out: &mut Vec<Job>) -> usize {
        let p = self.policy;
        let cap = p.max_transfer.unwrap_or(u64::MAX);
        // Coalesce the post's contiguous runs first (only when batching is on: off means the
        // descriptors go to HIXL as given, split only where they are too long).
        let mut runs: Vec<Piece> = Vec::with_capacity(descs.len());
        for &d in descs.iter().filter(|d| d.len > 0) {
            if p.merge {
                push_coalesced(&mut runs, xfer, d, u64::MAX);
            } else {
                runs.push(Piece { desc: d, xfer });
            }
        }
        let mut count = 0;
        let mut large: Vec<Piece> = Vec::new();
        for run in runs {
            let d = run.desc;
            if p.merge && d.len < p.merge_threshold && d.len <= cap {
                let list = self.pending.entry((peer, op)).or_insert_with(|| Pending { pieces: Vec::new(), since: now });
                if list.pieces.is_empty() {
                    list.since = now;
                }
                list.pieces.push(run);
                count += 1;
                if list.pieces.len() >= p.max_batch {
                    out.push(Job::new(peer, op, std::mem::take(&mut list.pieces)));
                }
                continue;
            }
            let mut off = 0;
            while off < d.len {
                let n = (d.len - off).min(cap);
                large.push(Piece {
                    desc: RawDesc { local_addr: d.local_addr + off, remote_addr: d.remote_addr + off, len: n },
                    xfer,
                });
                count += 1;
                off += n;
                if large.len() >= p.max_batch {
                    out.push(Job::new(peer, op, std::mem::take(&mut large)));
                }
            }
        }
        if !large.is_empty() {
            out.push(Job::new(peer, op, large));
        }
        count
    }

    /// Move pending lists whose linger has passed (all of them with `force`) to `out`.
    pub fn flush(&mut self, now: Instant, force: bool, out: &mut Vec<Job>) {
        let linger = self.policy.linger;
        for (&(peer, op), list) in self.pending.iter_mut() {
            if !list.pieces.is_empty() && (force || now.duration_since(list.since) >= linger) {
                out.push(Job::new(peer, op, std::mem::take(&mut list.pieces)));
            }
        }
        self.pending.retain(|_, l| !l.pieces.is_empty());
    }

    /// When the next pending list is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.pending.values().filter(|l| !l.pieces.is_empty()).map(|l| l.since + self.policy.linger).min()
    }

    /// Remove pending pieces matching `f`, returning them.
    pub fn take_where(&mut self, f: impl Fn(u64, &Piece) -> bool) -> Vec<Piece> {
        let mut taken = Vec::new();
        for (&(peer, _), list) in self.pending.iter_mut() {
            list.pieces.retain(|p| {
                if f(peer, p) {
                    taken.push(*p);
                    false
                } else {
                    true
                }
            });
        }
        self.pending.retain(|_, l| !l.pieces.is_empty());
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn policy(merge: bool, threshold: u64, max_batch: usize, max_transfer: Option<u64>) -> BatchPolicy {
        BatchPolicy { merge, merge_threshold: threshold, max_batch, max_transfer, linger: Duration::ZERO }
    }

    fn d(local: u64, remote: u64, len: u64) -> RawDesc {
        RawDesc { local_addr: local, remote_addr: remote, len }
    }

    #[test]
    fn small_descriptors_of_many_posts_share_lists_up_to_max_batch() {
        let mut b = Batcher::new(policy(true, 4096, 4, None));
        let now = Instant::now();
        let mut out = Vec::new();
        // Ten posts of one 100-byte descriptor each (not contiguous), same peer and op.
        for x in 0..10u64 {
            assert_eq!(b.add(1, 1, x, &[d(x * 1000, x * 2000, 100)], now, &mut out), 1);
        }
        // Two full lists went out at once; two descriptors wait.
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|j| j.pieces.len() == 4 && j.peer == 1 && j.op == 1));
        assert_eq!(out[0].pieces.iter().map(|p| p.xfer).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        b.flush(now, false, &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(out[2].pieces.len(), 2);
        assert_eq!(b.next_due(), None);
        // Another peer or op never shares a list.
        out.clear();
        b.add(1, 0, 50, &[d(0, 0, 10)], now, &mut out);
        b.add(2, 1, 51, &[d(0, 0, 10)], now, &mut out);
        b.flush(now, true, &mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn contiguous_descriptors_of_one_post_coalesce_and_long_ones_split() {
        let mut b = Batcher::new(policy(true, 4096, 64, Some(1 << 20)));
        let now = Instant::now();
        let mut out = Vec::new();
        // 16 contiguous 64-byte descriptors: one 1 KiB piece.
        let descs: Vec<RawDesc> = (0..16).map(|i| d(1000 + i * 64, 9000 + i * 64, 64)).collect();
        assert_eq!(b.add(7, 1, 1, &descs, now, &mut out), 1);
        // A 2.5 MiB descriptor: three pieces of at most 1 MiB in one list of their own.
        assert_eq!(b.add(7, 1, 2, &[d(1 << 30, 1 << 31, 5 << 19)], now, &mut out), 3);
        assert_eq!(out.len(), 1);
        let lens: Vec<u64> = out[0].pieces.iter().map(|p| p.desc.len).collect();
        assert_eq!(lens, vec![1 << 20, 1 << 20, 1 << 19]);
        assert_eq!(out[0].pieces[2].desc.local_addr, (1 << 30) + (2 << 20));
        b.flush(now, true, &mut out);
        assert_eq!(out[1].pieces, vec![Piece { desc: d(1000, 9000, 1024), xfer: 1 }]);
        // Descriptors of different posts never coalesce (each post settles on its own).
        out.clear();
        b.add(7, 1, 3, &[d(0, 0, 64)], now, &mut out);
        b.add(7, 1, 4, &[d(64, 64, 64)], now, &mut out);
        b.flush(now, true, &mut out);
        assert_eq!(out[0].pieces.len(), 2);
    }

    #[test]
    fn batching_off_sends_descriptors_as_given() {
        let mut b = Batcher::new(policy(false, 4096, 2, None));
        let now = Instant::now();
        let mut out = Vec::new();
        let descs: Vec<RawDesc> = (0..5).map(|i| d(i * 8, i * 8, 8)).collect();
        assert_eq!(b.add(1, 1, 1, &descs, now, &mut out), 5);
        assert_eq!(out.iter().map(|j| j.pieces.len()).collect::<Vec<_>>(), vec![2, 2, 1]);
        assert_eq!(b.next_due(), None);
        // Zero-length descriptors move nothing and are dropped.
        out.clear();
        assert_eq!(b.add(1, 1, 2, &[d(0, 0, 0)], now, &mut out), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn linger_holds_small_lists_and_take_where_removes_pieces() {
        let mut p = policy(true, 4096, 64, None);
        p.linger = Duration::from_millis(5);
        let mut b = Batcher::new(p);
        let t0 = Instant::now();
        let mut out = Vec::new();
        b.add(1, 1, 1, &[d(0, 0, 8)], t0, &mut out);
        b.add(1, 1, 2, &[d(100, 100, 8)], t0, &mut out);
        b.flush(t0, false, &mut out);
        assert!(out.is_empty());
        assert_eq!(b.next_due(), Some(t0 + Duration::from_millis(5)));
        let gone = b.take_where(|_, piece| piece.xfer == 1);
        assert_eq!(gone.len(), 1);
        b.flush(t0 + Duration::from_millis(5), false, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].pieces[0].xfer, 2);
    }
}
