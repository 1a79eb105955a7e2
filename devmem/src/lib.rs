//! Device memory for kvpool's client: the CUDA runtime and Ascend ACL, loaded at run time.
//!
//! Engines (vLLM, SGLang) hand kvpool the addresses of their KV caches, which live on a GPU or an
//! NPU. This crate tells such addresses apart from host memory (`cudaPointerGetAttributes`,
//! `aclrtPointerGetAttributes`) and moves bytes between them and host memory asynchronously
//! (streams, `cudaMemcpyAsync`/`aclrtMemcpyAsync`, events or stream syncs), and page-locks host
//! buffers (`cudaHostRegister`, `aclrtHostRegister`) so those copies are DMA, not staged again by
//! the driver.
//!
//! Nothing is linked at build time: each runtime is a shared library opened with libloading
//! ([`Runtimes::from_env`]) and kvpool builds and runs where neither exists. By default a runtime
//! is used only when the process has loaded it already (torch or torch_npu did), so a host-only
//! process never creates a device context through kvpool; `KVPOOL_CUDA_RUNTIME` /
//! `KVPOOL_ACL_RUNTIME` name a library to load (a path or a file name), `auto` to load the usual
//! names, or `off`.
//!
//! The declarations are in the modules `cuda` and `acl`, whose docs name the public headers they
//! were checked against. **None of this has run against a real GPU or NPU here**: the tests run
//! against the stand-in libraries of the same ABI that `build.rs` builds ([`standin`]), which
//! copy host memory asynchronously on worker threads so that missing synchronisation shows up as
//! stale bytes.
//!
//! Every call that takes a device makes it current on the calling thread first and puts the
//! previous one back afterwards (`OnDevice`), so callers on any thread (the Python binding runs on
//! the caller's thread with the GIL released) neither need nor disturb the thread's device.

mod acl;
mod cuda;
mod error;
pub mod standin;

pub use acl::HOST_REGISTER_ALIGN as ACL_HOST_REGISTER_ALIGN;
pub use error::{DevmemError, Result};

use libloading::Library;
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

/// A device runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// NVIDIA's CUDA runtime (`libcudart`).
    Cuda,
    /// Huawei's Ascend ACL runtime (`libascendcl`, `libacl_rt` in newer CANN).
    Acl,
}

impl Kind {
    /// `cuda` or `acl`, as in [`Location`]'s text.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Cuda => "cuda",
            Kind::Acl => "acl",
        }
    }

    /// The environment variable that names this runtime's library.
    pub fn env_var(self) -> &'static str {
        match self {
            Kind::Cuda => "KVPOOL_CUDA_RUNTIME",
            Kind::Acl => "KVPOOL_ACL_RUNTIME",
        }
    }

    /// The file names the runtime is known by, most generic first.
    pub fn library_names(self) -> &'static [&'static str] {
        match self {
            Kind::Cuda => &["libcudart.so", "libcudart.so.13", "libcudart.so.12"],
            Kind::Acl => &["libascendcl.so", "libacl_rt.so"],
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Cuda => "CUDA",
            Kind::Acl => "ACL",
        })
    }
}

/// A device of a runtime; shown as `cuda:0`, `acl:1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    pub kind: Kind,
    pub device: i32,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind.name(), self.device)
    }
}

/// What a runtime says an address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Not the runtime's: ordinary host memory, or nothing at all (the runtime cannot tell).
    Unregistered,
    /// Host memory the runtime allocated or registered (pinned): readable from the host.
    Host,
    /// Managed (unified) memory: readable from the host.
    Managed,
    /// Memory of this device: never readable from the host.
    Device(i32),
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Unregistered => f.write_str("unregistered"),
            Memory::Host => f.write_str("pinned host"),
            Memory::Managed => f.write_str("managed"),
            Memory::Device(d) => write!(f, "device {d}"),
        }
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    DeviceToHost,
    HostToDevice,
}

enum Api {
    Cuda(cuda::Cuda),
    Acl(acl::Acl),
}

/// A loaded runtime; cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    api: Arc<Api>,
    path: Arc<str>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} runtime ({})", self.kind(), self.path)
    }
}

impl Runtime {
    /// Load `library` (a path, or a file name searched on the library path) as `kind`.
    pub fn open(kind: Kind, library: &str) -> Result<Runtime> {
        // SAFETY: loading runs the library's initialisers; the CUDA runtime, ACL and the stand-ins
        // have none that depend on the loading thread.
        let lib = unsafe { Library::new(library) }.map_err(|e| DevmemError::Load {
            runtime: kind,
            library: library.to_string(),
            reason: e.to_string(),
        })?;
        Self::from_library(kind, lib, library)
    }

