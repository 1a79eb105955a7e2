//! `SharedBuffer`: memory shared with a same-host server, exported through the buffer protocol.

use kvpool_client::Buffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use std::ffi::c_int;
use std::sync::Arc;

/// Memory shared with a same-host kvpool server (from `Client.alloc_buffer`). Exposes the
/// writable buffer protocol; `address` and `size` give the range to `register`.
#[pyclass(module = "kvpool._native", frozen)]
pub(super) struct SharedBuffer {
    pub(super) buf: Arc<Buffer>,
}

#[pymethods]
impl SharedBuffer {
    /// Start address in this process.
    #[getter]
    fn address(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    /// Length in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.buf.len()
    }

    fn __len__(&self) -> usize {
        self.buf.len()
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut pyo3::ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no view to fill"));
        }
        let (ptr, len) = {
            let me = slf.get();
            (me.buf.as_ptr(), me.buf.len())
        };
        // SAFETY: `view` is the interpreter's; the exporter (this object, which owns the mapping
        // through `buf`) is referenced by the view until the view is released.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len as pyo3::ffi::Py_ssize_t, 0, flags)
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!("kvpool.SharedBuffer(address={:#x}, size={})", self.address(), self.size())
    }
}
