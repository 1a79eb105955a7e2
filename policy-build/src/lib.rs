//! Builds kvpool policy crates into Wasm components, from source.
//!
//! A policy crate is a `cdylib` using `kvpool-policy-sdk`'s export macros. This runs
//! `cargo build --release --target wasm32-unknown-unknown` on it with the guest profile (passed
//! as `--config` so it applies to any crate), in a target dir of its own (a nested cargo must
//! not wait on the outer build's lock), then turns each core module into a component with
//! `wit-component`, embedding the one `kvpool:policy` world the module exports.

use std::path::{Path, PathBuf};
use std::process::Command;
use wit_component::{ComponentEncoder, StringEncoding};
use wit_parser::Resolve;

/// The WIT package, compiled in so the builder works from any directory.
pub const POLICY_WIT: &str = include_str!("../../wit/policy.wit");

/// Kind of policy a module implements (the world it exports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Eviction,
    Admission,
    Placement,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Eviction, PolicyKind::Admission, PolicyKind::Placement];

    /// The WIT world name.
    pub fn world(self) -> &'static str {
        match self {
            PolicyKind::Eviction => "eviction",
            PolicyKind::Admission => "admission",
            PolicyKind::Placement => "placement",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot run cargo: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("cargo build of {manifest} failed:\n{stderr}")]
    Cargo { manifest: String, stderr: String },
    #[error("cargo built no cdylib .wasm for {0}")]
    NoArtifact(String),
    #[error("io error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bad cargo message: {0}")]
    Message(String),
    #[error("not a kvpool policy module (exports none of the eviction/admission/placement worlds): {0}")]
    NotAPolicy(String),
    #[error("wit: {0}")]
    Wit(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BuildError + '_ {
    move |source| BuildError::Io { path: path.display().to_string(), source }
}

/// Turn a core module built with the SDK into a component, detecting its kind.
///
/// The SDK's bindings embed metadata for the imports of all three worlds and the export macro
/// adds the exported world; rather than depend on how those merge, the metadata is stripped and
/// the exact world embedded again, trying each kind: only the kind whose exports the module
/// has can be encoded.
pub fn componentize(core: &[u8]) -> Result<(PolicyKind, Vec<u8>), BuildError> {
    let (stripped, _) = wit_component::metadata::decode(core).map_err(|e| BuildError::NotAPolicy(format!("{e:#}")))?;
    let stripped = stripped.unwrap_or_else(|| core.to_vec());
    let mut resolve = Resolve::default();
    let pkg = resolve.push_str("policy.wit", POLICY_WIT).map_err(|e| BuildError::Wit(format!("{e:#}")))?;
    let mut errors = Vec::new();
    for kind in PolicyKind::ALL {
        let world = resolve.select_world(&[pkg], Some(kind.world())).map_err(|e| BuildError::Wit(format!("{e:#}")))?;
        let mut module = stripped.clone();
        wit_component::embed_component_metadata(&mut module, &resolve, world, StringEncoding::UTF8, false)
            .map_err(|e| BuildError::Wit(format!("{e:#}")))?;
        let encoded = ComponentEncoder::default().module(&module).and_then(|e| e.validate(true).encode());
        match encoded {
            Ok(c) => return Ok((kind, c)),
            Err(e) => errors.push(format!("{}: {e:#}", kind.world())),
        }
    }
    Err(BuildError::NotAPolicy(errors.join("; ")))
}

/// One component written by [`build`].
#[derive(Debug, Clone)]
pub struct Built {
    /// Crate name (the output file is `<name>.wasm`).
    pub name: String,
    pub kind: PolicyKind,
    pub path: PathBuf,
}

#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// `Cargo.toml` of a policy crate, or of a workspace of policy crates.
    pub manifest: PathBuf,
    /// Packages to build (`-p`); empty builds the manifest's default members.
    pub packages: Vec<String>,
    /// Cargo target dir for the guest build (must not be the caller's own).
    pub target_dir: PathBuf,
    /// Where `<name>.wasm` components are written.
    pub out_dir: PathBuf,
}

