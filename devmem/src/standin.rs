//! Test support: the stand-in runtimes this crate's build makes (`standin/*.c`) and their test
//! controls.
//!
//! Each stand-in exports its runtime's symbols over host memory ("device" memory is mapped
//! without access rights where the host sees it, so a host read of it crashes, as on a GPU) and
//! copies asynchronously on worker threads, optionally after a delay, so that a missing sync
//! shows up as stale bytes. [`Standin`] opens the same library a [`crate::Runtime`] was loaded
//! from (the dynamic loader hands back the same instance) to read its counters, inject faults,
//! and allocate, fill and read device memory.

use crate::error::{DevmemError, Result};
use crate::Kind;
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::time::Duration;

/// The stand-in library of `kind` this build made (an absolute path).
pub fn library(kind: Kind) -> &'static str {
    match kind {
        Kind::Cuda => env!("KVPOOL_DEVMEM_CUDA_STANDIN"),
        Kind::Acl => env!("KVPOOL_DEVMEM_ACL_STANDIN"),
    }
}

/// What the stand-in saw since it was loaded or last reset (`kvpool_devmem_standin_counters`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub copies_enqueued: u64,
    pub copies_done: u64,
    pub bytes: u64,
    pub h2d: u64,
    pub d2h: u64,
    pub stream_syncs: u64,
    pub event_records: u64,
    pub event_syncs: u64,
    pub host_registers: u64,
    pub host_unregisters: u64,
    /// Host registrations refused (unaligned for ACL, overlapping, injected).
    pub register_refused: u64,
    /// Copies whose host side was not registered (pinned) memory.
    pub unpinned_copies: u64,
    pub failed_copies: u64,
    pub streams_created: u64,
    pub streams_destroyed: u64,
    pub set_device: u64,
    /// Most streams with queued work at one moment: 2 or more means copies of two streams were
    /// in flight together.
    pub max_busy_streams: u64,
}

/// A fault to inject (`kvpool_devmem_standin_fail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The next copy calls return an error at once.
    CopyCall = 0,
    /// The next copies fail while running; the next fence of their stream reports it.
    CopyRun = 1,
    /// The next host registrations fail.
    HostRegister = 2,
}

type Code = c_int;

/// The test controls of a loaded stand-in, and its allocation and sync-copy functions.
pub struct Standin {
    kind: Kind,
    counters_get: unsafe extern "C" fn(*mut Counters),
    reset: unsafe extern "C" fn(),
    set_delay_us: unsafe extern "C" fn(u32),
    fail: unsafe extern "C" fn(u32, u32),
    set_device: unsafe extern "C" fn(c_int) -> Code,
    malloc: Malloc,
    free: unsafe extern "C" fn(*mut c_void) -> Code,
    memcpy: Memcpy,
    _lib: Library,
}

enum Malloc {
    Cuda(unsafe extern "C" fn(*mut *mut c_void, usize) -> Code),
    Acl(unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> Code),
}

enum Memcpy {
    Cuda(unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> Code),
    Acl(unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int) -> Code),
}

