//! Is an address range ordinary host memory this process may read and write?
//!
//! `register_buffer(ptr, size)` takes a raw address. A CUDA or Ascend device pointer is a valid
//! number in the process's address space (the drivers reserve those ranges without access
//! rights, or map them from a device file), and reading it from the host kills the process. So
//! a registration is checked against `/proc/self/maps` first: every byte must lie in mappings
//! that are readable and writable and not backed by a device file. Parsed by hand: the format is
//! five fixed fields and a path, and a crate for it would parse much more than this needs.

use crate::regions::RegionError;

/// Check `[start, start + len)` against the text of `/proc/<pid>/maps`.
pub fn check_in(maps: &str, start: usize, len: usize) -> Result<(), RegionError> {
    let end = start.checked_add(len).ok_or(RegionError::BadRange { start, len })?;
    let refuse = |why: String| Err(RegionError::NotHostMemory { start, len, why });
    // Mappings are listed in address order; walk those that cover the range.
    let mut at = start;
    for line in maps.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let path = f.nth(3).unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else { continue };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { continue };
        if hi <= at {
            continue;
        }
        if lo > at {
            return refuse(format!("{at:#x} is not mapped in this process"));
        }
        if !perms.starts_with("rw") {
            return refuse(format!(
                "{lo:#x}-{hi:#x} is mapped {perms} (a device pointer or guard region, not host memory)"
            ));
        }
        if path.starts_with("/dev/") && !path.starts_with("/dev/shm/") && path != "/dev/zero" {
            return refuse(format!("{lo:#x}-{hi:#x} is mapped from the device file {path}"));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    refuse(format!("{at:#x} is not mapped in this process"))
}

/// Check `[start, start + len)` against this process's mappings now.
pub fn check(start: usize, len: usize) -> Result<(), RegionError> {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => check_in(&maps, start, len),
        // Without procfs nothing can be told apart; the caller's promise stands.
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 123 /usr/bin/python3
7f0000000000-7f0000010000 rw-p 00000000 00:00 0
7f0000010000-7f0000020000 rw-s 00000000 00:01 77 /memfd:kvpool (deleted)
7f0000020000-7f0000030000 ---p 00000000 00:00 0
7f0000030000-7f0000040000 rw-s 00000000 00:05 9 /dev/nvidia0
7f0000040000-7f0000050000 rw-s 00000000 00:05 9 /dev/shm/seg
";

    #[test]
    fn anonymous_and_memfd_memory_is_host_memory() {
        assert!(check_in(MAPS, 0x7f0000000000, 0x10).is_ok());
        // Across two adjacent mappings.
        assert!(check_in(MAPS, 0x7f000000f000, 0x2000).is_ok());
        assert!(check_in(MAPS, 0x7f0000040000, 0x10000).is_ok());
    }

    #[test]
    fn device_reservations_device_files_and_holes_are_refused() {
        for (start, len, needle) in [
            (0x7f0000020000, 8, "---p"),
            (0x7f000001f000, 0x2000, "---p"),
            (0x7f0000030000, 8, "/dev/nvidia0"),
            (0x55d0c0000000, 8, "r--p"),
            (0x1000, 8, "not mapped"),
            (0x7f0000050000, 8, "not mapped"),
            (0x7f000004f000, 0x2000, "not mapped"),
        ] {
            let e = check_in(MAPS, start, len).unwrap_err().to_string();
            assert!(e.contains(needle), "{start:#x}+{len}: {e}");
        }
    }

    #[test]
    fn this_process_heap_is_host_memory_and_null_is_not() {
        let v = vec![0u8; 1 << 20];
        assert!(check(v.as_ptr() as usize, v.len()).is_ok());
        assert!(check(8, 8).is_err());
    }
}