impl BuildOptions {
    pub fn new(manifest: impl Into<PathBuf>, out_dir: impl Into<PathBuf>) -> BuildOptions {
        BuildOptions {
            manifest: manifest.into(),
            packages: Vec::new(),
            target_dir: default_target_dir(),
            out_dir: out_dir.into(),
        }
    }
}

/// Root of this repository (where the workspace `Cargo.toml` is).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("policy-build is in the repo").to_path_buf()
}

/// Manifest of the standard policies' guest workspace.
pub fn standard_manifest() -> PathBuf {
    repo_root().join("policies/wasm/Cargo.toml")
}

/// `target/policy-wasm` under the repo: beside, not inside, the host build's profile dirs.
pub fn default_target_dir() -> PathBuf {
    repo_root().join("target/policy-wasm")
}

/// Guest profile, as `--config` so it holds for crates outside our workspaces too.
const GUEST_PROFILE: [&str; 5] = [
    "profile.release.opt-level=3",
    "profile.release.lto=true",
    "profile.release.codegen-units=1",
    "profile.release.strip=true",
    "profile.release.panic=\"abort\"",
];

/// Build the crates and write one component per cdylib to `out_dir`.
pub fn build(opts: &BuildOptions) -> Result<Vec<Built>, BuildError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build").arg("--release").arg("--target").arg("wasm32-unknown-unknown");
    cmd.arg("--message-format=json-render-diagnostics");
    cmd.arg("--manifest-path").arg(&opts.manifest);
    cmd.arg("--target-dir").arg(&opts.target_dir);
    for c in GUEST_PROFILE {
        cmd.arg("--config").arg(c);
    }
    for p in &opts.packages {
        cmd.arg("-p").arg(p);
    }
    // Settings of an outer cargo (we may run inside `cargo test`) must not leak into the guest
    // build: host rustflags do not fit wasm32, and the target dir is ours.
    for v in [
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
    ] {
        cmd.env_remove(v);
    }
    tracing::info!(manifest = %opts.manifest.display(), "building policy components");
    let out = cmd.output().map_err(BuildError::Spawn)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(60).collect();
        return Err(BuildError::Cargo {
            manifest: opts.manifest.display().to_string(),
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    std::fs::create_dir_all(&opts.out_dir).map_err(io(&opts.out_dir))?;
    let mut built = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let msg: serde_json::Value = serde_json::from_str(line).map_err(|e| BuildError::Message(e.to_string()))?;
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let is_cdylib = msg["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "cdylib"));
        if !is_cdylib {
            continue;
        }
        let Some(files) = msg["filenames"].as_array() else { continue };
        for f in files.iter().filter_map(|f| f.as_str()).filter(|f| f.ends_with(".wasm")) {
            let name = msg["target"]["name"].as_str().unwrap_or("policy").replace('_', "-");
            let core_path = PathBuf::from(f);
            let core = std::fs::read(&core_path).map_err(io(&core_path))?;
            let (kind, component) = componentize(&core)?;
            let path = opts.out_dir.join(format!("{name}.wasm"));
            // Write then rename: concurrent test binaries may build the same set.
            // Unique per process and per call: test threads of one process build the same set too.
            static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tmp = opts.out_dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
            std::fs::write(&tmp, &component).map_err(io(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(io(&path))?;
            tracing::info!(name, kind = kind.world(), bytes = component.len(), "built policy component");
            built.push(Built { name, kind, path });
        }
    }
    if built.is_empty() {
        return Err(BuildError::NoArtifact(opts.manifest.display().to_string()));
    }
    Ok(built)
}

/// Build the standard policies into `out_dir`.
pub fn build_standard(out_dir: &Path) -> Result<Vec<Built>, BuildError> {
    build(&BuildOptions::new(standard_manifest(), out_dir))
}