    /// The runtime if this process has loaded it already (under one of its usual names).
    pub fn already_loaded(kind: Kind) -> Option<Runtime> {
        for name in kind.library_names() {
            let flags = libc::RTLD_NOLOAD | libc::RTLD_LAZY;
            // SAFETY: RTLD_NOLOAD loads nothing new: the library, if present, was initialised when
            // the process loaded it.
            let Ok(lib) = (unsafe { libloading::os::unix::Library::open(Some(name), flags) }) else { continue };
            match Self::from_library(kind, lib.into(), name) {
                Ok(rt) => return Some(rt),
                Err(e) => tracing::debug!("{e}"),
            }
        }
        None
    }

    fn from_library(kind: Kind, lib: Library, path: &str) -> Result<Runtime> {
        let api = match kind {
            Kind::Cuda => Api::Cuda(cuda::Cuda::new(lib, path)?),
            Kind::Acl => Api::Acl(acl::Acl::new(lib, path)?),
        };
        Ok(Runtime { api: Arc::new(api), path: path.into() })
    }

    pub fn kind(&self) -> Kind {
        match *self.api {
            Api::Cuda(_) => Kind::Cuda,
            Api::Acl(_) => Kind::Acl,
        }
    }

    /// The library this runtime was loaded from, as given.
    pub fn library(&self) -> &str {
        &self.path
    }

    /// What the runtime says `ptr` is. The address is looked up, never read.
    pub fn classify(&self, ptr: usize) -> Result<Memory> {
        Ok(match &*self.api {
            Api::Cuda(c) => {
                let a = c.attributes(ptr)?;
                match a.kind {
                    1 => Memory::Host,
                    2 => Memory::Device(a.device),
                    3 => Memory::Managed,
                    _ => Memory::Unregistered,
                }
            }
            Api::Acl(c) => {
                let a = c.attributes(ptr)?;
                match a.location_type {
                    acl::LOCATION_HOST => Memory::Host,
                    acl::LOCATION_DEVICE => Memory::Device(a.location_id as i32),
                    acl::LOCATION_MANAGED => Memory::Managed,
                    _ => Memory::Unregistered,
                }
            }
        })
    }

    /// What `[ptr, ptr + len)` is, from its first and last byte: `Device(d)` when both are on
    /// device `d`, `Host` when both are pinned or managed host memory, `Unregistered` when
    /// neither end is device memory (the caller checks such memory itself). A range with one end
    /// on a device and the other elsewhere is refused. Bytes between the ends are not asked
    /// about: a range over two adjacent device allocations passes here and fails in the copy.
    pub fn classify_range(&self, ptr: usize, len: usize) -> Result<Memory> {
        let first = self.classify(ptr)?;
        let last = if len > 1 { self.classify(ptr.saturating_add(len - 1))? } else { first };
        let host = |m: Memory| matches!(m, Memory::Host | Memory::Managed);
        match (first, last) {
            (Memory::Device(a), Memory::Device(b)) if a == b => Ok(first),
            (Memory::Device(_), _) | (_, Memory::Device(_)) => Err(DevmemError::Refused {
                runtime: self.kind(),
                what: format!("{ptr:#x}+{len} starts in {first} memory and ends in {last} memory"),
            }),
            (a, b) if host(a) && host(b) => Ok(Memory::Host),
            _ => Ok(Memory::Unregistered),
        }
    }

