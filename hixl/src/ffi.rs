//! The shim's C ABI (`shim/kvpool_hixl_shim.h`), loaded at run time with libloading.

use crate::error::{Call, HixlCode, HixlError};
use libloading::Library;
use std::ffi::{c_char, c_int, CString};
use std::sync::Arc;

/// `KVPOOL_HIXL_ABI_VERSION` this crate speaks (a test checks it against the header).
pub const ABI_VERSION: u32 = 1;
pub const MEM_DEVICE: u32 = 0;
pub const MEM_HOST: u32 = 1;
pub const OP_READ: u32 = 0;
pub const OP_WRITE: u32 = 1;
pub const XFER_WAITING: u32 = 0;
pub const XFER_COMPLETED: u32 = 1;
pub const XFER_TIMEOUT: u32 = 2;
pub const XFER_FAILED: u32 = 3;

/// Default file name of the real shim (searched on the library path when no path is given).
pub const SHIM_NAME: &str = "libkvpool_hixl_shim.so";

/// `kvpool_hixl_desc`
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawDesc {
    pub local_addr: u64,
    pub remote_addr: u64,
    pub len: u64,
}

#[repr(C)]
struct RawOption {
    key: *const c_char,
    value: *const c_char,
}

/// `kvpool_hixl_engine` (opaque).
#[repr(C)]
pub struct RawEngine {
    _private: [u8; 0],
}

/// The stand-in's counters (`kvpool_hixl_standin_counters` in standin.c).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StandinCounters {
    pub transfer_calls: u64,
    pub descs: u64,
    pub bytes: u64,
    pub max_descs_per_call: u64,
    pub sync_calls: u64,
    pub connects: u64,
    pub disconnects: u64,
    pub registers: u64,
    pub deregisters: u64,
    pub status_calls: u64,
    pub stale_status: u64,
    pub wrong_thread: u64,
    /// Most requests submitted and not yet reported at any moment (HIXL requests in flight).
    pub max_outstanding: u64,
}

type Status = u32;

struct Hooks {
    inject: unsafe extern "C" fn(*mut RawEngine, *const c_char) -> c_int,
    counters: unsafe extern "C" fn(*mut RawEngine, *mut StandinCounters),
    option: unsafe extern "C" fn(*mut RawEngine, *const c_char, *mut c_char, u32) -> u32,
}

/// A loaded shim library.
pub struct ShimLib {
    pub path: String,
    pub backend: String,
    last_error: unsafe extern "C" fn(*mut c_char, u32) -> u32,
    create: unsafe extern "C" fn(i32, *const c_char, *const RawOption, u32, *mut *mut RawEngine) -> Status,
    destroy: unsafe extern "C" fn(*mut RawEngine),
    bind_thread: unsafe extern "C" fn(*mut RawEngine) -> Status,
    malloc: unsafe extern "C" fn(*mut RawEngine, u64, u32, *mut u64) -> Status,
    free: unsafe extern "C" fn(*mut RawEngine, u64, u32) -> Status,
    register_mem: unsafe extern "C" fn(*mut RawEngine, u64, u64, u32, *mut u64) -> Status,
    deregister_mem: unsafe extern "C" fn(*mut RawEngine, u64) -> Status,
    connect: unsafe extern "C" fn(*mut RawEngine, *const c_char, i32) -> Status,
    disconnect: unsafe extern "C" fn(*mut RawEngine, *const c_char, i32) -> Status,
    transfer_async: unsafe extern "C" fn(*mut RawEngine, *const c_char, u32, *const RawDesc, u32, *mut u64) -> Status,
    transfer_status: unsafe extern "C" fn(*mut RawEngine, u64, *mut u32) -> Status,
    transfer_sync: unsafe extern "C" fn(*mut RawEngine, *const c_char, u32, *const RawDesc, u32, i32) -> Status,
    hooks: Option<Hooks>,
    // Last: the function pointers above point into it.
    _lib: Library,
}

/// What dlopen said, with the CANN library it names when that is what is missing.
fn load_failure(path: &str, e: &libloading::Error) -> HixlError {
    let text = e.to_string();
    let mut reason = text.clone();
    for dep in ["libcann_hixl.so", "libascendcl.so", "libacl_rt.so", "libascend_hal.so"] {
        if text.contains(dep) && !text.contains(SHIM_NAME) {
            reason = format!(
                "the shim was found but its CANN dependency {dep} was not ({text}); source CANN's set_env.sh or add \
                 $ASCEND_HOME_PATH/lib64 to LD_LIBRARY_PATH"
            );
        }
    }
    HixlError::LibraryMissing { library: path.to_string(), reason }
}

