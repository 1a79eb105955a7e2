//! Ascend ACL's C ABI, as kvpool-devmem calls it.
//!
//! Declarations checked against CANN's public headers in hicann/runtime (commit 681ef76, Aug
//! 2026): `include/external/acl/acl_rt.h`, `acl_base_rt.h` and `error_codes/rt_error_codes.h`,
//! and its API reference (`docs/zh/api_ref/11-02_host_memory_management.md`,
//! `11-05_unified_addressing.md`, `25-02_Enumerations.md`):
//! - `aclError aclrtPointerGetAttributes(const void *ptr, aclrtPtrAttributes *attributes)` with
//!   `aclrtPtrAttributes { aclrtMemLocation location {uint32_t id; aclrtMemLocationType type};
//!   uint32_t pageSize; uint32_t rsv[4]; }`; location types HOST 0 (from aclrtMallocHost),
//!   DEVICE 1 (from aclrtMalloc), UNREGISTERED 2 (not from ACL), MANAGED 3.
//! - `aclrtSetDevice(int32_t)`, `aclrtGetDevice(int32_t *)` (fails without a current context).
//! - `aclrtCreateStream(aclrtStream *)`, `aclrtDestroyStream`, `aclrtSynchronizeStream`.
//! - `aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
//!   aclrtMemcpyKind kind, aclrtStream stream)`, kinds HOST_TO_DEVICE 1, DEVICE_TO_HOST 2.
//! - `aclrtHostRegister(void *ptr, uint64_t size, aclrtHostRegisterType type, void **devPtr)`
//!   (`ACL_HOST_REGISTER_MAPPED` 0; the host address must be 4 KiB aligned), `aclrtHostUnregister`.
//!   Newer CANN also has `aclrtHostRegisterV2(ptr, size, ACL_HOST_REG_PINNED)`, which is not used.
//! - `const char *aclGetRecentErrMsg(void)`; `ACL_SUCCESS` 0.
//!
//! ACL keeps a current context per thread: streams, copies and syncs are made on a thread whose
//! current device is the one they belong to (see `OnDevice` in lib.rs). There is no ACL event
//! here: a fence is a sync of the stream, and the users of this crate give each staging buffer its
//! own stream so that a sync waits for that buffer's copies only.

use crate::error::{DevmemError, Result};
use crate::Kind;
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};

pub(crate) const MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub(crate) const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const HOST_REGISTER_MAPPED: c_int = 0;
pub(crate) const LOCATION_HOST: u32 = 0;
pub(crate) const LOCATION_DEVICE: u32 = 1;
pub(crate) const LOCATION_MANAGED: u32 = 3;
/// CANN: the host address given to aclrtHostRegister must be 4 KiB aligned.
pub const HOST_REGISTER_ALIGN: usize = 4096;

/// `aclrtPtrAttributes`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct RawAttributes {
    pub(crate) location_id: u32,
    pub(crate) location_type: u32,
    pub(crate) page_size: u32,
    rsv: [u32; 4],
}

type Handle = *mut c_void;

/// The loaded functions; the pointers stay valid while `_lib` (declared last) is held.
pub(crate) struct Acl {
    pointer_get_attributes: unsafe extern "C" fn(*const c_void, *mut RawAttributes) -> c_int,
    set_device: unsafe extern "C" fn(i32) -> c_int,
    get_device: unsafe extern "C" fn(*mut i32) -> c_int,
    create_stream: unsafe extern "C" fn(*mut Handle) -> c_int,
    destroy_stream: unsafe extern "C" fn(Handle) -> c_int,
    synchronize_stream: unsafe extern "C" fn(Handle) -> c_int,
    memcpy_async: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int, Handle) -> c_int,
    host_register: unsafe extern "C" fn(*mut c_void, u64, c_int, *mut *mut c_void) -> c_int,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> c_int,
    recent_err_msg: unsafe extern "C" fn() -> *const c_char,
    _lib: Library,
}