    /// Make `device` current on this thread until the guard is dropped.
    fn on_device(&self, device: i32) -> Result<OnDevice<'_>> {
        let restore = match &*self.api {
            Api::Cuda(c) => {
                let current = c.current_device()?;
                if current == device {
                    None
                } else {
                    c.set_device(device)?;
                    Some(current)
                }
            }
            Api::Acl(c) => match c.current_device() {
                Some(d) if d == device => None,
                Some(d) => {
                    c.set_device(device)?;
                    Some(d)
                }
                // A thread without a context keeps the one made for it: ACL needs one for every
                // later call of this thread anyway.
                None => {
                    c.set_device(device)?;
                    None
                }
            },
        };
        Ok(OnDevice { rt: self, restore })
    }

    /// A new non-blocking stream of `device`, owned by the caller.
    pub fn stream(&self, device: i32) -> Result<Stream> {
        let _on = self.on_device(device)?;
        let raw = match &*self.api {
            Api::Cuda(c) => c.stream_create()?,
            Api::Acl(c) => c.stream_create()?,
        };
        Ok(Stream { inner: Arc::new(StreamInner { rt: self.clone(), device, raw }) })
    }

    /// Page-lock `[ptr, ptr + len)` for fast asynchronous copies with `device` (CUDA registers it
    /// for every device); undone when the guard drops. ACL needs `ptr` 4 KiB aligned.
    ///
    /// # Safety
    /// The range is host memory that stays mapped until the returned guard is dropped.
    pub unsafe fn pin(&self, ptr: *mut u8, len: usize, device: i32) -> Result<Pinned> {
        let _on = self.on_device(device)?;
        match &*self.api {
            // SAFETY: the caller's contract.
            Api::Cuda(c) => unsafe { c.host_register(ptr as usize, len)? },
            // SAFETY: the caller's contract.
            Api::Acl(c) => unsafe { c.host_register(ptr as usize, len)? },
        }
        Ok(Pinned { rt: self.clone(), ptr: ptr as usize, device })
    }
}

/// The thread's previous device, put back on drop.
struct OnDevice<'a> {
    rt: &'a Runtime,
    restore: Option<i32>,
}

impl Drop for OnDevice<'_> {
    fn drop(&mut self) {
        let Some(d) = self.restore else { return };
        let r = match &*self.rt.api {
            Api::Cuda(c) => c.set_device(d),
            Api::Acl(c) => c.set_device(d),
        };
        if let Err(e) = r {
            tracing::warn!("putting device {d} back: {e}");
        }
    }
}

type Handle = *mut c_void;

struct StreamInner {
    rt: Runtime,
    device: i32,
    raw: Handle,
}

// SAFETY: CUDA and ACL stream handles are process-wide objects usable from any thread; every
// call on one makes its device current on the calling thread first (OnDevice).
unsafe impl Send for StreamInner {}
// SAFETY: as above; the runtimes serialise work on one stream themselves.
unsafe impl Sync for StreamInner {}

