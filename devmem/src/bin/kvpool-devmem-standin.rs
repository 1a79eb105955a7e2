//! `kvpool-devmem-standin DIR`: write this build's stand-in runtimes into DIR
//! (`libkvpool_cuda_standin.so`, `libkvpool_acl_standin.so`) and print their paths, one per line.
//! The Python tests find the stand-ins this way (the binary sits next to `kvpool-server` in the
//! target directory); the libraries are carried inside it, so a moved target directory still works.

use std::io::Write;
use std::path::PathBuf;

const LIBS: [(&str, &[u8]); 2] = [
    ("libkvpool_cuda_standin.so", include_bytes!(env!("KVPOOL_DEVMEM_CUDA_STANDIN"))),
    ("libkvpool_acl_standin.so", include_bytes!(env!("KVPOOL_DEVMEM_ACL_STANDIN"))),
];

fn main() -> std::process::ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: kvpool-devmem-standin DIR (writes the CUDA and ACL stand-in libraries there)");
        return std::process::ExitCode::from(2);
    };
    let mut out = std::io::stdout().lock();
    for (name, bytes) in LIBS {
        let path = dir.join(name);
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, bytes)) {
            eprintln!("kvpool-devmem-standin: writing {}: {e}", path.display());
            return std::process::ExitCode::FAILURE;
        }
        let _ = writeln!(out, "{}", path.display());
    }
    std::process::ExitCode::SUCCESS
}
