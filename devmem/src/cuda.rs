//! The CUDA runtime's C ABI, as kvpool-devmem calls it.
//!
//! Declarations checked against NVIDIA's headers as published (2026): `cuda_runtime_api.h`
//! (signatures) and `driver_types.h` (types and values), read through the generated bindings of
//! NVIDIA/cuda-python (`cuda_bindings/cuda/bindings/cyruntime.pxd`, generated from CUDA 12.9 to
//! 13.3) and public copies of the headers:
//! - `cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr)`
//!   with `struct cudaPointerAttributes { enum cudaMemoryType type; int device; void
//!   *devicePointer; void *hostPointer; }` since CUDA 11 (CUDA 10 had `memoryType` first and an
//!   `isManaged` field: not supported here). CUDA 13's header appends `long reserved[8]`, so the
//!   buffer given is that large ([`RawAttributes`]). `cudaMemoryType`: Unregistered 0, Host 1,
//!   Device 2, Managed 3. CUDA before 11 answered `cudaErrorInvalidValue` (1) for memory it did
//!   not know; that is read as unregistered.
//! - `cudaSetDevice(int)`, `cudaGetDevice(int *)`.
//! - `cudaStreamCreateWithFlags(cudaStream_t *, unsigned int)` (`cudaStreamNonBlocking` 1),
//!   `cudaStreamDestroy`, `cudaStreamSynchronize`.
//! - `cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
//!   cudaStream_t stream)`, `cudaMemcpyKind`: HostToHost 0, HostToDevice 1, DeviceToHost 2.
//! - `cudaEventCreateWithFlags(cudaEvent_t *, unsigned int)` (`cudaEventDisableTiming` 2),
//!   `cudaEventRecord(cudaEvent_t, cudaStream_t)`, `cudaEventSynchronize`, `cudaEventDestroy`.
//! - `cudaHostRegister(void *ptr, size_t size, unsigned int flags)` (`cudaHostRegisterPortable`
//!   1), `cudaHostUnregister(void *)`.
//! - `const char *cudaGetErrorString(cudaError_t)`, `cudaError_t cudaGetLastError(void)`.
//!
//! `cudaError_t` and the enums are C `int`s; handles are pointers.

use crate::error::{DevmemError, Result};
use crate::Kind;
use libloading::Library;
use std::ffi::{c_char, c_int, c_long, c_uint, c_void, CStr};

pub(crate) const MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub(crate) const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_DISABLE_TIMING: c_uint = 2;
const HOST_REGISTER_PORTABLE: c_uint = 1;
const ERROR_INVALID_VALUE: c_int = 1;

/// `struct cudaPointerAttributes` (CUDA 11 and later; CUDA 13's `reserved` tail included).
#[repr(C)]
#[derive(Default)]
pub(crate) struct RawAttributes {
    pub(crate) kind: c_int,
    pub(crate) device: c_int,
    pub(crate) device_pointer: usize,
    pub(crate) host_pointer: usize,
    reserved: [c_long; 8],
}

type Handle = *mut c_void;

/// The loaded functions. The pointers stay valid while `_lib` is held (it is declared last so
/// that it is dropped last).
pub(crate) struct Cuda {
    pointer_get_attributes: unsafe extern "C" fn(*mut RawAttributes, *const c_void) -> c_int,
    set_device: unsafe extern "C" fn(c_int) -> c_int,
    get_device: unsafe extern "C" fn(*mut c_int) -> c_int,
    stream_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    stream_destroy: unsafe extern "C" fn(Handle) -> c_int,
    stream_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Handle) -> c_int,
    event_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(Handle, Handle) -> c_int,
    event_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    event_destroy: unsafe extern "C" fn(Handle) -> c_int,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: unsafe extern "C" fn() -> c_int,
    _lib: Library,
}

