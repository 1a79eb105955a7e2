//! Harness for the end-to-end tests: starts a real `kvpool-server` process on a temp data dir
//! with a generated config, and connects clients to it.

pub mod cluster;

use kvpool_client::{Client, ClientConfig, Trust};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ADMIN_KEY: &str = "test-admin-key";
pub const ALICE_KEY: &str = "test-alice-key";
pub const BOB_KEY: &str = "test-bob-key";

/// Path of a binary built by this workspace (`cargo build --bins` puts it beside `deps/`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: run `cargo build --bins` before the tests (the README test command does)",
        p.display()
    );
    p
}

fn sha(k: &str) -> String {
    hex::encode(Sha256::digest(k.as_bytes()))
}

/// Settings of a test server; `extra` is appended to the generated TOML.
#[derive(Clone, Debug)]
pub struct Opts {
    pub dram: &'static str,
    pub ssd: &'static str,
    /// Lines added to the `[cache]` table.
    pub cache: String,
    /// TOML appended at the end (new tables).
    pub extra: String,
    /// Run on another host: `(argv prefix, address)`, from [`kvpool_netns::Hosts::prefix`] and
    /// [`kvpool_netns::Hosts::ip`]. `None`: this host, on loopback.
    pub host: Option<(Vec<String>, String)>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts { dram: "256MiB", ssd: "0", cache: String::new(), extra: String::new(), host: None }
    }
}

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub opts: Opts,
    pub endpoint: serde_json::Value,
}

