//! A cluster of real processes on 127.0.0.1 for the tests: a master and storage nodes, and
//! what the cluster tests do with them (chains put and read back, waits on the master's view).

use crate::{value_for, Opts, TestServer, ADMIN_KEY};
use kvpool_client::proto::NodeInfo;
use kvpool_client::{ClientConfig, ClusterClient, ErrorCode, PutEntry, PutMode, PutOptions, Trust};
use std::time::{Duration, Instant};

pub const REPORT_MS: u64 = 100;
// Generous: five cluster tests share two cores in CI, and a node must not be declared dead for
// a slow report.
pub const TIMEOUT_MS: u64 = 2000;

pub struct Cluster {
    pub master: TestServer,
    pub nodes: Vec<TestServer>,
    /// Holds the master's admin key file for the storage nodes.
    pub keys: tempfile::TempDir,
}

pub fn master() -> TestServer {
    TestServer::start(Opts {
        dram: "1MiB",
        extra: format!("[cluster]\nrole = \"master\"\nreport_ms = {REPORT_MS}\nnode_timeout_ms = {TIMEOUT_MS}\n"),
        ..Opts::default()
    })
}

pub fn storage(
    master: &TestServer,
    key_file: &std::path::Path,
    name: &str,
    dram: &'static str,
    ssd: &'static str,
) -> TestServer {
    let extra = format!(
        "[cluster]\nrole = \"storage\"\nmaster = \"{}\"\nmaster_fingerprint = \"{}\"\nmaster_key_file = \"{}\"\nnode_name = \"{name}\"\n",
        master.addr(),
        master.endpoint["fingerprint"].as_str().expect("fingerprint"),
        key_file.display()
    );
    TestServer::start(Opts { dram, ssd, extra, ..Opts::default() })
}

pub fn cluster(n: usize, dram: &'static str, ssd: &'static str) -> Cluster {
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("master-key");
    std::fs::write(&key_file, format!("{ADMIN_KEY}\n")).unwrap();
    let master = master();
    let nodes = (0..n).map(|i| storage(&master, &key_file, &format!("s{i}"), dram, ssd)).collect();
    Cluster { master, nodes, keys }
}

impl Cluster {
    pub fn config(&self, key: &str) -> ClientConfig {
        let cert = std::path::PathBuf::from(self.master.endpoint["cert_path"].as_str().unwrap());
        let mut cfg = ClientConfig::new(self.master.addr(), key, Trust::CaFile(cert));
        cfg.transport = crate::test_transport();
        // A killed node must not hold a request for long.
        cfg.request_timeout = Duration::from_secs(3);
        // Eight clusters share two cores under CI: a live node busy past the default 250 ms
        // would be taken for dead and its blocks read as misses. The test of a silent node
        // sets its own bound.
        cfg.node_answer_within = Duration::from_secs(1);
        cfg
    }

    pub async fn client(&self, key: &str) -> ClusterClient {
        ClusterClient::connect(self.config(key)).await.expect("connect to the master")
    }

    pub fn key_file(&self) -> std::path::PathBuf {
        self.keys.path().join("master-key")
    }
}

/// Wait until `ok` holds of the master's node list.
pub async fn nodes_until(c: &ClusterClient, what: &str, ok: impl Fn(&[NodeInfo]) -> bool) -> Vec<NodeInfo> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = c.nodes().await.expect("nodes");
        if ok(&n) {
            return n;
        }
        assert!(Instant::now() < deadline, "{what}: nodes are {n:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until the master routes every key (the nodes report their puts a moment later).
pub async fn visible(c: &ClusterClient, keys: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = c.route(keys).await.expect("route");
        if r.items.iter().all(|n| !n.is_empty()) {
            return;
        }
        assert!(Instant::now() < deadline, "the master never learnt of every put: {:?}", r.items);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn chain(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

pub async fn put_chain(c: &ClusterClient, keys: &[String], size: usize, replicas: u32) -> Vec<ErrorCode> {
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, size)).collect();
    let entries: Vec<PutEntry<'_>> = keys
        .iter()
        .zip(&values)
        .enumerate()
        .map(|(i, (k, v))| PutEntry {
            key: k.as_bytes(),
            value: v,
            opts: PutOptions {
                parent: (i > 0).then(|| keys[i - 1].as_bytes().to_vec()),
                tokens: 16,
                ..Default::default()
            },
        })
        .collect();
    c.put_batch(&entries, PutMode::Insert, replicas).await.expect("put")
}

pub async fn read_back(c: &ClusterClient, keys: &[String], size: usize) -> Vec<ErrorCode> {
    let got = c.get_batch(keys).await.expect("get");
    keys.iter()
        .zip(got)
        .map(|(k, g)| {
            if g.status == ErrorCode::Ok {
                assert!(g.value.as_deref() == Some(value_for(k, size).as_slice()), "{k}: wrong bytes");
            }
            g.status
        })
        .collect()
}
