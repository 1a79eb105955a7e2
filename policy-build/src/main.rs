//! `kvpool-policy-build`: build policy crates into Wasm components.
//!
//! ```text
//! kvpool-policy-build --standard --out DIR
//! kvpool-policy-build --manifest-path path/to/Cargo.toml [-p NAME]... --out DIR [--target-dir DIR]
//! kvpool-policy-build --componentize core.wasm out.wasm
//! ```

use kvpool_policy_build::{build, componentize, default_target_dir, standard_manifest, BuildOptions};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: kvpool-policy-build (--standard | --manifest-path CARGO_TOML [-p NAME]...) --out DIR [--target-dir DIR]\n       kvpool-policy-build --componentize CORE.wasm OUT.wasm";

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut manifest = None;
    let mut out = None;
    let mut target_dir = None;
    let mut packages = Vec::new();
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| format!("{what} needs a value\n{USAGE}"));
        match a.as_str() {
            "--standard" => manifest = Some(standard_manifest()),
            "--manifest-path" => manifest = Some(PathBuf::from(value("--manifest-path")?)),
            "--out" => out = Some(PathBuf::from(value("--out")?)),
            "--target-dir" => target_dir = Some(PathBuf::from(value("--target-dir")?)),
            "-p" | "--package" => packages.push(value("-p")?),
            "--componentize" => {
                let input = PathBuf::from(value("--componentize")?);
                let output = PathBuf::from(value("--componentize")?);
                let core = std::fs::read(&input).map_err(|e| format!("{}: {e}", input.display()))?;
                let (kind, c) = componentize(&core).map_err(|e| e.to_string())?;
                std::fs::write(&output, c).map_err(|e| format!("{}: {e}", output.display()))?;
                println!("{} ({})", output.display(), kind.world());
                return Ok(());
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let manifest = manifest.ok_or_else(|| format!("--standard or --manifest-path is required\n{USAGE}"))?;
    let out = out.ok_or_else(|| format!("--out is required\n{USAGE}"))?;
    let mut opts = BuildOptions::new(manifest, out);
    opts.packages = packages;
    opts.target_dir = target_dir.unwrap_or_else(default_target_dir);
    for b in build(&opts).map_err(|e| e.to_string())? {
        println!("{} ({})", b.path.display(), b.kind.world());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvpool-policy-build: {e}");
            ExitCode::FAILURE
        }
    }
}
