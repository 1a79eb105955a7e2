//! The staged pipeline against the stand-in runtimes of kvpool-devmem, with a map standing in
//! for the server.

use super::*;
use kvpool_devmem::standin::{self, Counters, Fault, Standin};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::sync::{Mutex as StdMutex, MutexGuard};
use std::time::Duration;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: StdMutex<()> = StdMutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Page-aligned host memory, as the binding's shared buffers are.
struct HostMem {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: plain owned memory.
unsafe impl Send for HostMem {}

impl HostMem {
    fn new(len: usize) -> HostMem {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        HostMem { ptr, layout }
    }
    fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.layout.size());
        // SAFETY: inside the allocation; read only when no copy into it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.layout.size());
        // SAFETY: inside the allocation; written only when no copy out of it is in flight.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

impl StageMem for HostMem {
    fn base(&self) -> *mut u8 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.layout.size()
    }
}

fn setup(kind: Kind) -> (Runtimes, Standin) {
    let rt = Runtime::open(kind, standin::library(kind)).unwrap();
    let s = Standin::open(standin::library(kind)).unwrap();
    s.reset();
    let rts = match kind {
        Kind::Cuda => Runtimes::new(Some(rt), None),
        Kind::Acl => Runtimes::new(None, Some(rt)),
    };
    (rts, s)
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(7) ^ seed.wrapping_mul(131)) as u8).collect()
}

/// `n` items of three pieces: two in device memory at `dev` (apart), one in `host`.
fn items(n: usize, piece: usize, dev: usize, host: &HostMem, loc: Location) -> Vec<Vec<Piece>> {
    (0..n)
        .map(|i| {
            vec![
                Piece { ptr: dev + 2 * i * piece, len: piece, at: At::Device(loc) },
                Piece { ptr: host.ptr as usize + i * piece, len: piece, at: At::Host },
                Piece { ptr: dev + (2 * i + 1) * piece, len: piece, at: At::Device(loc) },
            ]
        })
        .collect()
}

type Store = HashMap<usize, Vec<u8>>;

fn send_into(store: &mut Store) -> Box<SendFn<'_, HostMem, &'static str, String>> {
    Box::new(move |m, entries| {
        for &(i, off, len) in entries {
            store.insert(i, m.slice(off, len).to_vec());
        }
        Ok(vec!["ok"; entries.len()])
    })
}

#[test]
fn chunks_hold_whole_items_within_the_size_and_count() {
    assert_eq!(plan(&[4, 4, 4], 8, 10), vec![vec![(0, 0, 4), (1, 4, 4)], vec![(2, 0, 4)]]);
    assert_eq!(plan(&[20, 1, 1], 8, 10), vec![vec![(0, 0, 20)], vec![(1, 0, 1), (2, 1, 1)]]);
    assert_eq!(plan(&[1, 1, 1], 8, 2), vec![vec![(0, 0, 1), (1, 1, 1)], vec![(2, 0, 1)]]);
    assert_eq!(plan(&[], 8, 2), Vec::<Chunk>::new());
    assert_eq!(need(&plan(&[20, 1, 1], 8, 10)), 20);
}

#[test]
fn device_items_round_trip_pipelined_with_delayed_copies() {
    let _s = serial();
    for kind in [Kind::Cuda, Kind::Acl] {
        let (rts, s) = setup(kind);
        let loc = Location { kind, device: 1 };
        let (n, piece) = (6, 4096);
        let (src, dst) = (s.alloc(1, 2 * n * piece).unwrap(), s.alloc(1, 2 * n * piece).unwrap());
        let dev_bytes = pattern(2 * n * piece, 1);
        s.write(src, &dev_bytes).unwrap();
        let host = HostMem::new(n * piece);
        host.write(0, &pattern(n * piece, 2));
        let put_items = items(n, piece, src, &host, loc);
        // Two items per chunk: three chunks, two device copies per item.
        let staging: Staging<HostMem> = Staging::new(2 * 3 * piece, 1 << 20);
        s.set_delay(Duration::from_millis(15));
        let mut store = Store::new();
        let mut sent = 0;
        let out = {
            let mut send = send_into(&mut store);
            let mut check = |m: &HostMem, e: &[(usize, usize, usize)]| {
                // When chunk `sent` goes out, the next chunk's copies are queued already.
                let queued = 4 * (sent + 2).min(3) as u64;
                assert_eq!(s.counters().d2h, queued, "{kind}: chunk {sent}");
                sent += 1;
                send(m, e)
            };
            // SAFETY: the host pieces and device memory outlive the call.
            unsafe { staging.put(&rts, &put_items, 64, &mut |len| Ok(HostMem::new(len)), &mut check) }.unwrap()
        };
        assert_eq!(out, vec![Staged::Done("ok"); n]);
        assert_eq!(sent, 3);
        for (i, item) in put_items.iter().enumerate() {
            let mut want = Vec::new();
            for p in item {
                want.extend_from_slice(match p.at {
                    At::Device(_) => &dev_bytes[p.ptr - src..p.ptr - src + p.len],
                    At::Host => host.slice(p.ptr - host.ptr as usize, p.len),
                });
            }
            assert!(store[&i] == want, "{kind}: item {i} was sent before its copies were done");
        }
        let c = s.counters();
        assert!(c.max_busy_streams >= 2, "{kind}: chunks were not in flight together: {c:?}");
        assert_eq!(c.unpinned_copies, 0, "{kind}: {c:?}");

        // Back into other device memory (and another host buffer).
        let host2 = HostMem::new(n * piece);
        let get_items = items(n, piece, dst, &host2, loc);
        let syncs = |c: Counters| c.event_syncs + c.stream_syncs;
        let before = syncs(s.counters());
        let mut chunk = 0;
        let mut recv = |m: &HostMem, e: &[(usize, usize, usize)]| -> Result<Vec<(&str, Option<usize>)>, String> {
            let c = s.counters();
            // Chunk i is received while chunk i-1's copies run: only chunks before that were
            // waited for (the one that used this buffer last).
            assert_eq!(syncs(c) - before, chunk.max(1) as u64 - 1, "{kind}: chunk {chunk}: {c:?}");
            if chunk == 1 {
                assert!(c.copies_done < c.copies_enqueued, "{kind}: chunk 0's copies were waited for: {c:?}");
            }
            chunk += 1;
            Ok(e.iter()
                .map(|&(i, off, _)| {
                    m.write(off, &store[&i]);
                    ("ok", Some(store[&i].len()))
                })
                .collect())
        };
        // SAFETY: as above; the pieces of the call do not overlap.
        let out = unsafe { staging.get(&rts, &get_items, 64, &mut |len| Ok(HostMem::new(len)), &mut recv) }.unwrap();
        assert_eq!(out, vec![Staged::Done("ok"); n]);
        let c = s.counters();
        assert_eq!(c.copies_done, c.copies_enqueued, "{kind}: returned with copies in flight");
        assert!(s.read(dst, 2 * n * piece).unwrap() == dev_bytes, "{kind}");
        assert!(host2.slice(0, n * piece) == host.slice(0, n * piece), "{kind}");
        // Both calls used the same two buffers, pinned once each.
        assert_eq!((c.host_registers, c.streams_created), (2, 2), "{kind}: {c:?}");
        drop(staging);
        let c = s.counters();
        assert_eq!((c.host_unregisters, c.streams_destroyed), (2, 2), "{kind}: {c:?}");
        s.free(src).unwrap();
        s.free(dst).unwrap();
    }
}

