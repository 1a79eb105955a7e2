//! docs/POLICY-SDK.md, as written: its `file:` code blocks make a crate that builds into a
//! component, loads, and answers through the guard without a fault.

mod common;

use common::Oracle;
use kvpool_policy_build::{build, BuildOptions, PolicyKind as BuiltKind};
use kvpool_policy_host::{GuardedEviction, HostConfig, PolicyEngine, PolicyKind};
use kvpool_policy_sdk::{Event, Events, Params, Tier, NO_PARENT};
use std::path::Path;

/// (relative path, contents) of every fenced block whose first line is `# file: P` or `// file: P`.
fn doc_files(doc: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        if !l.starts_with("```") || l.trim() == "```" {
            continue;
        }
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        if let Some(first) = body.first() {
            let path = first.strip_prefix("# file: ").or_else(|| first.strip_prefix("// file: "));
            if let Some(p) = path {
                out.push((p.trim().to_string(), body[1..].join("\n") + "\n"));
            }
        }
    }
    out
}

#[test]
fn walkthrough_builds_loads_and_answers() {
    let repo = kvpool_policy_build::repo_root();
    let doc = std::fs::read_to_string(repo.join("docs/POLICY-SDK.md")).unwrap();
    let files = doc_files(&doc);
    assert_eq!(
        files.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(),
        ["my-policy/Cargo.toml", "my-policy/src/lib.rs"]
    );
    let dir = tempfile::tempdir().unwrap();
    for (rel, text) in &files {
        // The doc assumes a kvpool checkout beside the crate; point at this one.
        let text =
            text.replace("path = \"../kvpool/sdk\"", &format!("path = {:?}", repo.join("sdk").display().to_string()));
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let manifest = dir.path().join("my-policy/Cargo.toml");
    let mut opts = BuildOptions::new(&manifest, dir.path().join("out"));
    opts.target_dir = kvpool_policy_build::default_target_dir().join("sdk-doc");
    let built = build(&opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(built.len(), 1);
    assert_eq!((built[0].name.as_str(), built[0].kind), ("my-policy", BuiltKind::Eviction));
    assert!(Path::new(&built[0].path).ends_with("out/my-policy.wasm"));

    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let wasm = std::fs::read(&built[0].path).unwrap();
    let m =
        engine.load("my-policy", PolicyKind::Eviction, &wasm, &Params::from_pairs([("protect_newest", "1")])).unwrap();
    let mut oracle = Oracle::default();
    let ev: Events = (1..=3).map(|i| Event::inserted(i, 10, Tier::Dram, NO_PARENT)).collect();
    oracle.apply(&ev);
    let mut g = GuardedEviction::new(&m, Box::new(kvpool_policies::LeafLru::new()), &Events::new()).unwrap();
    g.on_events(&ev);
    assert_eq!(g.victims(&oracle, Tier::Dram, 20, &[]), vec![1, 2]);
    assert_eq!(g.victims(&oracle, Tier::Dram, 20, &[1]), vec![2, 3]);
    assert_eq!(g.faults().total(), 0);
}