impl ShimLib {
    /// Load the library at `path` (a bare file name is searched on the library path) and check
    /// its ABI version before anything else.
    pub fn open(path: &str) -> Result<Arc<ShimLib>, HixlError> {
        // SAFETY: loading runs the library's initialisers; the shim and the stand-in have none
        // beyond their C/C++ runtime's.
        let lib = unsafe { Library::new(path) }.map_err(|e| load_failure(path, &e))?;
        let missing = |symbol: &str| HixlError::MissingSymbol { library: path.to_string(), symbol: symbol.to_string() };
        macro_rules! sym {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol's type is the one kvpool_hixl_shim.h declares for this ABI
                // version (checked first); the pointer stays valid while `lib` is held.
                let s = unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) };
                *s.map_err(|_| missing($name))?
            }};
        }
        let abi = sym!("kvpool_hixl_abi_version", unsafe extern "C" fn() -> u32);
        // SAFETY: no arguments, returns a constant.
        let found = unsafe { abi() };
        if found != ABI_VERSION {
            return Err(HixlError::AbiMismatch { library: path.to_string(), found, expected: ABI_VERSION });
        }
        let backend_fn = sym!("kvpool_hixl_backend", unsafe extern "C" fn() -> *const c_char);
        // SAFETY: returns a static NUL-terminated string.
        let backend = unsafe { std::ffi::CStr::from_ptr(backend_fn()) }.to_string_lossy().into_owned();
        let hooks = if backend == "standin" {
            Some(Hooks {
                inject: sym!(
                    "kvpool_hixl_standin_inject",
                    unsafe extern "C" fn(*mut RawEngine, *const c_char) -> c_int
                ),
                counters: sym!(
                    "kvpool_hixl_standin_counters_get",
                    unsafe extern "C" fn(*mut RawEngine, *mut StandinCounters)
                ),
                option: sym!(
                    "kvpool_hixl_standin_option",
                    unsafe extern "C" fn(*mut RawEngine, *const c_char, *mut c_char, u32) -> u32
                ),
            })
        } else {
            None
        };
        Ok(Arc::new(ShimLib {
            path: path.to_string(),
            backend,
            last_error: sym!("kvpool_hixl_last_error", unsafe extern "C" fn(*mut c_char, u32) -> u32),
            create: sym!(
                "kvpool_hixl_create",
                unsafe extern "C" fn(i32, *const c_char, *const RawOption, u32, *mut *mut RawEngine) -> Status
            ),
            destroy: sym!("kvpool_hixl_destroy", unsafe extern "C" fn(*mut RawEngine)),
            bind_thread: sym!("kvpool_hixl_bind_thread", unsafe extern "C" fn(*mut RawEngine) -> Status),
            malloc: sym!("kvpool_hixl_malloc", unsafe extern "C" fn(*mut RawEngine, u64, u32, *mut u64) -> Status),
            free: sym!("kvpool_hixl_free", unsafe extern "C" fn(*mut RawEngine, u64, u32) -> Status),
            register_mem: sym!(
                "kvpool_hixl_register_mem",
                unsafe extern "C" fn(*mut RawEngine, u64, u64, u32, *mut u64) -> Status
            ),
            deregister_mem: sym!("kvpool_hixl_deregister_mem", unsafe extern "C" fn(*mut RawEngine, u64) -> Status),
            connect: sym!("kvpool_hixl_connect", unsafe extern "C" fn(*mut RawEngine, *const c_char, i32) -> Status),
            disconnect: sym!(
                "kvpool_hixl_disconnect",
                unsafe extern "C" fn(*mut RawEngine, *const c_char, i32) -> Status
            ),
            transfer_async: sym!(
                "kvpool_hixl_transfer_async",
                unsafe extern "C" fn(*mut RawEngine, *const c_char, u32, *const RawDesc, u32, *mut u64) -> Status
            ),
            transfer_status: sym!(
                "kvpool_hixl_transfer_status",
                unsafe extern "C" fn(*mut RawEngine, u64, *mut u32) -> Status
            ),
            transfer_sync: sym!(
                "kvpool_hixl_transfer_sync",
                unsafe extern "C" fn(*mut RawEngine, *const c_char, u32, *const RawDesc, u32, i32) -> Status
            ),
            hooks,
            _lib: lib,
        }))
    }

    /// The message the library left for the last failure on this thread.
    fn last_error(&self) -> String {
        let mut buf = vec![0u8; 512];
        // SAFETY: the buffer is writable for its length.
        let n = unsafe { (self.last_error)(buf.as_mut_ptr().cast(), buf.len() as u32) } as usize;
        if n >= buf.len() {
            buf = vec![0u8; n + 1];
            // SAFETY: as above.
            unsafe { (self.last_error)(buf.as_mut_ptr().cast(), buf.len() as u32) };
        }
        buf.truncate(n.min(buf.len() - 1));
        String::from_utf8_lossy(&buf).into_owned()
    }

    fn check(&self, call: Call, status: Status) -> Result<(), HixlError> {
        match HixlCode::from_status(status) {
            None => Ok(()),
            Some(code) => Err(HixlError::status(call, code, self.last_error())),
        }
    }
}

