//! Python arguments as the client takes them: keys, values (buffers), per-item put metadata,
//! and address ranges.

use super::error::Error;
use kvpool_client::{PinSpec, PutMode, PutOptions};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

/// A key given as `str` (its UTF-8 bytes) or `bytes`.
pub(super) fn key_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!("a key is str or bytes, not {}", obj.get_type().name()?)))
}

pub(super) fn keys_of(objs: &[Bound<'_, PyAny>]) -> PyResult<Vec<Vec<u8>>> {
    objs.iter().map(key_bytes).collect()
}

/// Per-item put metadata given as optional parallel lists.
pub(super) fn put_options(
    n: usize,
    parents: Option<Vec<Option<Bound<'_, PyAny>>>>,
    tokens: Option<Vec<u32>>,
    seq_tokens: Option<Vec<u64>>,
    pin: Option<&str>,
) -> PyResult<Vec<PutOptions>> {
    let pin = match pin {
        None | Some("") | Some("none") => PinSpec::None,
        Some("soft") => PinSpec::Soft { ttl_ms: 0 },
        Some("hard") => PinSpec::Hard,
        Some(other) => return Err(Error::Argument(format!("pin {other:?}: expected none, soft or hard")).into()),
    };
    let lens = [parents.as_ref().map(Vec::len), tokens.as_ref().map(Vec::len), seq_tokens.as_ref().map(Vec::len)];
    if lens.iter().flatten().any(|&l| l != n) {
        return Err(Error::Argument(format!("{n} keys but per-item metadata of lengths {lens:?}")).into());
    }
    (0..n)
        .map(|i| {
            let parent = match parents.as_ref().and_then(|p| p[i].as_ref()) {
                Some(p) => Some(key_bytes(p)?),
                None => None,
            };
            Ok(PutOptions {
                parent,
                tokens: tokens.as_ref().map_or(0, |t| t[i]),
                seq_tokens: seq_tokens.as_ref().map_or(0, |t| t[i]),
                pin,
            })
        })
        .collect()
}

pub(super) fn mode(upsert: bool) -> PutMode {
    if upsert {
        PutMode::Upsert
    } else {
        PutMode::Insert
    }
}

/// A read-only view of a Python object's bytes, held while the GIL is released.
pub(super) struct ValueRef {
    _buf: pyo3::buffer::PyUntypedBuffer,
    ptr: usize,
    len: usize,
}

pub(super) fn value_ref(obj: &Bound<'_, PyAny>) -> PyResult<ValueRef> {
    // Any element type: a value is the buffer's bytes (numpy float arrays included).
    let buf = pyo3::buffer::PyUntypedBuffer::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err("a value must be a C-contiguous buffer"));
    }
    Ok(ValueRef { ptr: buf.buf_ptr() as usize, len: buf.len_bytes(), _buf: buf })
}

impl ValueRef {
    pub(super) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the exporter keeps these bytes alive and in place while `_buf` holds the view.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

pub(super) fn pieces_of(ptrs: Vec<Vec<usize>>, sizes: Vec<Vec<usize>>, n: usize) -> PyResult<Vec<Vec<(usize, usize)>>> {
    if ptrs.len() != n || sizes.len() != n {
        return Err(Error::Argument(format!(
            "{n} keys but {} address lists and {} size lists",
            ptrs.len(),
            sizes.len()
        ))
        .into());
    }
    ptrs.into_iter()
        .zip(sizes)
        .map(|(p, s)| {
            if p.len() != s.len() {
                return Err(Error::Argument(format!("{} addresses but {} sizes", p.len(), s.len())).into());
            }
            Ok(p.into_iter().zip(s).collect())
        })
        .collect()
}

pub(super) fn single_pieces(ptrs: Vec<usize>, sizes: Vec<usize>, n: usize) -> PyResult<Vec<Vec<(usize, usize)>>> {
    if ptrs.len() != n || sizes.len() != n {
        return Err(Error::Argument(format!("{n} keys but {} addresses and {} sizes", ptrs.len(), sizes.len())).into());
    }
    Ok(ptrs.into_iter().zip(sizes).map(|x| vec![x]).collect())
}