impl StreamInner {
    fn synchronize(&self) -> Result<()> {
        let _on = self.rt.on_device(self.device)?;
        match &*self.rt.api {
            Api::Cuda(c) => c.stream_synchronize(self.raw),
            Api::Acl(c) => c.stream_synchronize(self.raw),
        }
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Destroying a stream does not wait for its work; the memory its copies use may go
        // right after this, so wait first.
        if let Err(e) = self.synchronize() {
            tracing::warn!("stream of {}:{} ended with {e}", self.rt.kind().name(), self.device);
        }
        let r = self.rt.on_device(self.device).and_then(|_on| match &*self.rt.api {
            Api::Cuda(c) => c.stream_destroy(self.raw),
            Api::Acl(c) => c.stream_destroy(self.raw),
        });
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}

/// A stream of one device; copies queued on it run in order, asynchronously to the host.
/// Dropping it waits for its work.
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl Stream {
    pub fn location(&self) -> Location {
        Location { kind: self.inner.rt.kind(), device: self.inner.device }
    }

    /// Queue a copy of `len` bytes between the device address `device_addr` and host memory at
    /// `host`. It runs later: its bytes are there only once a [`Fence`] recorded after it is
    /// waited for.
    ///
    /// # Safety
    /// `host` is valid for `len` bytes, and stays valid and untouched by anyone else (not read
    /// for [`Direction::DeviceToHost`], not written for [`Direction::HostToDevice`]) until a fence
    /// recorded after this call was waited for. `device_addr` is device memory of this runtime,
    /// which the runtime checks.
    pub unsafe fn copy(&self, dir: Direction, device_addr: usize, host: *mut u8, len: usize) -> Result<()> {
        let s = &self.inner;
        let _on = s.rt.on_device(s.device)?;
        let host = host as usize;
        match (&*s.rt.api, dir) {
            // SAFETY: the caller's contract.
            (Api::Cuda(c), Direction::DeviceToHost) => unsafe {
                c.memcpy_async(host, device_addr, len, cuda::MEMCPY_DEVICE_TO_HOST, s.raw)
            },
            // SAFETY: the caller's contract.
            (Api::Cuda(c), Direction::HostToDevice) => unsafe {
                c.memcpy_async(device_addr, host, len, cuda::MEMCPY_HOST_TO_DEVICE, s.raw)
            },
            // SAFETY: the caller's contract.
            (Api::Acl(c), Direction::DeviceToHost) => unsafe {
                c.memcpy_async(host, device_addr, len, acl::MEMCPY_DEVICE_TO_HOST, s.raw)
            },
            // SAFETY: the caller's contract.
            (Api::Acl(c), Direction::HostToDevice) => unsafe {
                c.memcpy_async(device_addr, host, len, acl::MEMCPY_HOST_TO_DEVICE, s.raw)
            },
        }
    }

    /// A fence after everything queued on this stream so far: a CUDA event recorded now, or for
    /// ACL the stream itself (waiting syncs the stream).
    pub fn fence(&self) -> Result<Fence> {
        let s = &self.inner;
        let kind = match &*s.rt.api {
            Api::Cuda(c) => {
                let _on = s.rt.on_device(s.device)?;
                FenceKind::Event(c.event_record(s.raw)?)
            }
            Api::Acl(_) => FenceKind::Stream,
        };
        Ok(Fence { stream: self.inner.clone(), kind })
    }

    /// Wait for everything queued on this stream.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
}

enum FenceKind {
    Event(Handle),
    Stream,
}

/// A point in a stream's work; [`Fence::wait`] returns once the work before it is done (or
/// failed: a copy that failed while running is reported here).
pub struct Fence {
    stream: Arc<StreamInner>,
    kind: FenceKind,
}

// SAFETY: as Stream: the event handle is a process-wide object, used with its device current.
unsafe impl Send for Fence {}

impl Fence {
    pub fn wait(self) -> Result<()> {
        let s = &self.stream;
        match (&self.kind, &*s.rt.api) {
            (FenceKind::Event(e), Api::Cuda(c)) => {
                let _on = s.rt.on_device(s.device)?;
                c.event_synchronize(*e)
            }
            _ => s.synchronize(),
        }
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let (FenceKind::Event(e), Api::Cuda(c)) = (&self.kind, &*self.stream.rt.api) {
            let _on = self.stream.rt.on_device(self.stream.device);
            c.event_destroy(*e);
        }
    }
}

/// Host memory page-locked by a runtime; unregistered on drop.
pub struct Pinned {
    rt: Runtime,
    ptr: usize,
    device: i32,
}

impl Pinned {
    pub fn kind(&self) -> Kind {
        self.rt.kind()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let r = self.rt.on_device(self.device).and_then(|_on| match &*self.rt.api {
            Api::Cuda(c) => c.host_unregister(self.ptr),
            Api::Acl(c) => c.host_unregister(self.ptr),
        });
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}

/// The runtimes one client asks about addresses: at most one of each kind.
#[derive(Clone, Default, Debug)]
pub struct Runtimes {
    cuda: Option<Runtime>,
    acl: Option<Runtime>,
}

impl Runtimes {
    /// These runtimes (a test's stand-ins, say).
    pub fn new(cuda: Option<Runtime>, acl: Option<Runtime>) -> Runtimes {
        Runtimes { cuda, acl }
    }

    /// The runtimes as the environment says: for each kind, its variable ([`Kind::env_var`])
    /// unset or empty means the runtime if this process loaded it already, `off` (or `none`, `0`)
    /// means never, `auto` loads the first of its usual names that loads, anything else is the
    /// library to load. A library named explicitly that does not load is an error.
    pub fn from_env() -> Result<Runtimes> {
        Ok(Runtimes { cuda: Self::one(Kind::Cuda)?, acl: Self::one(Kind::Acl)? })
    }

    fn one(kind: Kind) -> Result<Option<Runtime>> {
        let v = std::env::var(kind.env_var()).unwrap_or_default();
        match v.trim() {
            "" => Ok(Runtime::already_loaded(kind)),
            "off" | "none" | "0" => Ok(None),
            "auto" => {
                let mut last = None;
                for name in kind.library_names() {
                    match Runtime::open(kind, name) {
                        Ok(rt) => return Ok(Some(rt)),
                        Err(e) => last = Some(e),
                    }
                }
                tracing::debug!("{} runtime not found: {last:?}", kind);
                Ok(None)
            }
            path => Runtime::open(kind, path).map(Some),
        }
    }

    pub fn get(&self, kind: Kind) -> Option<&Runtime> {
        match kind {
            Kind::Cuda => self.cuda.as_ref(),
            Kind::Acl => self.acl.as_ref(),
        }
    }

    /// The loaded runtimes, CUDA first.
    pub fn iter(&self) -> impl Iterator<Item = &Runtime> {
        self.cuda.iter().chain(self.acl.iter())
    }

    pub fn is_empty(&self) -> bool {
        self.cuda.is_none() && self.acl.is_none()
    }
}
