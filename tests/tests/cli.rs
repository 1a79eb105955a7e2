//! The `kvpool` CLI against a real server, and the embedded-default quick start.

use kvpool_tests::{bin, components, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY};
use std::io::Write;
use std::process::{Command, Output, Stdio};

fn kvpool(srv: &TestServer, key: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(bin("kvpool"));
    cmd.env_clear()
        .env("KVPOOL_SERVER", srv.addr())
        .env("KVPOOL_API_KEY", key)
        .env("KVPOOL_CA", srv.endpoint["cert_path"].as_str().unwrap())
        .current_dir(srv.data_dir())
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(data) = stdin {
        child.stdin.take().unwrap().write_all(data).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "exit {:?}: {}", o.status.code(), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn cli_put_get_lookup_exists_rm_stats_ping_and_errors() {
    let srv = TestServer::start(Opts::default());
    let big = value_for("big", 3 << 20);
    let file = srv.data_dir().join("big.bin");
    std::fs::write(&file, &big).unwrap();
    ok(&kvpool(&srv, ADMIN_KEY, &["put", "big", file.to_str().unwrap()], None));
    ok(&kvpool(&srv, ADMIN_KEY, &["put", "child", "-", "--parent", "big", "--tokens", "16"], Some(b"from stdin")));
    let out = srv.data_dir().join("out.bin");
    ok(&kvpool(&srv, ADMIN_KEY, &["get", "big", "-o", out.to_str().unwrap()], None));
    assert!(std::fs::read(&out).unwrap() == big);
    let got = kvpool(&srv, ADMIN_KEY, &["get", "child"], None);
    assert_eq!(got.stdout, b"from stdin");
    assert!(ok(&kvpool(&srv, ADMIN_KEY, &["lookup", "big", "child", "nope"], None)).contains('2'));
    let e = kvpool(&srv, ADMIN_KEY, &["exists", "big", "nope"], None);
    assert_eq!(e.status.code(), Some(3), "a missing key is exit 3");
    let stats = ok(&kvpool(&srv, ADMIN_KEY, &["stats", "--json"], None));
    let v: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(v["blocks"], 2);
    assert!(!ok(&kvpool(&srv, ADMIN_KEY, &["stats"], None)).is_empty());
    ok(&kvpool(&srv, ADMIN_KEY, &["ping", "-c", "2"], None));

    // errors: one line, non-zero exit
    let dup = kvpool(&srv, ADMIN_KEY, &["put", "big", "-"], Some(b"x"));
    assert!(!dup.status.success());
    let msg = String::from_utf8_lossy(&dup.stderr);
    assert_eq!(msg.trim().lines().count(), 1, "{msg}");
    assert!(msg.contains("already-exists"), "{msg}");
    let bad = kvpool(&srv, "wrong-key", &["ping"], None);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unauthorized"));
    let missing = kvpool(&srv, ADMIN_KEY, &["get", "nope"], None);
    assert_eq!(missing.status.code(), Some(3));

    ok(&kvpool(&srv, ADMIN_KEY, &["get", "big", "-o", "/dev/null"], None));
    let leased = kvpool(&srv, ADMIN_KEY, &["rm", "big"], None);
    assert!(String::from_utf8_lossy(&leased.stderr).contains("leased"));
    ok(&kvpool(&srv, ADMIN_KEY, &["rm", "big", "--force"], None));
    ok(&kvpool(&srv, ADMIN_KEY, &["rm", "--all", "--force"], None));
    let v: serde_json::Value = serde_json::from_str(&ok(&kvpool(&srv, ADMIN_KEY, &["stats", "--json"], None))).unwrap();
    assert_eq!(v["blocks"], 0);
}

#[test]
fn cli_policy_load_list_rollback() {
    let comps = components(false);
    let srv = TestServer::start(Opts::default());
    let sieve = comps["sieve"].to_str().unwrap().to_string();
    let denied = kvpool(&srv, ALICE_KEY, &["policy", "load", "eviction", &sieve], None);
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );
    ok(&kvpool(&srv, ADMIN_KEY, &["policy", "load", "eviction", &sieve, "--name", "my-sieve"], None));
    let threshold = comps["threshold"].to_str().unwrap().to_string();
    ok(&kvpool(&srv, ADMIN_KEY, &["policy", "load", "admission", &threshold, "--param", "store_threshold=64"], None));
    let list: serde_json::Value =
        serde_json::from_str(&ok(&kvpool(&srv, ADMIN_KEY, &["policy", "list", "--json"], None))).unwrap();
    let text = list.to_string();
    assert!(text.contains("my-sieve") && text.contains("store_threshold"), "{text}");
    ok(&kvpool(&srv, ADMIN_KEY, &["policy", "rollback", "eviction"], None));
    let human = ok(&kvpool(&srv, ADMIN_KEY, &["policy", "list"], None));
    assert!(human.contains("builtin"), "{human}");
}

#[test]
fn embedded_default_quick_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("kvpool-data");
    let mut server = Command::new(bin("kvpool-server"))
        .current_dir(dir.path())
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "off", "--dram-size", "64MiB"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !data.join("endpoint.json").exists() {
        assert!(std::time::Instant::now() < deadline, "embedded default did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let key = std::fs::read_to_string(data.join("api-key")).unwrap();
    assert!(key.trim().len() > 20);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(data.join("api-key")).unwrap().permissions().mode() & 0o077, 0, "key is owner-only");
    let run =
        |args: &[&str]| Command::new(bin("kvpool")).env_clear().current_dir(dir.path()).args(args).output().unwrap();
    let r = run(&["--data-dir", "kvpool-data", "ping"]);
    let r2 = run(&["--data-dir", "kvpool-data", "stats"]);
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let status = server.wait().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(r2.status.success(), "{}", String::from_utf8_lossy(&r2.stderr));
    assert!(status.success(), "graceful shutdown on SIGTERM");
}

/// docs/POLICY-SDK.md as written: its `file:` blocks make a crate, `kvpool-policy-build` turns
/// it into a component, and the `# walkthrough:` commands load it and roll it back on a server.
#[test]
fn policy_sdk_walkthrough_as_written() {
    let repo = kvpool_policy_build::repo_root();
    let doc = std::fs::read_to_string(repo.join("docs/POLICY-SDK.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut commands = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        if !l.starts_with("```") || l.trim() == "```" {
            continue;
        }
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        let Some(first) = body.first() else { continue };
        if let Some(rel) = first.strip_prefix("# file: ").or_else(|| first.strip_prefix("// file: ")) {
            let text = body[1..].join("\n") + "\n";
            // The doc assumes a kvpool checkout beside the crate; point at this one.
            let text = text
                .replace("path = \"../kvpool/sdk\"", &format!("path = {:?}", repo.join("sdk").display().to_string()));
            let p = dir.path().join("work").join(rel.trim());
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        } else if first.starts_with("# walkthrough:") {
            commands.extend(body[1..].iter().map(|c| c.to_string()));
        }
    }
    assert!(commands.len() >= 3, "{commands:?}");
    // section 5, with the doc's relative layout (kvpool beside my-policy, out beside both)
    let mut opts = kvpool_policy_build::BuildOptions::new(
        dir.path().join("work/my-policy/Cargo.toml"),
        dir.path().join("work/out"),
    );
    opts.target_dir = kvpool_policy_build::default_target_dir().join("sdk-doc-cli");
    let built = kvpool_policy_build::build(&opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(built[0].name, "my-policy");
    let srv = TestServer::start(Opts::default());
    let cwd = dir.path().join("work/kvpool");
    std::fs::create_dir_all(&cwd).unwrap();
    for c in &commands {
        let words: Vec<&str> = c.split_whitespace().collect();
        assert_eq!(words[0], "kvpool", "{c}");
        let o = Command::new(bin("kvpool"))
            .env_clear()
            .env("KVPOOL_SERVER", srv.addr())
            .env("KVPOOL_API_KEY", ADMIN_KEY)
            .env("KVPOOL_CA", srv.endpoint["cert_path"].as_str().unwrap())
            .current_dir(&cwd)
            .args(&words[1..])
            .output()
            .unwrap();
        assert!(o.status.success(), "{c}: {}", String::from_utf8_lossy(&o.stderr));
        if c.contains("policy list") {
            assert!(String::from_utf8_lossy(&o.stdout).contains("my-policy"));
        }
    }
}