impl Standin {
    /// Open the stand-in at `path`; refused for a library that is not one.
    pub fn open(path: &str) -> Result<Standin> {
        let load = |reason: String| DevmemError::Load { runtime: Kind::Cuda, library: path.to_string(), reason };
        // SAFETY: a stand-in's only initialiser reads two environment variables.
        let lib = unsafe { Library::new(path) }.map_err(|e| load(e.to_string()))?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the types are those of standin/core.c and the runtime headers; the
                // pointers stay valid while `lib` is held, which `Standin` owns.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) };
                *s.map_err(|_| load(format!("not a kvpool-devmem stand-in: no {}", $name)))?
            }};
        }
        let backend: unsafe extern "C" fn() -> *const c_char = sym!("kvpool_devmem_standin_backend");
        // SAFETY: returns a static NUL-terminated string.
        let kind = match unsafe { CStr::from_ptr(backend()) }.to_bytes() {
            b"cuda" => Kind::Cuda,
            _ => Kind::Acl,
        };
        let (set_device, malloc, free, memcpy) = match kind {
            Kind::Cuda => (
                sym!("cudaSetDevice"),
                Malloc::Cuda(sym!("cudaMalloc")),
                sym!("cudaFree"),
                Memcpy::Cuda(sym!("cudaMemcpy")),
            ),
            Kind::Acl => (
                sym!("aclrtSetDevice"),
                Malloc::Acl(sym!("aclrtMalloc")),
                sym!("aclrtFree"),
                Memcpy::Acl(sym!("aclrtMemcpy")),
            ),
        };
        Ok(Standin {
            kind,
            counters_get: sym!("kvpool_devmem_standin_counters_get"),
            reset: sym!("kvpool_devmem_standin_reset"),
            set_delay_us: sym!("kvpool_devmem_standin_set_delay_us"),
            fail: sym!("kvpool_devmem_standin_fail"),
            set_device,
            malloc,
            free,
            memcpy,
            _lib: lib,
        })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    fn check(&self, call: &'static str, code: Code) -> Result<()> {
        match code {
            0 => Ok(()),
            code => Err(DevmemError::Call { runtime: self.kind, call, code, message: "stand-in".into() }),
        }
    }

    pub fn counters(&self) -> Counters {
        let mut c = Counters::default();
        // SAFETY: `c` has the layout of kvpool_devmem_standin_counters.
        unsafe { (self.counters_get)(&mut c) };
        c
    }

    /// Zero the counters and clear injected faults; the delay goes back to the environment's.
    pub fn reset(&self) {
        // SAFETY: no arguments.
        unsafe { (self.reset)() }
    }

    /// Each copy waits this long before it runs.
    pub fn set_delay(&self, d: Duration) {
        // SAFETY: plain value argument.
        unsafe { (self.set_delay_us)(d.as_micros().min(u32::MAX as u128) as u32) }
    }

    pub fn fail(&self, fault: Fault, count: u32) {
        // SAFETY: plain value arguments.
        unsafe { (self.fail)(fault as u32, count) }
    }

    /// `len` bytes of device memory on `device` (that device becomes this thread's current one).
    pub fn alloc(&self, device: i32, len: usize) -> Result<usize> {
        // SAFETY: plain value argument.
        self.check("set device", unsafe { (self.set_device)(device) })?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let code = match self.malloc {
            // SAFETY: `p` is writable.
            Malloc::Cuda(f) => unsafe { f(&mut p, len) },
            // SAFETY: `p` is writable; policy 0 is ACL_MEM_MALLOC_HUGE_FIRST.
            Malloc::Acl(f) => unsafe { f(&mut p, len, 0) },
        };
        self.check("malloc", code)?;
        Ok(p as usize)
    }

    pub fn free(&self, ptr: usize) -> Result<()> {
        // SAFETY: the stand-in checks that `ptr` is one of its allocations.
        self.check("free", unsafe { (self.free)(ptr as *mut c_void) })
    }

    /// Write `data` at the device address `ptr` (synchronously).
    pub fn write(&self, ptr: usize, data: &[u8]) -> Result<()> {
        let (dst, src, n) = (ptr as *mut c_void, data.as_ptr().cast::<c_void>(), data.len());
        let code = match self.memcpy {
            // SAFETY: `data` is readable for its length; the stand-in checks the device range.
            Memcpy::Cuda(f) => unsafe { f(dst, src, n, 1) },
            // SAFETY: as above.
            Memcpy::Acl(f) => unsafe { f(dst, n, src, n, 1) },
        };
        self.check("memcpy to the device", code)
    }

    /// `len` bytes read from the device address `ptr` (synchronously).
    pub fn read(&self, ptr: usize, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        let (dst, src) = (out.as_mut_ptr().cast::<c_void>(), ptr as *const c_void);
        let code = match self.memcpy {
            // SAFETY: `out` is writable for `len` bytes; the stand-in checks the device range.
            Memcpy::Cuda(f) => unsafe { f(dst, src, len, 2) },
            // SAFETY: as above.
            Memcpy::Acl(f) => unsafe { f(dst, len, src, len, 2) },
        };
        self.check("memcpy from the device", code)?;
        Ok(out)
    }
}
