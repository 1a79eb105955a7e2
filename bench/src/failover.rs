//! `kvpool-bench cluster-failover`: a real etcd, two masters and two storage nodes on this host;
//! the leader is killed again and again, and each time the bench measures how long until a
//! client of the cluster answers a full lookup again (through etcd, never the request timeout).

use crate::cluster::{cluster_auth, KEY};
use crate::target::LocalServer;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvpool_client::{ClientConfig, ClusterClient, ErrorCode, PutEntry, PutMode, PutOptions};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct FailoverArgs {
    /// Leader kills to measure
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Client request timeout in ms (how long a request waits on a master that died)
    #[arg(long, default_value_t = 1000)]
    pub request_timeout_ms: u64,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A real etcd on free loopback ports, killed on drop.
struct Etcd {
    child: std::process::Child,
    _dir: tempfile::TempDir,
    url: String,
}

impl Etcd {
    fn start() -> Result<Etcd> {
        let dir = tempfile::tempdir()?;
        let port = || -> Result<u16> { Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
        let (client, peer) = (port()?, port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = std::process::Command::new("etcd")
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting etcd (install etcd-server: bench/peers/setup.sh etcd)")?;
        let e = Etcd { child, _dir: dir, url };
        let etcd = kvpool_etcd::Etcd::new(&e.url)?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let start = Instant::now();
        while rt.block_on(etcd.get(b"probe")).is_err() {
            if start.elapsed().as_secs() > 20 {
                bail!("etcd did not answer within 20 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(e)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Serialize)]
struct FailoverReport {
    kills: usize,
    leader_ttl_s: u32,
    request_timeout_ms: u64,
    /// Per kill: ms from SIGKILL of the leader to the first full lookup answered.
    recovery_ms: Vec<u64>,
}

pub fn cluster_failover(a: FailoverArgs) -> Result<()> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir()?;
    let (key_file, auth) = cluster_auth(dir.path())?;
    let cluster = format!("[cluster]\netcd = \"{}\"\nreport_ms = 100\nnode_timeout_ms = 1000\n", etcd.url);
    let master_cfg = dir.path().join("master.toml");
    std::fs::write(&master_cfg, format!("{auth}\n{cluster}role = \"master\"\n"))?;
    let storage_cfg = dir.path().join("storage.toml");
    std::fs::write(
        &storage_cfg,
        format!("{auth}\n{cluster}role = \"storage\"\nmaster_key_file = \"{}\"\n", key_file.display()),
    )?;
    let mut masters: Vec<LocalServer> = (0..2)
        .map(|_| LocalServer::start("1MiB", &["--config".into(), master_cfg.display().to_string()]))
        .collect::<Result<_>>()?;
    let _nodes: Vec<LocalServer> = (0..2)
        .map(|i| {
            LocalServer::start(
                "64MiB",
                &["--config".into(), storage_cfg.display().to_string(), "--node-name".into(), format!("s{i}")],
            )
        })
        .collect::<Result<_>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut template = ClientConfig::new("unused:0", KEY, kvpool_client::Trust::Fingerprint([0; 32]));
    template.transport = kvpool_client::TransportChoice::Quic;
    template.request_timeout = std::time::Duration::from_millis(a.request_timeout_ms);
    let start = Instant::now();
    let client = loop {
        match rt.block_on(ClusterClient::connect_etcd(&etcd.url, "/kvpool/", template.clone())) {
            Ok(c) => break c,
            Err(e) if start.elapsed().as_secs() > 30 => bail!("no leader: {e}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    };
    while rt.block_on(client.nodes()).map(|n| n.iter().filter(|n| n.live).count()).unwrap_or(0) < 2 {
        if start.elapsed().as_secs() > 30 {
            bail!("the storage nodes did not join");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("failover-{i}").into_bytes()).collect();
    let value = vec![1u8; 64 << 10];
    let entries: Vec<PutEntry<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| PutEntry {
            key: k,
            value: &value,
            opts: PutOptions { parent: (i > 0).then(|| keys[i - 1].clone()), ..PutOptions::default() },
        })
        .collect();
    let st = rt.block_on(client.put_batch(&entries, PutMode::Insert, 1))?;
    if st.iter().any(|s| *s != ErrorCode::Ok) {
        bail!("put answered {st:?}");
    }
    let mut recovery = Vec::new();
    for k in 0..a.kills {
        while rt.block_on(client.lookup(&keys)).unwrap_or(0) < keys.len() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let leader = client.master().config().server.clone();
        let idx = masters
            .iter()
            .position(|m| kvpool_client::EndpointInfo::read(m.path()).is_ok_and(|e| e.quic_addr == leader))
            .context("the leader is none of the masters started")?;
        let killed = Instant::now();
        masters[idx].kill_and_restart(std::time::Duration::from_secs(30))?;
        loop {
            if rt.block_on(client.lookup(&keys)).unwrap_or(0) == keys.len() {
                break;
            }
            if killed.elapsed().as_secs() > 60 {
                bail!("kill {k}: no recovery within 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let ms = killed.elapsed().as_millis() as u64;
        println!("kill {k}: the first full lookup {ms} ms after the leader was killed");
        recovery.push(ms);
    }
    let mut sorted = recovery.clone();
    sorted.sort_unstable();
    println!(
        "failover over {} kills: median {} ms, max {} ms (leader lease TTL 2 s, client request timeout {} ms)",
        sorted.len(),
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        a.request_timeout_ms
    );
    let report = FailoverReport {
        kills: a.kills,
        leader_ttl_s: 2,
        request_timeout_ms: a.request_timeout_ms,
        recovery_ms: recovery,
    };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
