//! Keys from the command line, values from a file or stdin, and what goes to stdout.

use crate::{Failure, Outcome};
use kvpool_client::ErrorCode;
use std::io::{Read, Write};
use std::path::Path;

pub(crate) fn parse_key(s: &str, hex: bool) -> Result<Vec<u8>, Failure> {
    if hex {
        hex::decode(s.trim_start_matches("0x")).map_err(|e| Failure::usage(format!("key {s:?} is not hex: {e}")))
    } else if s.is_empty() {
        Err(Failure::usage("empty key"))
    } else {
        Ok(s.as_bytes().to_vec())
    }
}

pub(crate) fn parse_keys(keys: &[String], hex: bool) -> Result<Vec<Vec<u8>>, Failure> {
    keys.iter().map(|k| parse_key(k, hex)).collect()
}

/// Read a value to put; a file's size is checked against the server limit before reading it.
pub(crate) fn read_value(file: Option<&Path>, max: u64) -> Result<Vec<u8>, Failure> {
    let too_big = |n: u64| Failure {
        exit: 1,
        line: format!("{}: value is {n} bytes, the server limit is {max}", ErrorCode::ValueTooLarge),
    };
    match file {
        None => read_stdin(max, too_big),
        Some(p) if p.as_os_str() == "-" => read_stdin(max, too_big),
        Some(p) => {
            let meta = std::fs::metadata(p).map_err(|e| Failure::io(format!("{}: {e}", p.display())))?;
            if meta.is_file() && meta.len() > max {
                return Err(too_big(meta.len()));
            }
            std::fs::read(p).map_err(|e| Failure::io(format!("{}: {e}", p.display())))
        }
    }
}

pub(crate) fn read_stdin(max: u64, too_big: impl Fn(u64) -> Failure) -> Result<Vec<u8>, Failure> {
    let mut buf = Vec::new();
    // One byte past the limit is enough to know the value is too large.
    std::io::stdin()
        .lock()
        .take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| Failure::io(format!("stdin: {e}")))?;
    if buf.len() as u64 > max {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

/// Write to stdout without `println!`'s panic on a closed pipe (`kvpool exists ... | head -1`).
pub(crate) fn out(args: std::fmt::Arguments<'_>) -> Outcome {
    let mut o = std::io::stdout().lock();
    match o.write_fmt(args).and_then(|_| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::io(format!("stdout: {e}"))),
    }
}

pub(crate) fn display_key(k: &[u8], hex: bool) -> String {
    if hex {
        hex::encode(k)
    } else {
        String::from_utf8_lossy(k).into_owned()
    }
}

/// A value to a file, or to stdout when `output` is none or `-`.
pub(crate) fn write_value(output: Option<&Path>, value: &[u8]) -> Outcome {
    match output {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::write(path, value).map_err(|e| Failure::io(format!("{}: {e}", path.display())))?
        }
        _ => {
            let mut o = std::io::stdout().lock();
            match o.write_all(value).and_then(|_| o.flush()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(Failure::io(format!("stdout: {e}")))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_text_and_hex() {
        assert_eq!(parse_key("abc", false).unwrap(), b"abc");
        assert_eq!(parse_key("00ff", true).unwrap(), vec![0, 255]);
        assert_eq!(parse_key("0x01", true).unwrap(), vec![1]);
        assert_eq!(parse_key("xyz", true).unwrap_err().exit, 2);
        assert_eq!(parse_key("", false).unwrap_err().exit, 2);
    }
}