fn cstring(s: &str) -> Result<CString, HixlError> {
    CString::new(s).map_err(|_| HixlError::Config(format!("{s:?} contains a NUL byte")))
}

/// An engine created by a shim. Every call must come from the thread that created it or from a
/// thread that called [`Engine::bind_thread`] (the shim enforces nothing in the real case: HIXL
/// simply fails), which is why the transport keeps it on its engine thread.
pub struct Engine {
    lib: Arc<ShimLib>,
    raw: *mut RawEngine,
}

// SAFETY: the handle is only used from the engine thread and from worker threads that bound
// themselves to it first (see `bind_thread`); the transport enforces that discipline.
unsafe impl Send for Engine {}
// SAFETY: as for `Send`: shared use goes through that same discipline.
unsafe impl Sync for Engine {}

impl Engine {
    pub fn create(
        lib: Arc<ShimLib>,
        device: i32,
        name: &str,
        options: &[(String, String)],
    ) -> Result<Engine, HixlError> {
        let name = cstring(name)?;
        let owned: Vec<(CString, CString)> =
            options.iter().map(|(k, v)| Ok((cstring(k)?, cstring(v)?))).collect::<Result<_, HixlError>>()?;
        let raw_opts: Vec<RawOption> =
            owned.iter().map(|(k, v)| RawOption { key: k.as_ptr(), value: v.as_ptr() }).collect();
        let mut raw = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; the library copies what it keeps.
        let st = unsafe { (lib.create)(device, name.as_ptr(), raw_opts.as_ptr(), raw_opts.len() as u32, &mut raw) };
        lib.check(Call::Create, st)?;
        Ok(Engine { lib, raw })
    }

    pub fn lib(&self) -> &Arc<ShimLib> {
        &self.lib
    }

    pub fn bind_thread(&self) -> Result<(), HixlError> {
        // SAFETY: a live engine.
        self.lib.check(Call::BindThread, unsafe { (self.lib.bind_thread)(self.raw) })
    }

    pub fn malloc(&self, len: u64, mem_type: u32) -> Result<u64, HixlError> {
        let mut addr = 0;
        // SAFETY: a live engine and a valid out pointer.
        self.lib.check(Call::Malloc, unsafe { (self.lib.malloc)(self.raw, len, mem_type, &mut addr) })?;
        Ok(addr)
    }

    pub fn free(&self, addr: u64, mem_type: u32) -> Result<(), HixlError> {
        // SAFETY: a live engine; the library checks that addr is one of its allocations.
        self.lib.check(Call::Free, unsafe { (self.lib.free)(self.raw, addr, mem_type) })
    }

    pub fn register(&self, addr: u64, len: u64, mem_type: u32) -> Result<u64, HixlError> {
        let mut h = 0;
        // SAFETY: a live engine; the caller vouches for the memory (Transport::register's contract).
        self.lib.check(Call::Register, unsafe { (self.lib.register_mem)(self.raw, addr, len, mem_type, &mut h) })?;
        Ok(h)
    }

    pub fn deregister(&self, handle: u64) -> Result<(), HixlError> {
        // SAFETY: a live engine and a handle it returned.
        self.lib.check(Call::Deregister, unsafe { (self.lib.deregister_mem)(self.raw, handle) })
    }

    pub fn connect(&self, remote: &str, timeout_ms: i32) -> Result<(), HixlError> {
        let r = cstring(remote)?;
        // SAFETY: a live engine and a NUL-terminated name.
        self.lib.check(Call::Connect, unsafe { (self.lib.connect)(self.raw, r.as_ptr(), timeout_ms) })
    }

    pub fn disconnect(&self, remote: &str, timeout_ms: i32) -> Result<(), HixlError> {
        let r = cstring(remote)?;
        // SAFETY: as for connect.
        self.lib.check(Call::Disconnect, unsafe { (self.lib.disconnect)(self.raw, r.as_ptr(), timeout_ms) })
    }

    pub fn transfer_async(&self, remote: &str, op: u32, descs: &[RawDesc]) -> Result<u64, HixlError> {
        let r = cstring(remote)?;
        let mut req = 0;
        // SAFETY: a live engine; descs is valid for its length; the memory it names is registered
        // and kept valid by the transport's callers until the request settles.
        let st = unsafe {
            (self.lib.transfer_async)(self.raw, r.as_ptr(), op, descs.as_ptr(), descs.len() as u32, &mut req)
        };
        self.lib.check(Call::Transfer, st)?;
        Ok(req)
    }