impl TestServer {
    pub fn start(opts: Opts) -> TestServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut s = TestServer { dir, child: None, opts, endpoint: serde_json::Value::Null };
        s.spawn();
        s
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("kvpool.toml")
    }

    fn spawn(&mut self) {
        let d = self.dir.path();
        // Started again, a server comes back at its address (clients reconnect to it).
        let ip = self.opts.host.as_ref().map_or("127.0.0.1", |(_, ip)| ip.as_str()).to_string();
        let listen = self.endpoint["quic_addr"].as_str().map_or(format!("{ip}:0"), str::to_string);
        let cfg = format!(
            r#"
[server]
listen = "{listen}"
metrics_listen = "{ip}:0"
data_dir = "{data}"

[dram]
size = "{dram}"

[ssd]
capacity = "{ssd}"

[cache]
eviction_interval_ms = 5
{cache}

[[auth.keys]]
tenant = "default"
sha256 = "{admin}"
admin = true

[[auth.keys]]
tenant = "alice"
sha256 = "{alice}"

[[auth.keys]]
tenant = "bob"
sha256 = "{bob}"
{extra}
"#,
            data = d.display(),
            dram = self.opts.dram,
            ssd = self.opts.ssd,
            admin = sha(ADMIN_KEY),
            alice = sha(ALICE_KEY),
            bob = sha(BOB_KEY),
            cache = self.opts.cache,
            extra = self.opts.extra,
        );
        std::fs::write(self.config_path(), cfg).expect("write config");
        let _ = std::fs::remove_file(d.join("endpoint.json"));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join("server.log")).expect("log file");
        let prefix = self.opts.host.as_ref().map_or(&[][..], |(p, _)| &p[..]);
        let child = kvpool_netns::command_at(prefix, bin("kvpool-server"))
            .arg("--config")
            .arg(self.config_path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvpool-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(text) = std::fs::read_to_string(d.join("endpoint.json")) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                    if v["pid"].as_u64() == self.child.as_ref().map(|c| c.id() as u64) {
                        self.endpoint = v;
                        return;
                    }
                }
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("server exited with {st}; log:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "server did not start; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    pub fn addr(&self) -> String {
        self.endpoint["quic_addr"].as_str().expect("quic_addr").to_string()
    }

    pub fn metrics_addr(&self) -> String {
        self.endpoint["metrics_addr"].as_str().expect("metrics_addr").to_string()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// A client configuration for `key`, on the transport the run asks for
    /// ([`test_transport`]).
    pub fn client_config(&self, key: &str) -> ClientConfig {
        let cert = PathBuf::from(self.endpoint["cert_path"].as_str().expect("cert_path"));
        let mut cfg = ClientConfig::new(self.addr(), key, Trust::CaFile(cert));
        cfg.transport = test_transport();
        cfg
    }

    /// A client configuration for `key` on transport `t`, whatever the run asks for.
    pub fn client_config_on(&self, key: &str, t: kvpool_client::TransportChoice) -> ClientConfig {
        let mut cfg = self.client_config(key);
        cfg.transport = t;
        cfg
    }

    pub async fn client(&self, key: &str) -> Client {
        Client::connect(self.client_config(key)).await.expect("connect")
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the process stays, its sockets open, and answers nothing (a hung node, or one
    /// whose host dropped off the network) until [`TestServer::thaw`].
    pub fn freeze(&self) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.pid() as i32, libc::SIGSTOP) };
    }

    /// SIGCONT after [`TestServer::freeze`].
    pub fn thaw(&self) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.pid() as i32, libc::SIGCONT) };
    }

    /// Graceful stop (SIGTERM), then start again on the same data dir.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub fn start_again(&mut self) {
        assert!(self.child.is_none());
        self.spawn();
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Resident set size of the server process, in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    }

    /// The Prometheus text from /metrics.
    pub fn scrape(&self) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.metrics_addr()).expect("metrics connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The data path end-to-end tests run their clients on: `KVPOOL_TEST_TRANSPORT` = `shm` (the
/// default; a same-host server must offer it) or `quic`. The suite runs once with each.
pub fn test_transport() -> kvpool_client::TransportChoice {
    match std::env::var("KVPOOL_TEST_TRANSPORT").as_deref() {
        Ok(v) => v.parse().expect("KVPOOL_TEST_TRANSPORT: auto, quic or shm"),
        Err(_) => kvpool_client::TransportChoice::Shm,
    }
}

/// Deterministic value for a key, so a reader can check bytes without remembering them.
pub fn value_for(key: &str, len: usize) -> Vec<u8> {
    let mut seed = u64::from_le_bytes(Sha256::digest(key.as_bytes())[..8].try_into().expect("8 bytes"));
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        // xorshift: cheap, deterministic filler
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.extend_from_slice(&seed.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Value of the metric line `name{labels} value`, summed over matching lines.
pub fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name_and_labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Build the standard policy components (and, with `malicious`, the misbehaving test modules)
/// from source, once per test binary; returns name -> component path.
pub fn components(malicious: bool) -> std::collections::HashMap<String, PathBuf> {
    use kvpool_policy_build::{build, repo_root, BuildOptions};
    let out = repo_root().join("target/policy-components");
    let mut map = std::collections::HashMap::new();
    let mut manifests = vec![kvpool_policy_build::standard_manifest()];
    if malicious {
        manifests.push(repo_root().join("policy-host/tests/malicious/Cargo.toml"));
    }
    for m in manifests {
        for b in build(&BuildOptions::new(m, &out)).expect("policy components build") {
            map.insert(b.name, b.path);
        }
    }
    map
}

/// A real etcd server (`etcd` on PATH: Debian's etcd-server) on free loopback ports, with its
/// data in a temp dir; killed when dropped.
pub struct EtcdServer {
    child: Child,
    _dir: tempfile::TempDir,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

impl EtcdServer {
    /// A running etcd, or `None` when `etcd` is not installed and `KVPOOL_REQUIRE_PEERS` is
    /// unset (a machine without `bench/peers/setup.sh etcd`); CI sets it, so there a missing
    /// etcd fails the test.
    pub fn start_or_skip() -> Option<EtcdServer> {
        let installed = Command::new("etcd").arg("--version").output().is_ok_and(|o| o.status.success());
        let required = std::env::var_os("KVPOOL_REQUIRE_PEERS").is_some_and(|v| !v.is_empty() && v != "0");
        if !installed && !required {
            eprintln!("etcd not installed and KVPOOL_REQUIRE_PEERS unset: skipping (bench/peers/setup.sh etcd)");
            return None;
        }
        Some(EtcdServer::start())
    }

    pub fn start() -> EtcdServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let (client, peer) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("log");
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd: install etcd-server (the CI script does)");
        let s = EtcdServer { child, _dir: dir, url };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            use std::io::{Read, Write};
            let healthy = std::net::TcpStream::connect(("127.0.0.1", client)).ok().and_then(|mut t| {
                t.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
                let mut out = String::new();
                t.read_to_string(&mut out).ok()?;
                out.contains("\"health\":\"true\"").then_some(())
            });
            if healthy.is_some() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy: {}",
                std::fs::read_to_string(s._dir.path().join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
