//! Builds the shared-memory stand-in of the shim ABI (always: tests load it), and the real shim
//! over CANN's HIXL only where CANN's headers are installed. A machine without CANN builds fine:
//! the real shim is then simply absent and `protocol = "ascend"` fails at run time with a message
//! naming it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    for f in ["shim/kvpool_hixl_shim.h", "shim/kvpool_hixl_shim.cc", "shim/standin.c"] {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME", "KVPOOL_HIXL_REQUIRE_SHIM"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));

    let standin = out.join("libkvpool_hixl_standin.so");
    shared_c(&standin, &[]).unwrap_or_else(|e| panic!("building the HIXL stand-in: {e}"));
    println!("cargo:rustc-env=KVPOOL_HIXL_STANDIN_LIB={}", standin.display());
    // The same library claiming another ABI version, to test that a mismatch is refused.
    let mismatched = out.join("libkvpool_hixl_standin_abi999.so");
    shared_c(&mismatched, &["-DKVPOOL_HIXL_STANDIN_ABI=999u"]).unwrap_or_else(|e| panic!("building the stand-in: {e}"));
    println!("cargo:rustc-env=KVPOOL_HIXL_STANDIN_ABI999_LIB={}", mismatched.display());

    match find_cann() {
        None => println!("cargo:rustc-env=KVPOOL_HIXL_BUILT_SHIM="),
        Some(cann) => {
            let shim = out.join("libkvpool_hixl_shim.so");
            match shared_cxx(&shim, &cann) {
                Ok(()) => println!("cargo:rustc-env=KVPOOL_HIXL_BUILT_SHIM={}", shim.display()),
                Err(e) if std::env::var_os("KVPOOL_HIXL_REQUIRE_SHIM").is_some() => {
                    panic!("CANN found at {} but the HIXL shim did not build: {e}", cann.display())
                }
                Err(e) => {
                    println!("cargo:warning=CANN found at {} but the HIXL shim did not build (set KVPOOL_HIXL_REQUIRE_SHIM=1 to make this fatal): {e}", cann.display());
                    println!("cargo:rustc-env=KVPOOL_HIXL_BUILT_SHIM=");
                }
            }
        }
    }
}

/// The CANN root whose `include/hixl/hixl.h` exists.
fn find_cann() -> Option<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for v in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(p) = std::env::var_os(v) {
            roots.push(p.into());
        }
    }
    if let Some(p) = std::env::var_os("ASCEND_HOME") {
        let p = PathBuf::from(p);
        roots.push(p.join("cann"));
        roots.push(p);
    }
    roots.into_iter().find(|r| r.join("include/hixl/hixl.h").is_file())
}

fn run(mut cmd: Command) -> Result<(), String> {
    let o = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed:\n{}", String::from_utf8_lossy(&o.stderr)))
    }
}

fn shared_c(out: &Path, defines: &[&str]) -> Result<(), String> {
    let cc = cc::Build::new().cargo_metadata(false).get_compiler();
    let mut cmd = cc.to_command();
    cmd.args(["-std=c11", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-pthread"]).args(defines);
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR")).join("shim");
    cmd.arg(format!("-I{}", dir.display())).arg(dir.join("standin.c")).arg("-o").arg(out).arg("-lrt");
    run(cmd)
}

fn shared_cxx(out: &Path, cann: &Path) -> Result<(), String> {
    let cxx = cc::Build::new().cpp(true).cargo_metadata(false).get_compiler();
    let lib64 = cann.join("lib64");
    // Newer CANN ships the runtime as libacl_rt.so, older as libascendcl.so.
    let acl = if lib64.join("libacl_rt.so").exists() { "-lacl_rt" } else { "-lascendcl" };
    let mut cmd = cxx.to_command();
    // HIXL's own samples build with the pre-C++11 string ABI; its API passes std containers.
    cmd.args(["-std=c++17", "-shared", "-fPIC", "-O2", "-Wall", "-D_GLIBCXX_USE_CXX11_ABI=0"]);
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR")).join("shim");
    cmd.arg(format!("-I{}", dir.display())).arg(format!("-I{}", cann.join("include").display()));
    cmd.arg(format!("-I{}", cann.join("include/external").display()));
    cmd.arg(dir.join("kvpool_hixl_shim.cc")).arg("-o").arg(out);
    cmd.arg(format!("-L{}", lib64.display())).arg(format!("-Wl,-rpath,{}", lib64.display()));
    cmd.args(["-lcann_hixl", acl, "-lpthread"]);
    run(cmd)
}
