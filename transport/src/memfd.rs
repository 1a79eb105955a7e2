//! Memory shared between a client and a server on one host: a memfd, sealed so that its size can
//! never change, mapped by both. The client creates and exports it ([`SharedBuffer`]); the server
//! imports it ([`Mapping`]) after checking the seals, so no client can make the server's mapping
//! fault (a shrunk file would raise SIGBUS on access) whatever it does to its own copy.

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::io;
use std::ptr::NonNull;

/// Seals every shared buffer carries: fixed size, and no way to lift the seals.
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// A mapping of a memfd into this process, unmapped on drop.
struct Mapped {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain shared memory; who may touch which bytes when is the transport's contract.
unsafe impl Send for Mapped {}
// SAFETY: as for `Send`: the mapping itself is never changed through a shared reference.
unsafe impl Sync for Mapped {}

impl Mapped {
    fn map(fd: BorrowedFd<'_>, len: usize, populate: bool) -> io::Result<Mapped> {
        let flags = if populate { MapFlags::SHARED | MapFlags::POPULATE } else { MapFlags::SHARED };
        // SAFETY: a fresh mapping of `len` bytes of a file at least that long (checked by callers).
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, flags, fd, 0) }?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapped { ptr, len })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: mapped in `Mapped::map` with this length; nothing refers to it any more.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A client's buffer that a same-host server can read and write: a sealed memfd mapped here.
pub struct SharedBuffer {
    fd: OwnedFd,
    map: Mapped,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer").field("addr", &self.map.ptr).field("len", &self.map.len).finish()
    }
}

impl SharedBuffer {
    /// A zero-filled buffer of `len` bytes (at least 1).
    pub fn new(len: usize, name: &str) -> io::Result<SharedBuffer> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a shared buffer needs at least one byte"));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, SEALS)?;
        let map = Mapped::map(fd.as_fd(), len, false)?;
        Ok(SharedBuffer { fd, map })
    }

    pub fn len(&self) -> usize {
        self.map.len
    }

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// Start of the buffer in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.ptr.as_ptr()
    }

    /// The file to hand to the server (SCM_RIGHTS).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The bytes. The server writes into a buffer only while a transfer that names it is in
    /// flight; read them after that transfer has completed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// The bytes, to fill before a transfer reads them.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` excludes other borrows in this process.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr(), self.map.len) }
    }
}

/// A client's buffer as the server sees it: an imported, checked memfd mapped into the server.
pub struct Mapping {
    map: Mapped,
    _fd: OwnedFd,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping").field("len", &self.map.len).finish()
    }
}

/// Why a received file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("the file is not a sealed memfd (seals {0:?}; shrink and grow must be sealed)")]
    NotSealed(SealFlags),
    #[error("the file holds {actual} bytes, fewer than the {claimed} claimed")]
    TooShort { claimed: u64, actual: u64 },
    #[error("a region must hold 1 byte to {max} bytes, not {0}", max = MAX_REGION)]
    BadLength(u64),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Largest region a client may share (1 TiB): bounds the address space one client can take.
pub const MAX_REGION: u64 = 1 << 40;

impl Mapping {
    /// Check a received file (sealed against resizing, long enough) and map `len` bytes of it,
    /// pages populated up front so that the first transfer does not pay for page faults.
    pub fn import(fd: OwnedFd, len: u64) -> Result<Mapping, ImportError> {
        if len == 0 || len > MAX_REGION {
            return Err(ImportError::BadLength(len));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io::Error::from)?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(ImportError::NotSealed(seals));
        }
        let actual = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_size as u64;
        if actual < len {
            return Err(ImportError::TooShort { claimed: len, actual });
        }
        let map = Mapped::map(fd.as_fd(), len as usize, true)?;
        Ok(Mapping { map, _fd: fd })
    }

    pub fn addr(&self) -> usize {
        self.map.ptr.as_ptr() as usize
    }

    pub fn len(&self) -> usize {
        self.map.len
    }

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_buffer_is_imported_and_shares_bytes() {
        let mut b = SharedBuffer::new(8192, "t").unwrap();
        b.as_mut_slice()[100] = 42;
        let fd = b.fd().try_clone_to_owned().unwrap();
        let m = Mapping::import(fd, 8192).unwrap();
        // SAFETY: the mapping is 8192 bytes long.
        let seen = unsafe { *(m.addr() as *const u8).add(100) };
        assert_eq!(seen, 42);
        // The client cannot shrink it under the server.
        assert!(rustix::fs::ftruncate(b.fd(), 10).is_err());
    }

    #[test]
    fn unsealed_or_short_files_are_refused() {
        let fd = rustix::fs::memfd_create("u", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(Mapping::import(fd, 4096), Err(ImportError::NotSealed(_))));
        let b = SharedBuffer::new(4096, "s").unwrap();
        let fd = b.fd().try_clone_to_owned().unwrap();
        assert!(matches!(Mapping::import(fd, 8192), Err(ImportError::TooShort { .. })));
        let fd = b.fd().try_clone_to_owned().unwrap();
        assert!(matches!(Mapping::import(fd, 0), Err(ImportError::BadLength(0))));
    }
}