impl Acl {
    pub(crate) fn new(lib: Library, path: &str) -> Result<Acl> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol's type is the one acl_rt.h declares (module docs); the
                // pointer stays valid while `lib` is held, which `Acl` owns.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) };
                *s.map_err(|_| DevmemError::MissingSymbol {
                    runtime: Kind::Acl,
                    library: path.to_string(),
                    symbol: $name,
                })?
            }};
        }
        Ok(Acl {
            pointer_get_attributes: sym!("aclrtPointerGetAttributes"),
            set_device: sym!("aclrtSetDevice"),
            get_device: sym!("aclrtGetDevice"),
            create_stream: sym!("aclrtCreateStream"),
            destroy_stream: sym!("aclrtDestroyStream"),
            synchronize_stream: sym!("aclrtSynchronizeStream"),
            memcpy_async: sym!("aclrtMemcpyAsync"),
            host_register: sym!("aclrtHostRegister"),
            host_unregister: sym!("aclrtHostUnregister"),
            recent_err_msg: sym!("aclGetRecentErrMsg"),
            _lib: lib,
        })
    }

    /// `Ok` for ACL_SUCCESS, else the typed error with ACL's most recent message.
    fn check(&self, call: &'static str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: no arguments; returns NULL or a NUL-terminated string owned by ACL (per thread).
        let text = unsafe { (self.recent_err_msg)() };
        let message = if text.is_null() {
            "no message".to_string()
        } else {
            // SAFETY: non-null and NUL-terminated (above); copied out at once.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(DevmemError::Call { runtime: Kind::Acl, call, code, message })
    }

    pub(crate) fn attributes(&self, ptr: usize) -> Result<RawAttributes> {
        let mut a = RawAttributes::default();
        // SAFETY: `a` is a writable aclrtPtrAttributes; the pointer is only looked up.
        self.check("aclrtPointerGetAttributes", unsafe {
            (self.pointer_get_attributes)(ptr as *const c_void, &mut a)
        })?;
        Ok(a)
    }

    /// The thread's current device, or None without a current context.
    pub(crate) fn current_device(&self) -> Option<i32> {
        let mut d: i32 = -1;
        // SAFETY: `d` is writable.
        (unsafe { (self.get_device)(&mut d) } == 0).then_some(d)
    }

    pub(crate) fn set_device(&self, device: i32) -> Result<()> {
        // SAFETY: plain value argument.
        self.check("aclrtSetDevice", unsafe { (self.set_device)(device) })
    }

    pub(crate) fn stream_create(&self) -> Result<Handle> {
        let mut s: Handle = std::ptr::null_mut();
        // SAFETY: `s` is writable; the caller made the stream's device current.
        self.check("aclrtCreateStream", unsafe { (self.create_stream)(&mut s) })?;
        Ok(s)
    }

    pub(crate) fn stream_destroy(&self, s: Handle) -> Result<()> {
        // SAFETY: `s` came from stream_create and is destroyed once (Stream's Drop).
        self.check("aclrtDestroyStream", unsafe { (self.destroy_stream)(s) })
    }

    pub(crate) fn stream_synchronize(&self, s: Handle) -> Result<()> {
        // SAFETY: `s` is a live stream of the current context.
        self.check("aclrtSynchronizeStream", unsafe { (self.synchronize_stream)(s) })
    }

    /// # Safety
    /// As [`crate::Stream::copy`].
    pub(crate) unsafe fn memcpy_async(&self, dst: usize, src: usize, len: usize, kind: c_int, s: Handle) -> Result<()> {
        // SAFETY: the caller's contract covers both ranges until the copy completes.
        let code = unsafe { (self.memcpy_async)(dst as *mut c_void, len, src as *const c_void, len, kind, s) };
        self.check("aclrtMemcpyAsync", code)
    }

    /// # Safety
    /// `[ptr, ptr + len)` is host memory that stays mapped until unregistered.
    pub(crate) unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<()> {
        if !ptr.is_multiple_of(HOST_REGISTER_ALIGN) {
            return Err(DevmemError::Refused {
                runtime: Kind::Acl,
                what: format!("aclrtHostRegister needs a 4 KiB-aligned address, not {ptr:#x}"),
            });
        }
        let mut mapped: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's contract; `mapped` is writable (the device-side address, unused).
        let code = unsafe { (self.host_register)(ptr as *mut c_void, len as u64, HOST_REGISTER_MAPPED, &mut mapped) };
        self.check("aclrtHostRegister", code)
    }

    pub(crate) fn host_unregister(&self, ptr: usize) -> Result<()> {
        // SAFETY: `ptr` starts a range this runtime registered (Pinned's Drop).
        self.check("aclrtHostUnregister", unsafe { (self.host_unregister)(ptr as *mut c_void) })
    }
}
