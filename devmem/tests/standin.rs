//! kvpool-devmem against the stand-in runtimes (`standin/`): classification, asynchronous copies
//! that are only there after their fence, per-stream ordering, host registration, typed errors.
//! This tests our side of the CUDA and ACL ABIs, not CUDA or ACL.

use kvpool_devmem::standin::{self, Fault, Standin};
use kvpool_devmem::{DevmemError, Direction, Kind, Location, Memory, Runtime, Runtimes};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The stand-ins' state is per process: tests that count or inject take turns.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn open(kind: Kind) -> (Runtime, Standin) {
    let path = standin::library(kind);
    let rt = Runtime::open(kind, path).unwrap();
    let s = Standin::open(path).unwrap();
    s.reset();
    (rt, s)
}

/// Page-aligned host memory (ACL registers only 4 KiB-aligned addresses).
struct HostBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl HostBuf {
    fn new(len: usize) -> HostBuf {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        HostBuf { ptr, layout }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: allocated and zeroed for the layout's size. Read only after the copies that
        // write it were waited for, or to show that they were not.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn device_memory_is_told_from_host_memory() {
    let _s = serial();
    for kind in [Kind::Cuda, Kind::Acl] {
        let (rt, s) = open(kind);
        let dev = s.alloc(1, 1 << 16).unwrap();
        assert_eq!(rt.classify(dev).unwrap(), Memory::Device(1), "{kind}");
        assert_eq!(rt.classify(dev + 100).unwrap(), Memory::Device(1));
        assert_eq!(rt.classify_range(dev, 1 << 16).unwrap(), Memory::Device(1));
        let heap = vec![0u8; 4096];
        assert_eq!(rt.classify_range(heap.as_ptr() as usize, heap.len()).unwrap(), Memory::Unregistered);
        // One end on the device, the other past its end: refused, naming both.
        let e = rt.classify_range(dev, (1 << 16) + 1).unwrap_err();
        assert!(e.to_string().contains("starts in device 1 memory"), "{e}");
        // Pinned host memory is the runtime's host memory.
        let host = HostBuf::new(8192);
        // SAFETY: `host` outlives the registration.
        let pin = unsafe { rt.pin(host.ptr, 8192, 0) }.unwrap();
        assert_eq!(rt.classify_range(host.ptr as usize, 8192).unwrap(), Memory::Host);
        assert_eq!(s.counters().host_registers, 1);
        drop(pin);
        assert_eq!(s.counters().host_unregisters, 1);
        assert_eq!(rt.classify(host.ptr as usize).unwrap(), Memory::Unregistered);
        s.free(dev).unwrap();
        assert_eq!(rt.classify(dev).unwrap(), Memory::Unregistered);
    }
}

#[test]
fn copies_are_there_only_after_their_fence() {
    let _s = serial();
    for kind in [Kind::Cuda, Kind::Acl] {
        let (rt, s) = open(kind);
        let n = 1 << 16;
        let dev = s.alloc(0, n).unwrap();
        let data = pattern(n, 7);
        s.write(dev, &data).unwrap();
        let stream = rt.stream(0).unwrap();
        assert_eq!(stream.location(), Location { kind, device: 0 });
        let host = HostBuf::new(n);
        s.set_delay(Duration::from_millis(150));
        let t = Instant::now();
        // SAFETY: `host` is not touched until the fence was waited for (the stale read below
        // races a copy that is still sleeping: the point of the test).
        unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap();
        assert!(t.elapsed() < Duration::from_millis(100), "the copy call waited for the copy");
        assert!(host.bytes().iter().all(|&b| b == 0), "{kind}: bytes arrived before any sync");
        stream.fence().unwrap().wait().unwrap();
        assert!(host.bytes() == &data[..], "{kind}");
        // And back: a host-to-device copy is not on the device before its fence either.
        let back = pattern(n, 99);
        // SAFETY: `back` outlives the fence below and is not written meanwhile.
        unsafe { stream.copy(Direction::HostToDevice, dev, back.as_ptr().cast_mut(), n) }.unwrap();
        assert!(s.read(dev, n).unwrap() == data, "{kind}: the device changed before any sync");
        stream.fence().unwrap().wait().unwrap();
        assert!(s.read(dev, n).unwrap() == back, "{kind}");
        let c = s.counters();
        assert_eq!((c.d2h, c.h2d, c.copies_done, c.bytes), (1, 1, 2, 2 * n as u64));
        // Neither side was pinned.
        assert_eq!(c.unpinned_copies, 2);
        if kind == Kind::Cuda {
            assert_eq!((c.event_records, c.event_syncs), (2, 2));
        } else {
            assert_eq!(c.stream_syncs, 2);
        }
        drop(stream);
        s.free(dev).unwrap();
    }
}

#[test]
fn a_stream_keeps_order_and_fences_of_two_streams_are_independent() {
    let _s = serial();
    for kind in [Kind::Cuda, Kind::Acl] {
        let (rt, s) = open(kind);
        let n = 4096;
        let (dev, other) = (s.alloc(0, n).unwrap(), s.alloc(0, n).unwrap());
        let (a, b) = (rt.stream(0).unwrap(), rt.stream(0).unwrap());
        let host = HostBuf::new(n);
        // SAFETY: `host` is pinned while registered and outlives the guard.
        let _pin = unsafe { rt.pin(host.ptr, n, 0) }.unwrap();
        let first = pattern(n, 1);
        let out = HostBuf::new(n);
        s.set_delay(Duration::from_millis(40));
        // Write then read back on one stream: the read sees the write (in order).
        // SAFETY: both host buffers outlive the fence and are not touched before it.
        unsafe {
            a.copy(Direction::HostToDevice, dev, first.as_ptr().cast_mut(), n).unwrap();
            a.copy(Direction::DeviceToHost, dev, out.ptr, n).unwrap();
        }
        // A second stream busy at the same time, elsewhere on the device.
        // SAFETY: `host` is read by the device only; nobody writes it.
        unsafe { b.copy(Direction::HostToDevice, other, host.ptr, n) }.unwrap();
        let fa = a.fence().unwrap();
        fa.wait().unwrap();
        assert!(out.bytes() == &first[..], "{kind}: read before the write of the same stream");
        b.synchronize().unwrap();
        let c = s.counters();
        assert!(c.max_busy_streams >= 2, "{kind}: {c:?}");
        // `first` and `out` were not pinned, `host` was.
        assert_eq!(c.unpinned_copies, 2, "{kind}: {c:?}");
        s.free(dev).unwrap();
        s.free(other).unwrap();
    }
}

#[test]
fn failures_are_typed_and_name_the_call() {
    let _s = serial();
    let (rt, s) = open(Kind::Cuda);
    let n = 4096;
    let dev = s.alloc(0, n).unwrap();
    let host = HostBuf::new(n);
    let stream = rt.stream(0).unwrap();
    s.fail(Fault::CopyCall, 1);
    // SAFETY: `host` outlives every fence below.
    let e = unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap_err();
    assert!(
        matches!(&e, DevmemError::Call { call: "cudaMemcpyAsync", code: 1, message, .. } if message == "invalid argument"),
        "{e}"
    );
    s.fail(Fault::CopyRun, 1);
    // SAFETY: as above.
    unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap();
    let e = stream.fence().unwrap().wait().unwrap_err();
    assert!(matches!(&e, DevmemError::Call { call: "cudaEventSynchronize", code: 700, .. }), "{e}");
    assert!(e.to_string().contains("illegal memory access"), "{e}");
    // Reported once: the stream goes on.
    // SAFETY: as above.
    unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap();
    stream.fence().unwrap().wait().unwrap();
    // A host address handed as the device side is refused by the runtime, not read.
    // SAFETY: as above.
    let e = unsafe { stream.copy(Direction::DeviceToHost, host.ptr as usize, host.ptr, n) }.unwrap_err();
    assert!(matches!(e, DevmemError::Call { call: "cudaMemcpyAsync", .. }), "{e}");
    let e = rt.stream(7).err().expect("no device 7");
    assert!(matches!(&e, DevmemError::Call { call: "cudaSetDevice", code: 101, .. }), "{e}");
    s.fail(Fault::HostRegister, 1);
    // SAFETY: `host` outlives the attempt.
    let e = unsafe { rt.pin(host.ptr, n, 0) }.err().expect("injected");
    assert!(matches!(e, DevmemError::Call { call: "cudaHostRegister", .. }), "{e}");
    drop(stream);
    s.free(dev).unwrap();

    let (acl, s) = open(Kind::Acl);
    let dev = s.alloc(1, n).unwrap();
    let stream = acl.stream(1).unwrap();
    s.fail(Fault::CopyRun, 1);
    // SAFETY: `host` outlives the fence.
    unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap();
    let e = stream.fence().unwrap().wait().unwrap_err();
    assert!(matches!(&e, DevmemError::Call { call: "aclrtSynchronizeStream", code: 507015, .. }), "{e}");
    // ACL registers 4 KiB-aligned host memory only; refused before any call.
    // SAFETY: inside `host`, which outlives the attempt.
    let e = unsafe { acl.pin(host.ptr.wrapping_add(8), 64, 1) }.err().expect("unaligned");
    assert!(matches!(e, DevmemError::Refused { runtime: Kind::Acl, .. }) && e.to_string().contains("4 KiB"), "{e}");
    drop(stream);
    s.free(dev).unwrap();
}

#[test]
fn acl_calls_work_from_a_thread_without_a_context() {
    let _s = serial();
    let (rt, s) = open(Kind::Acl);
    let n = 8192;
    let dev = s.alloc(1, n).unwrap();
    let data = pattern(n, 3);
    s.write(dev, &data).unwrap();
    // A fresh thread has no ACL context; the stand-in refuses streams and copies there, as ACL.
    let got = std::thread::spawn(move || {
        let stream = rt.stream(1).unwrap();
        let host = HostBuf::new(n);
        // SAFETY: `host` is pinned until `pin` drops, after the fence.
        let pin = unsafe { rt.pin(host.ptr, n, 1) }.unwrap();
        // SAFETY: `host` outlives the fence and is read only after it.
        unsafe { stream.copy(Direction::DeviceToHost, dev, host.ptr, n) }.unwrap();
        stream.fence().unwrap().wait().unwrap();
        drop(pin);
        host.bytes().to_vec()
    })
    .join()
    .unwrap();
    assert!(got == data);
    let c = s.counters();
    assert_eq!((c.unpinned_copies, c.host_registers, c.host_unregisters), (0, 1, 1));
    s.free(dev).unwrap();
}

#[test]
fn the_environment_chooses_the_runtimes() {
    let _s = serial();
    let set = |k: Kind, v: Option<&str>| match v {
        // SAFETY (edition 2021: safe fn): the other tests of this file do not read these.
        Some(v) => std::env::set_var(k.env_var(), v),
        None => std::env::remove_var(k.env_var()),
    };
    set(Kind::Cuda, Some(standin::library(Kind::Cuda)));
    set(Kind::Acl, Some("off"));
    let r = Runtimes::from_env().unwrap();
    assert_eq!(r.iter().map(Runtime::kind).collect::<Vec<_>>(), vec![Kind::Cuda]);
    assert_eq!(r.get(Kind::Cuda).unwrap().library(), standin::library(Kind::Cuda));
    set(Kind::Acl, Some("/nonexistent/libascendcl.so"));
    let e = Runtimes::from_env().unwrap_err();
    assert!(matches!(&e, DevmemError::Load { runtime: Kind::Acl, .. }), "{e}");
    // A library that is not that runtime.
    set(Kind::Acl, Some(standin::library(Kind::Cuda)));
    let e = Runtimes::from_env().unwrap_err();
    assert!(matches!(&e, DevmemError::MissingSymbol { symbol: "aclrtPointerGetAttributes", .. }), "{e}");
    // Unset: only what this process loaded already; it loaded the CUDA stand-in, but under its
    // path, not as libcudart, so neither runtime is found.
    set(Kind::Cuda, None);
    set(Kind::Acl, None);
    assert!(Runtimes::from_env().unwrap().is_empty());
}
