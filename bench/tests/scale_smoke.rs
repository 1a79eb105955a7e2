//! CI smoke of `kvpool-bench scale`: the real binary fills a real server, kills an SSD-backed
//! one with SIGKILL and restarts it; the bench itself fails unless every chain is found and a
//! block read after the restart has its exact bytes.

use std::process::Command;

#[test]
fn scale_small_fill_lookup_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("scale.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool-bench"))
        .args(["scale", "--counts", "256,2K", "--restart-blocks", "6K", "--lookups", "50", "--json"])
        .arg(&json)
        .output()
        .expect("running kvpool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["blocks"].as_u64().unwrap()).collect::<Vec<_>>(), [256, 2048]);
    for r in rows {
        assert!(r["rss_bytes"].as_u64().unwrap() > v["empty_rss"].as_u64().unwrap() / 2);
        assert!(r["lookup_p99_us"].as_u64().unwrap() >= r["lookup_p50_us"].as_u64().unwrap());
    }
    let restart = &v["restart"];
    let on_ssd = restart["ssd_blocks"].as_u64().unwrap();
    // 1 MiB of DRAM keeps at most 4096 blocks of 64 B; the rest must have gone to SSD.
    assert!(on_ssd >= 6000 - 4096, "{restart}");
    // A crash may lose the records of sled's last flush window (by design), never more.
    let recovered = restart["recovered"].as_u64().unwrap();
    assert!(recovered <= on_ssd && recovered >= on_ssd - on_ssd / 20, "{restart}");
    assert!(v["goals"].as_array().unwrap().iter().any(|g| g.as_str().unwrap().contains("restart")));
}
