//! Builds the stand-in runtimes (`standin/`): one library with the CUDA runtime's symbols and one
//! with Ascend ACL's, over host memory. Always built, and never linked into anything: tests load
//! them by path, the `kvpool-devmem-standin` binary carries copies for the Python tests.

use std::path::PathBuf;

fn main() {
    for f in ["standin/core.h", "standin/core.c", "standin/cuda.c", "standin/acl.c"] {
        println!("cargo:rerun-if-changed={f}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR")).join("standin");
    let cc = cc::Build::new().cargo_metadata(false).get_compiler();
    for (front, define, env) in [
        ("cuda", "-DKVPOOL_STANDIN_CUDA", "KVPOOL_DEVMEM_CUDA_STANDIN"),
        ("acl", "-DKVPOOL_STANDIN_ACL", "KVPOOL_DEVMEM_ACL_STANDIN"),
    ] {
        let lib = out.join(format!("libkvpool_{front}_standin.so"));
        let mut cmd = cc.to_command();
        // Only the runtime's symbols and the test controls are exported (core.h marks them).
        // Never unloaded (as a runtime a process uses): stream workers may still be finishing
        // queued work after the last handle to the library is closed.
        let flags = ["-std=c11", "-shared", "-fPIC", "-fvisibility=hidden", "-O2", "-Wall", "-Wextra", "-pthread"];
        cmd.args(flags).args(["-Wl,-z,nodelete", define]);
        cmd.arg(dir.join("core.c")).arg(dir.join(format!("{front}.c"))).arg("-o").arg(&lib);
        let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        if !o.status.success() {
            panic!("building the {front} stand-in failed:\n{}", String::from_utf8_lossy(&o.stderr));
        }
        println!("cargo:rustc-env={env}={}", lib.display());
    }
}
