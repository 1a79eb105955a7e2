//! The SSD tier: one file per block copy in a directory, with byte accounting against a
//! capacity. A file per block keeps crash recovery trivial (the file system is the allocator's
//! state: a committed block is a renamed, complete file; anything else is garbage at start-up).
//! Every read is verified against the block's checksum by the caller.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Space accounting granularity (a file system block).
pub const SSD_UNIT: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("ssd tier i/o on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("ssd file {path} holds {actual} bytes, expected {expected}")]
    ShortFile { path: PathBuf, expected: u64, actual: u64 },
}

pub struct SsdTier {
    dir: PathBuf,
    capacity: u64,
    used: AtomicU64,
    fsync: bool,
    next_file: AtomicU64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SsdError + '_ {
    move |source| SsdError::Io { path: path.to_owned(), source }
}

impl SsdTier {
    /// Open the directory, creating it; returns the tier and the ids of the block files found
    /// there (with their lengths). Partial files from an interrupted write are deleted.
    pub fn open(dir: &Path, capacity: u64, fsync: bool) -> Result<(SsdTier, Vec<(u64, u64)>), SsdError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let mut found = Vec::new();
        let mut max_id = 0;
        for entry in fs::read_dir(dir).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if let Some(stem) = name.strip_suffix(".blk") {
                if let Ok(id) = u64::from_str_radix(stem, 16) {
                    let len = entry.metadata().map_err(io(&path))?.len();
                    max_id = max_id.max(id);
                    found.push((id, len));
                    continue;
                }
            }
            if name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                if let Some(id) = name.strip_suffix(".tmp").and_then(|s| u64::from_str_radix(s, 16).ok()) {
                    max_id = max_id.max(id);
                }
            }
        }
        let tier = SsdTier {
            dir: dir.to_owned(),
            capacity,
            used: AtomicU64::new(0),
            fsync,
            next_file: AtomicU64::new(max_id + 1),
        };
        Ok((tier, found))
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn footprint(len: u64) -> u64 {
        len.max(1).div_ceil(SSD_UNIT) * SSD_UNIT
    }

    /// Account for a file that survived a restart.
    pub fn adopt(&self, len: u64) {
        self.used.fetch_add(Self::footprint(len), Ordering::Relaxed);
    }

    /// Claim space for a new copy; `false` when it does not fit under the capacity.
    pub fn try_reserve(&self, len: u64) -> bool {
        let need = Self::footprint(len);
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| (u + need <= self.capacity).then_some(u + need))
            .is_ok()
    }

    pub fn release(&self, len: u64) {
        self.used.fetch_sub(Self::footprint(len), Ordering::Relaxed);
    }

    pub fn new_file_id(&self) -> u64 {
        self.next_file.fetch_add(1, Ordering::Relaxed)
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}.blk"))
    }

    /// Write a complete block file (temp file, then rename: a crash leaves no half file under
    /// a committed name). Space must have been reserved.
    pub fn write(&self, id: u64, data: &[u8]) -> Result<(), SsdError> {
        let tmp = self.dir.join(format!("{id:016x}.tmp"));
        let mut f = OpenOptions::new().create(true).write(true).truncate(true).open(&tmp).map_err(io(&tmp))?;
        f.write_all(data).map_err(io(&tmp))?;
        if self.fsync {
            f.sync_data().map_err(io(&tmp))?;
        }
        drop(f);
        let path = self.path(id);
        fs::rename(&tmp, &path).map_err(io(&path))
    }

    /// Read a block file of the expected length.
    pub fn read(&self, id: u64, len: u64) -> Result<Vec<u8>, SsdError> {
        let path = self.path(id);
        let mut f = File::open(&path).map_err(io(&path))?;
        let actual = f.metadata().map_err(io(&path))?.len();
        if actual != len {
            return Err(SsdError::ShortFile { path, expected: len, actual });
        }
        let mut buf = vec![0u8; len as usize];
        f.read_exact(&mut buf).map_err(io(&path))?;
        Ok(buf)
    }

    /// Read into a caller buffer of exactly the block's length.
    pub fn read_into(&self, id: u64, buf: &mut [u8]) -> Result<(), SsdError> {
        let path = self.path(id);
        let mut f = File::open(&path).map_err(io(&path))?;
        let actual = f.metadata().map_err(io(&path))?.len();
        if actual != buf.len() as u64 {
            return Err(SsdError::ShortFile { path, expected: buf.len() as u64, actual });
        }
        f.read_exact(buf).map_err(io(&path))
    }

    pub fn delete(&self, id: u64) {
        let path = self.path(id);
        if let Err(e) = fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "cannot delete ssd block file");
            }
        }
    }

    pub fn file_path(&self, id: u64) -> PathBuf {
        self.path(id)
    }
}