impl Cuda {
    pub(crate) fn new(lib: Library, path: &str) -> Result<Cuda> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol's type is the one cuda_runtime_api.h declares (module docs);
                // the pointer stays valid while `lib` is held, which `Cuda` owns.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) };
                *s.map_err(|_| DevmemError::MissingSymbol {
                    runtime: Kind::Cuda,
                    library: path.to_string(),
                    symbol: $name,
                })?
            }};
        }
        Ok(Cuda {
            pointer_get_attributes: sym!("cudaPointerGetAttributes"),
            set_device: sym!("cudaSetDevice"),
            get_device: sym!("cudaGetDevice"),
            stream_create_with_flags: sym!("cudaStreamCreateWithFlags"),
            stream_destroy: sym!("cudaStreamDestroy"),
            stream_synchronize: sym!("cudaStreamSynchronize"),
            memcpy_async: sym!("cudaMemcpyAsync"),
            event_create_with_flags: sym!("cudaEventCreateWithFlags"),
            event_record: sym!("cudaEventRecord"),
            event_synchronize: sym!("cudaEventSynchronize"),
            event_destroy: sym!("cudaEventDestroy"),
            host_register: sym!("cudaHostRegister"),
            host_unregister: sym!("cudaHostUnregister"),
            get_error_string: sym!("cudaGetErrorString"),
            get_last_error: sym!("cudaGetLastError"),
            _lib: lib,
        })
    }

    /// `Ok` for cudaSuccess, else the typed error with CUDA's text for the code.
    fn check(&self, call: &'static str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: cudaGetErrorString takes any code and returns a static NUL-terminated string
        // (or NULL for codes it does not know, handled below).
        let text = unsafe { (self.get_error_string)(code) };
        let message = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, static and NUL-terminated (above).
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(DevmemError::Call { runtime: Kind::Cuda, call, code, message })
    }

    /// The attributes of `ptr`; memory CUDA does not know reads as unregistered.
    pub(crate) fn attributes(&self, ptr: usize) -> Result<RawAttributes> {
        let mut a = RawAttributes::default();
        // SAFETY: `a` is a writable struct at least as large as any CUDA version writes; the
        // pointer is only looked up, never dereferenced.
        let code = unsafe { (self.pointer_get_attributes)(&mut a, ptr as *const c_void) };
        if code == ERROR_INVALID_VALUE {
            // CUDA before 11 for memory it does not know; clear that error from the thread.
            // SAFETY: no arguments.
            unsafe { (self.get_last_error)() };
            return Ok(RawAttributes::default());
        }
        self.check("cudaPointerGetAttributes", code)?;
        Ok(a)
    }

    pub(crate) fn current_device(&self) -> Result<i32> {
        let mut d: c_int = 0;
        // SAFETY: `d` is writable.
        self.check("cudaGetDevice", unsafe { (self.get_device)(&mut d) })?;
        Ok(d)
    }

    pub(crate) fn set_device(&self, device: i32) -> Result<()> {
        // SAFETY: plain value argument.
        self.check("cudaSetDevice", unsafe { (self.set_device)(device) })
    }

    pub(crate) fn stream_create(&self) -> Result<Handle> {
        let mut s: Handle = std::ptr::null_mut();
        // SAFETY: `s` is writable; the stream belongs to the current device (the caller set it).
        self.check("cudaStreamCreateWithFlags", unsafe {
            (self.stream_create_with_flags)(&mut s, STREAM_NON_BLOCKING)
        })?;
        Ok(s)
    }

    pub(crate) fn stream_destroy(&self, s: Handle) -> Result<()> {
        // SAFETY: `s` came from stream_create and is destroyed once (Stream's Drop).
        self.check("cudaStreamDestroy", unsafe { (self.stream_destroy)(s) })
    }

    pub(crate) fn stream_synchronize(&self, s: Handle) -> Result<()> {
        // SAFETY: `s` is a live stream of this runtime.
        self.check("cudaStreamSynchronize", unsafe { (self.stream_synchronize)(s) })
    }

    /// # Safety
    /// As [`crate::Stream::copy`].
    pub(crate) unsafe fn memcpy_async(&self, dst: usize, src: usize, len: usize, kind: c_int, s: Handle) -> Result<()> {
        // SAFETY: the caller's contract (crate::Stream::copy) covers both ranges until the copy
        // completes; `s` is a live stream.
        let code = unsafe { (self.memcpy_async)(dst as *mut c_void, src as *const c_void, len, kind, s) };
        self.check("cudaMemcpyAsync", code)
    }

    pub(crate) fn event_record(&self, s: Handle) -> Result<Handle> {
        let mut e: Handle = std::ptr::null_mut();
        // SAFETY: `e` is writable.
        self.check("cudaEventCreateWithFlags", unsafe {
            (self.event_create_with_flags)(&mut e, EVENT_DISABLE_TIMING)
        })?;
        // SAFETY: `e` was just created on the current device, `s` is a live stream of it.
        if let Err(err) = self.check("cudaEventRecord", unsafe { (self.event_record)(e, s) }) {
            self.event_destroy(e);
            return Err(err);
        }
        Ok(e)
    }

    pub(crate) fn event_synchronize(&self, e: Handle) -> Result<()> {
        // SAFETY: `e` is a live, recorded event.
        self.check("cudaEventSynchronize", unsafe { (self.event_synchronize)(e) })
    }

    pub(crate) fn event_destroy(&self, e: Handle) {
        // SAFETY: `e` came from cudaEventCreateWithFlags and is destroyed once (Fence's Drop).
        if let Err(err) = self.check("cudaEventDestroy", unsafe { (self.event_destroy)(e) }) {
            tracing::warn!("{err}");
        }
    }

    /// # Safety
    /// `[ptr, ptr + len)` is host memory that stays mapped until unregistered.
    pub(crate) unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        let code = unsafe { (self.host_register)(ptr as *mut c_void, len, HOST_REGISTER_PORTABLE) };
        self.check("cudaHostRegister", code)
    }

    pub(crate) fn host_unregister(&self, ptr: usize) -> Result<()> {
        // SAFETY: `ptr` starts a range this runtime registered (Pinned's Drop).
        self.check("cudaHostUnregister", unsafe { (self.host_unregister)(ptr as *mut c_void) })
    }
}
