//! CI smoke of `kvpool-bench throughput`: the real binary, a self-started kvpool server and a
//! self-started Redis, tiny sizes. Keeps the harness and the peer plumbing from rotting.
//!
//! Redis may be skipped only when `redis-server` is missing AND `KVPOOL_REQUIRE_PEERS` is unset;
//! CI sets it (and installs Redis with `bench/peers/setup.sh redis`), so there a missing Redis fails.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

fn redis_installed() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("redis-server").is_file()))
        .unwrap_or(false)
}

#[test]
fn throughput_quick_kvpool_and_redis() {
    let require_peers = std::env::var_os("KVPOOL_REQUIRE_PEERS").is_some_and(|v| !v.is_empty() && v != "0");
    let with_redis = require_peers || redis_installed();
    if !with_redis {
        eprintln!("redis-server not installed and KVPOOL_REQUIRE_PEERS unset: smoking kvpool only");
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let targets = if with_redis { "kvpool,redis" } else { "kvpool" };
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_kvpool-bench"));
    let mut cmd = Command::new(&bin);
    cmd.args(["throughput", "--quick", "--targets", targets, "--json"]).arg(&json);
    if with_redis {
        // A missing redis-server must fail here, not be reported as skipped.
        cmd.args(["--require", "redis"]);
    }
    let out = cmd.output().expect("running kvpool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvpool-bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written")).expect("JSON parses");
    let rows = report["rows"].as_array().expect("rows");
    let mut per_target: BTreeMap<String, usize> = BTreeMap::new();
    for r in rows {
        let t = r["target"].as_str().expect("target").to_string();
        let mbs = r["result"]["mb_per_s"].as_f64().expect("mb_per_s");
        assert!(mbs > 0.0, "non-positive MB/s in {r}");
        assert!(r["memcpy"]["mb_per_s"].as_f64().expect("memcpy") > 0.0, "memcpy baseline missing in {r}");
        assert!(r["result"]["p99_us"].as_u64().expect("p99") >= r["result"]["p50_us"].as_u64().expect("p50"));
        *per_target.entry(t).or_default() += 1;
    }
    // --quick: 2 sizes x 2 batches x 2 concurrencies x (put, get).
    assert_eq!(per_target.get("kvpool"), Some(&16), "kvpool rows: {per_target:?}");
    if with_redis {
        assert_eq!(per_target.get("redis"), Some(&16), "redis rows: {per_target:?}");
        assert!(stdout.lines().any(|l| l.starts_with("redis ")), "no redis row on stdout:\n{stdout}");
    }
    assert!(stdout.lines().any(|l| l.starts_with("kvpool ")), "no kvpool row on stdout:\n{stdout}");
}

#[test]
fn required_peer_that_is_missing_is_an_error() {
    // An interpreter that cannot import mooncake makes the Mooncake peer unavailable on any machine.
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool-bench"))
        .args([
            "throughput",
            "--quick",
            "--targets",
            "mooncake",
            "--require",
            "mooncake",
            "--python",
            "/nonexistent/python",
        ])
        .output()
        .expect("running kvpool-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("required target mooncake"), "stderr:\n{stderr}");
}

#[test]
fn missing_peer_is_skipped_when_not_required() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool-bench"))
        .args(["throughput", "--quick", "--targets", "mooncake", "--python", "/nonexistent/python", "--json"])
        .arg(&json)
        .output()
        .expect("running kvpool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("skipped mooncake"), "stdout:\n{stdout}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["skipped"][0]["target"], "mooncake");
    assert!(report["rows"].as_array().unwrap().is_empty());
}

fn mooncake_installed() -> bool {
    Command::new("python3").args(["-c", "import mooncake.store"]).output().is_ok_and(|o| o.status.success())
}

/// Mooncake over TCP and over its own same-host path (a dummy client of `mooncake_client`),
/// beside kvpool over shm: every system really moves the batches, and the same-host goal is
/// measured. CI installs Mooncake (bench/peers/setup.sh) and sets KVPOOL_REQUIRE_PEERS.
#[test]
fn throughput_mooncake_tcp_and_shm_beside_kvpool_shm() {
    let require_peers = std::env::var_os("KVPOOL_REQUIRE_PEERS").is_some_and(|v| !v.is_empty() && v != "0");
    if !require_peers && !mooncake_installed() {
        eprintln!("mooncake not installed and KVPOOL_REQUIRE_PEERS unset: skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool-bench"))
        .args([
            "throughput",
            "--sizes",
            "1MiB",
            "--batches",
            "64",
            "--concurrency",
            "1,2",
            "--budget",
            "64MiB",
            "--min-ops",
            "1",
            "--targets",
            "kvpool-shm,mooncake,mooncake-shm",
            "--require",
            "mooncake,mooncake-shm",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("running kvpool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvpool-bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written")).expect("JSON parses");
    let mut per_target: BTreeMap<String, usize> = BTreeMap::new();
    for r in report["rows"].as_array().expect("rows") {
        assert!(r["result"]["mb_per_s"].as_f64().expect("mb_per_s") > 0.0, "non-positive MB/s in {r}");
        *per_target.entry(r["target"].as_str().expect("target").to_string()).or_default() += 1;
    }
    // 1 size x 1 batch x 2 concurrencies x (put, get) each.
    for t in ["kvpool-shm", "mooncake", "mooncake-shm"] {
        assert_eq!(per_target.get(t), Some(&4), "{t} rows: {per_target:?}");
    }
    let peers = report["peers"].as_array().expect("peers");
    assert!(peers.iter().any(|p| p.as_str().unwrap_or("").contains("mooncake_client")), "peers: {peers:?}");
    let goals = report["goals"].as_array().expect("goals");
    for op in ["get", "put"] {
        let g = goals
            .iter()
            .find(|g| {
                g["goal"].as_str().unwrap_or("").starts_with(&format!("shm 1MiB x64 {op}: kvpool-shm / Mooncake shm"))
            })
            .unwrap_or_else(|| panic!("no same-host goal for {op}: {goals:?}"));
        assert!(g["measured"].as_f64().is_some_and(|m| m > 0.0), "same-host {op} goal not measured: {g}");
    }
}
