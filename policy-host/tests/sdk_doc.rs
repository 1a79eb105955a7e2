//! docs/POLICY-SDK.md, as written: its `file:` code blocks make two crates (eviction and
//! admission) that build into components, load, and answer through the guard without a fault;
//! and the example crate under `examples/` does the same.

mod common;

use common::Oracle;
use kvpool_policy_build::{build, BuildOptions, PolicyKind as BuiltKind};
use kvpool_policy_host::{GuardedAdmission, GuardedEviction, HostConfig, PolicyEngine, PolicyKind};
use kvpool_policy_sdk::{AdmissionPolicy, Admit, AdmitBatch, AdmitRequest, Event, Events, Params, Tier, NO_PARENT};
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
        ["my-policy/Cargo.toml", "my-policy/src/lib.rs", "my-admission/Cargo.toml", "my-admission/src/lib.rs"]
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
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let build_one = |name: &str, kind: BuiltKind| {
        let manifest = dir.path().join(name).join("Cargo.toml");
        let mut opts = BuildOptions::new(&manifest, dir.path().join("out"));
        opts.target_dir = kvpool_policy_build::default_target_dir().join("sdk-doc");
        let built = build(&opts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(built.len(), 1);
        assert_eq!((built[0].name.as_str(), built[0].kind), (name, kind));
        assert!(Path::new(&built[0].path).ends_with(format!("out/{name}.wasm")));
        std::fs::read(&built[0].path).unwrap()
    };

    // Section 6: the FIFO eviction policy.
    let wasm = build_one("my-policy", BuiltKind::Eviction);
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

    // Section 7: the admission policy, with and without its string parameter.
    let wasm = build_one("my-admission", BuiltKind::Admission);
    let put = |id, key, tier| -> AdmitBatch {
        [AdmitRequest::new(id, 1, 512, 512, tier, NO_PARENT).with_key(key)].into_iter().collect()
    };
    let miss: Events = [Event::missed(42, 0, NO_PARENT)].into_iter().collect();
    let m = engine.load("my-admission", PolicyKind::Admission, &wasm, &Params::new()).unwrap();
    let fallback = Box::new(kvpool_policies::ThresholdAdmission::new(0));
    let mut g = GuardedAdmission::new(&m, fallback.clone(), &Events::new()).unwrap();
    g.on_events(&miss);
    assert_eq!(g.admit(&put(1, 42, Tier::Dram)), vec![Admit::Reject]);
    g.on_events(&miss);
    assert_eq!(g.admit(&put(2, 42, Tier::Dram)), vec![Admit::Into(Tier::Dram)]);
    let m = engine.load("my-admission", PolicyKind::Admission, &wasm, &Params::from_pairs([("tier", "ssd")])).unwrap();
    let mut g = GuardedAdmission::new(&m, fallback.clone(), &Events::new()).unwrap();
    assert_eq!(g.admit(&put(3, 7, Tier::Dram)), vec![Admit::Into(Tier::Dram)]);
    assert_eq!(g.admit(&put(4, 7, Tier::Ssd)), vec![Admit::Reject]);
    assert_eq!(g.faults().total(), 0);
    let refused = engine.load("my-admission", PolicyKind::Admission, &wasm, &Params::from_pairs([("tier", "tape")]));
    let refused = refused.and_then(|m| GuardedAdmission::new(&m, fallback, &Events::new()));
    assert!(refused.is_err(), "a bad parameter refuses the module");
}

/// `examples/prefix-guard`, an outside-style crate: builds, loads, and keeps a shared prefix
/// through the guard.
#[test]
fn example_crate_builds_loads_and_answers() {
    let repo = kvpool_policy_build::repo_root();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = BuildOptions::new(repo.join("examples/prefix-guard/Cargo.toml"), dir.path());
    opts.target_dir = kvpool_policy_build::default_target_dir().join("examples");
    let built = build(&opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((built[0].name.as_str(), built[0].kind), ("prefix-guard", BuiltKind::Eviction));
    let engine = PolicyEngine::new(HostConfig::default()).unwrap();
    let wasm = std::fs::read(&built[0].path).unwrap();
    let m =
        engine.load("prefix-guard", PolicyKind::Eviction, &wasm, &Params::from_pairs([("min_fanout", "2")])).unwrap();
    // A prompt (1) with two conversations under it (2 <- 3, and 4), and an older chain 5 <- 6.
    let ev: Events = [
        Event::inserted(5, 10, Tier::Dram, NO_PARENT).with_key(500).with_depth(0).with_time(1),
        Event::inserted(6, 10, Tier::Dram, 5).with_key(600).with_depth(1).with_time(2),
        Event::inserted(1, 10, Tier::Dram, NO_PARENT).with_key(100).with_depth(0).with_time(3),
        Event::inserted(2, 10, Tier::Dram, 1).with_key(200).with_depth(1).with_time(4),
        Event::inserted(3, 10, Tier::Dram, 2).with_key(300).with_depth(2).with_time(5),
        Event::inserted(4, 10, Tier::Dram, 1).with_key(400).with_depth(1).with_time(6),
    ]
    .into_iter()
    .collect();
    let mut oracle = Oracle::default();
    oracle.apply(&ev);
    let mut g = GuardedEviction::new(&m, Box::new(kvpool_policies::LeafLru::new()), &Events::new()).unwrap();
    g.on_events(&ev);
    assert_eq!(g.victims(&oracle, Tier::Dram, 60, &[]), vec![6, 5, 3, 2, 4, 1]);
    assert_eq!(g.faults().total(), 0);
}