    /// One of the `XFER_*` states; a request reported COMPLETED or FAILED must not be queried
    /// again.
    pub fn transfer_status(&self, req: u64) -> Result<u32, HixlError> {
        let mut state = XFER_WAITING;
        // SAFETY: a live engine and a request handle not yet reported finished.
        self.lib.check(Call::TransferStatus, unsafe { (self.lib.transfer_status)(self.raw, req, &mut state) })?;
        Ok(state)
    }

    pub fn transfer_sync(&self, remote: &str, op: u32, descs: &[RawDesc], timeout_ms: i32) -> Result<(), HixlError> {
        let r = cstring(remote)?;
        // SAFETY: as for transfer_async.
        let st = unsafe {
            (self.lib.transfer_sync)(self.raw, r.as_ptr(), op, descs.as_ptr(), descs.len() as u32, timeout_ms)
        };
        self.lib.check(Call::Transfer, st)
    }

    /// Stand-in only: inject faults (see standin.c); false when this is not the stand-in or the
    /// spec does not parse.
    pub fn standin_inject(&self, spec: &str) -> bool {
        let (Some(h), Ok(s)) = (&self.lib.hooks, CString::new(spec)) else { return false };
        // SAFETY: a live engine; the stand-in's controls lock internally and may be called from
        // any thread.
        unsafe { (h.inject)(self.raw, s.as_ptr()) == 0 }
    }

    /// Stand-in only: what the library saw.
    pub fn standin_counters(&self) -> Option<StandinCounters> {
        let h = self.lib.hooks.as_ref()?;
        let mut c = StandinCounters::default();
        // SAFETY: as for standin_inject.
        unsafe { (h.counters)(self.raw, &mut c) };
        Some(c)
    }

    /// Stand-in only: an option as the library received it at create.
    pub fn standin_option(&self, key: &str) -> Option<String> {
        let h = self.lib.hooks.as_ref()?;
        let k = CString::new(key).ok()?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: as for standin_inject; the buffer is writable for its length.
        let n = unsafe { (h.option)(self.raw, k.as_ptr(), buf.as_mut_ptr().cast(), buf.len() as u32) } as usize;
        if n == 0 {
            return None;
        }
        buf.truncate((n - 1).min(buf.len() - 1));
        Some(String::from_utf8_lossy(&buf).into_owned())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: created by this library, destroyed once, on the owning thread (the engine
        // thread drops it).
        unsafe { (self.lib.destroy)(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_header() {
        let h = include_str!("../shim/kvpool_hixl_shim.h");
        let define = |name: &str| -> u32 {
            let line =
                h.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap_or_else(|| panic!("{name}"));
            line.split_whitespace().nth(2).unwrap().trim_end_matches('u').parse().unwrap()
        };
        assert_eq!(define("KVPOOL_HIXL_ABI_VERSION"), ABI_VERSION);
        assert_eq!(define("KVPOOL_HIXL_MEM_DEVICE"), MEM_DEVICE);
        assert_eq!(define("KVPOOL_HIXL_MEM_HOST"), MEM_HOST);
        assert_eq!(define("KVPOOL_HIXL_READ"), OP_READ);
        assert_eq!(define("KVPOOL_HIXL_WRITE"), OP_WRITE);
        assert_eq!(define("KVPOOL_HIXL_XFER_WAITING"), XFER_WAITING);
        assert_eq!(define("KVPOOL_HIXL_XFER_COMPLETED"), XFER_COMPLETED);
        assert_eq!(define("KVPOOL_HIXL_XFER_TIMEOUT"), XFER_TIMEOUT);
        assert_eq!(define("KVPOOL_HIXL_XFER_FAILED"), XFER_FAILED);
        for (name, code) in [
            ("KVPOOL_HIXL_PARAM_INVALID", HixlCode::ParamInvalid),
            ("KVPOOL_HIXL_TIMEOUT", HixlCode::Timeout),
            ("KVPOOL_HIXL_NOT_CONNECTED", HixlCode::NotConnected),
            ("KVPOOL_HIXL_ALREADY_CONNECTED", HixlCode::AlreadyConnected),
            ("KVPOOL_HIXL_NOTIFY_FAILED", HixlCode::NotifyFailed),
            ("KVPOOL_HIXL_UNSUPPORTED", HixlCode::Unsupported),
            ("KVPOOL_HIXL_RESOURCE_EXHAUSTED", HixlCode::ResourceExhausted),
            ("KVPOOL_HIXL_FAILED", HixlCode::Failed),
        ] {
            assert_eq!(HixlCode::from_status(define(name)), Some(code), "{name}");
        }
    }
}