fn failing(fault: Fault) -> (Vec<Staged<&'static str>>, Counters) {
    let (rts, s) = setup(Kind::Cuda);
    let loc = Location { kind: Kind::Cuda, device: 0 };
    let (n, piece) = (4, 1024);
    let dev = s.alloc(0, 2 * n * piece).unwrap();
    let host = HostMem::new(n * piece);
    let staging: Staging<HostMem> = Staging::new(2 * 3 * piece, 1 << 20);
    let mut store = Store::new();
    s.fail(fault, 1);
    // SAFETY: the host pieces and device memory outlive the call.
    let out = unsafe {
        staging.put(
            &rts,
            &items(n, piece, dev, &host, loc),
            64,
            &mut |len| Ok(HostMem::new(len)),
            &mut send_into(&mut store),
        )
    }
    .unwrap();
    let c = s.counters();
    drop(staging);
    s.free(dev).unwrap();
    (out, c)
}

#[test]
fn a_failed_copy_fails_its_items_not_the_call() {
    let _s = serial();
    // Refused when queued: that item only.
    let (out, _) = failing(Fault::CopyCall);
    assert!(matches!(&out[0], Staged::Failed(DevmemError::Call { call: "cudaMemcpyAsync", .. })), "{out:?}");
    assert_eq!(&out[1..], &[Staged::Done("ok"), Staged::Done("ok"), Staged::Done("ok")]);
    // Failed while running: the event of its chunk reports it, for the chunk's items.
    let (out, c) = failing(Fault::CopyRun);
    assert_eq!(c.failed_copies, 1);
    for o in &out[..2] {
        assert!(matches!(o, Staged::Failed(DevmemError::Call { call: "cudaEventSynchronize", .. })), "{out:?}");
    }
    assert_eq!(&out[2..], &[Staged::Done("ok"), Staged::Done("ok")]);
}

#[test]
fn a_transport_error_ends_the_call_after_the_copies_in_flight() {
    let _s = serial();
    let (rts, s) = setup(Kind::Cuda);
    let loc = Location { kind: Kind::Cuda, device: 0 };
    let (n, piece) = (6, 1024);
    let dev = s.alloc(0, 2 * n * piece).unwrap();
    let host = HostMem::new(n * piece);
    let staging: Staging<HostMem> = Staging::new(2 * 3 * piece, 1 << 20);
    s.set_delay(Duration::from_millis(10));
    let calls = std::cell::Cell::new(0);
    let mut send = |_: &HostMem, _: &[(usize, usize, usize)]| -> Result<Vec<&str>, String> {
        calls.set(calls.get() + 1);
        Err("connection lost".into())
    };
    // SAFETY: the host pieces and device memory outlive the call.
    let r = unsafe {
        staging.put(&rts, &items(n, piece, dev, &host, loc), 64, &mut |len| Ok(HostMem::new(len)), &mut send)
    };
    assert_eq!(r, Err("connection lost".to_string()));
    assert_eq!(calls.get(), 1);
    let c = s.counters();
    // The second chunk was queued, and over before the call returned.
    assert_eq!((c.d2h, c.copies_done), (8, 8));
    // An allocation failure is the call's error too, with nothing queued.
    s.reset();
    let fresh: Staging<HostMem> = Staging::new(1024, 0);
    // SAFETY: as above.
    let r = unsafe {
        fresh.put(&rts, &items(1, piece, dev, &host, loc), 64, &mut |_| Err("no memory".to_string()), &mut send)
    };
    assert_eq!(r, Err("no memory".to_string()));
    assert_eq!(s.counters().d2h, 0);
    drop((staging, fresh));
    s.free(dev).unwrap();
}
