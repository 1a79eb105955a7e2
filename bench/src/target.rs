//! Benchmark targets: one harness, many stores. A target only has to move batches of blocks;
//! Mooncake, Redis or a shared-memory store plug in as further implementations of [`Target`].

use anyhow::{bail, Context, Result};
use kvpool_client::{Client, ClientConfig, ErrorCode, PutEntry, PutMode};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A key-value block store under test. Implementations are shared by all workers of a run
/// (`&self`, `Send + Sync`), the way one connector process shares one client.
pub trait Target: Send + Sync {
    /// Short name for tables, e.g. "kvpool".
    fn name(&self) -> String;
    /// Store `values[i]` under `keys[i]`; any per-item failure is an error.
    fn put_batch<'a>(&'a self, keys: &'a [Vec<u8>], values: &'a [&'a [u8]]) -> BoxFut<'a, Result<()>>;
    /// Read `keys[i]` into `bufs[i]` (each exactly the value size); returns the bytes read.
    fn get_batch<'a, 'b: 'a>(&'a self, keys: &'a [Vec<u8>], bufs: &'a mut [&'b mut [u8]]) -> BoxFut<'a, Result<u64>>;
    /// Remove the given keys (the blocks this run created).
    fn cleanup<'a>(&'a self, keys: &'a [Vec<u8>]) -> BoxFut<'a, Result<()>>;
}

/// kvpool over QUIC: one connection, or a batch striped over several (each part of a batch on
/// a connection of its own, all at once), so that one large transfer spreads over cores.
pub struct KvpoolTarget {
    clients: Vec<Client>,
    /// Row name for one connection (`kvpool`, `kvpool-tls`, `kvpool-tcp`).
    label: String,
}

impl KvpoolTarget {
    pub async fn connect(cfg: ClientConfig) -> Result<Self> {
        Self::connect_striped(cfg, 1).await
    }

    /// `n` connections (at least one), a batch striped over them.
    pub async fn connect_striped(cfg: ClientConfig, n: usize) -> Result<Self> {
        let mut clients = Vec::new();
        for _ in 0..n.max(1) {
            clients.push(Client::connect(cfg.clone()).await.context("connecting to kvpool")?);
        }
        Ok(KvpoolTarget { clients, label: "kvpool".into() })
    }

    /// The same target under another row name.
    pub fn named(mut self, label: &str) -> Self {
        self.label = label.into();
        self
    }

    pub fn client(&self) -> &Client {
        &self.clients[0]
    }

    /// Items per stripe of a batch of `n`.
    fn stripe(&self, n: usize) -> usize {
        n.div_ceil(self.clients.len()).max(1)
    }
}

impl Target for KvpoolTarget {
    fn name(&self) -> String {
        match self.clients.len() {
            1 => self.label.clone(),
            n => format!("kvpool-{n}conn"),
        }
    }

    fn put_batch<'a>(&'a self, keys: &'a [Vec<u8>], values: &'a [&'a [u8]]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let k = self.stripe(keys.len());
            let parts = keys.chunks(k).zip(values.chunks(k)).zip(&self.clients).map(|((keys, values), c)| async move {
                let entries: Vec<PutEntry<'_>> = keys.iter().zip(values).map(|(k, v)| PutEntry::new(k, v)).collect();
                c.put_batch(&entries, PutMode::Insert).await
            });
            let st: Vec<ErrorCode> = futures_util::future::try_join_all(parts).await?.concat();
            if let Some((i, c)) = st.iter().enumerate().find(|(_, c)| **c != ErrorCode::Ok) {
                bail!("put of item {i} failed: {c}");
            }
            Ok(())
        })
    }

    fn get_batch<'a, 'b: 'a>(&'a self, keys: &'a [Vec<u8>], bufs: &'a mut [&'b mut [u8]]) -> BoxFut<'a, Result<u64>> {
        Box::pin(async move {
            let k = self.stripe(keys.len());
            let parts = keys
                .chunks(k)
                .zip(bufs.chunks_mut(k))
                .zip(&self.clients)
                .map(|((keys, bufs), c)| c.get_batch_into(keys, bufs));
            let r: Vec<_> = futures_util::future::try_join_all(parts).await?.into_iter().flatten().collect();
            let mut total = 0;
            for (i, item) in r.iter().enumerate() {
                if item.status != ErrorCode::Ok {
                    // A miss here usually means eviction: the server's DRAM is smaller than a phase.
                    bail!("get of item {i} failed: {} (blocks evicted? give the server more DRAM)", item.status);
                }
                total += item.size;
            }
            Ok(total)
        })
    }

    fn cleanup<'a>(&'a self, keys: &'a [Vec<u8>]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let chunk = self.client().limits().max_batch.max(1) as usize;
            for part in keys.chunks(chunk) {
                self.client().remove_batch(part, true).await?;
            }
            Ok(())
        })
    }
}

/// A `kvpool-server` child process with a throw-away data directory; killed on drop.
pub struct LocalServer {
    child: Child,
    pub data_dir: tempfile::TempDir,
    args: Vec<String>,
    place: crate::peers::Place,
}

impl LocalServer {
    /// Start the server binary that sits next to this executable (same cargo target dir).
    pub fn start(dram: &str, extra: &[String]) -> Result<Self> {
        Self::start_at(&crate::peers::Place::local(), dram, extra)
    }

    /// [`LocalServer::start`] at `place` (listening on its address).
    pub fn start_at(place: &crate::peers::Place, dram: &str, extra: &[String]) -> Result<Self> {
        let listen = format!("{}:0", place.ip);
        let mut args: Vec<String> = ["--listen", &listen, "--dram-size", dram].map(String::from).to_vec();
        // Metrics on a free port of the server's address (the bench reads its UDP counters and
        // histograms), unless the caller names its own.
        if !extra.iter().any(|a| a == "--metrics-listen") {
            args.extend(["--metrics-listen".to_string(), format!("{}:0", place.ip)]);
        }
        // No SSD tier unless the caller asks for one.
        if !extra.iter().any(|a| a == "--ssd-capacity") {
            args.extend(["--ssd-capacity".to_string(), "0".to_string()]);
        }
        args.extend_from_slice(extra);
        let data_dir = tempfile::Builder::new().prefix("kvpool-bench-").tempdir()?;
        let child = Self::spawn(place, data_dir.path(), &args)?;
        let mut s = LocalServer { child, data_dir, args, place: place.clone() };
        s.wait_ready(Duration::from_secs(60))?;
        Ok(s)
    }

    fn spawn(place: &crate::peers::Place, dir: &Path, args: &[String]) -> Result<Child> {
        let bin = server_binary()?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("server.log"))?;
        place
            .command(&bin)
            .arg("--data-dir")
            .arg(dir)
            .args(args)
            .env("RUST_LOG", std::env::var("KVPOOL_BENCH_SERVER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL the process (no shutdown path runs) and start it again on the same data
    /// directory; returns once it has written its endpoint file again.
    pub fn kill_and_restart(&mut self, limit: Duration) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        // The endpoint file is the readiness signal: remove the stale one first.
        let _ = std::fs::remove_file(self.path().join("endpoint.json"));
        self.child = Self::spawn(&self.place, self.data_dir.path(), &self.args)?;
        self.wait_ready(limit)
    }

    pub fn path(&self) -> &Path {
        self.data_dir.path()
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        let ep = self.path().join("endpoint.json");
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait()? {
                bail!("kvpool-server exited with {status} before it was ready:\n{}", self.log_tail());
            }
            // The server writes endpoint.json atomically (rename) when it is ready.
            if ep.exists() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        bail!("kvpool-server not ready after {limit:?}:\n{}", self.log_tail())
    }

    /// The server's Prometheus text, from the `/metrics` address in its endpoint file.
    pub fn metrics(&self) -> Result<String> {
        use std::io::{Read, Write};
        let ep: serde_json::Value = serde_json::from_slice(&std::fs::read(self.path().join("endpoint.json"))?)?;
        let addr = ep["metrics_addr"].as_str().context("the server serves no /metrics")?;
        let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("/metrics at {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvpool\r\nConnection: close\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        Ok(text)
    }

    /// The server process's UDP counters (`kvpool_udp_*_total` of its `/metrics`).
    pub fn udp_stats(&self) -> Result<kvpool_client::UdpStats> {
        Ok(udp_from_metrics(&self.metrics()?))
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.path().join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `kvpool_udp_*_total` series of a Prometheus text; a series missing reads 0.
pub fn udp_from_metrics(text: &str) -> kvpool_client::UdpStats {
    let get = |name: &str| {
        text.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .find_map(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    kvpool_client::UdpStats {
        recv_calls: get("kvpool_udp_recv_calls_total"),
        recv_messages: get("kvpool_udp_recv_messages_total"),
        recv_datagrams: get("kvpool_udp_recv_datagrams_total"),
        recv_bytes: get("kvpool_udp_recv_bytes_total"),
        send_calls: get("kvpool_udp_send_calls_total"),
        send_datagrams: get("kvpool_udp_send_datagrams_total"),
        send_bytes: get("kvpool_udp_send_bytes_total"),
    }
}

fn server_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let name = format!("kvpool-server{}", std::env::consts::EXE_SUFFIX);
    // Binaries live in target/<profile>/; test and example builds one level below.
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let p = d.join(&name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "{name} not found next to {}; build it first (cargo build --release -p kvpool-server) or pass --server",
        exe.display()
    )
}

/// kvpool over the same-host transport, zero-copy: values live in shared buffers, as a
/// connector's KV blocks would, and the server copies between them and its segment.
pub struct KvpoolShmTarget {
    client: Client,
    /// The harness's value pool, copied once into a shared buffer; puts name parts of it.
    source: kvpool_client::Buffer,
    pool_addr: usize,
    /// Destination buffers for gets, one per worker in flight.
    dests: std::sync::Mutex<Vec<kvpool_client::Buffer>>,
}

impl KvpoolShmTarget {
    /// `workers` destination buffers of `dest_len` bytes are made (and touched) up front, as a
    /// connector registers its KV memory once, so that no timed get pays for their page faults.
    pub async fn connect(cfg: ClientConfig, pool: &[u8], workers: usize, dest_len: usize) -> Result<Self> {
        let client = Client::connect(cfg).await.context("connecting to kvpool over shm")?;
        if client.transport_in_use() != "shm" {
            bail!("the server did not offer shared memory");
        }
        let mut source = client.alloc_buffer(pool.len())?;
        source.as_mut_slice().copy_from_slice(pool);
        let mut dests = Vec::with_capacity(workers);
        for _ in 0..workers {
            let mut d = client.alloc_buffer(dest_len)?;
            d.as_mut_slice().fill(0);
            dests.push(d);
        }
        Ok(KvpoolShmTarget { client, source, pool_addr: pool.as_ptr() as usize, dests: std::sync::Mutex::new(dests) })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl Target for KvpoolShmTarget {
    fn name(&self) -> String {
        "kvpool-shm".into()
    }

    fn put_batch<'a>(&'a self, keys: &'a [Vec<u8>], values: &'a [&'a [u8]]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let mut entries = Vec::with_capacity(keys.len());
            for (k, v) in keys.iter().zip(values) {
                let offset = (v.as_ptr() as usize).checked_sub(self.pool_addr).context("value outside the pool")?;
                entries.push((k, self.source.slice(offset, v.len())?, kvpool_client::PutOptions::default()));
            }
            let st = self.client.put_from_batch(&entries, PutMode::Insert).await?;
            if let Some((i, c)) = st.iter().enumerate().find(|(_, c)| **c != ErrorCode::Ok) {
                bail!("put of item {i} failed: {c}");
            }
            Ok(())
        })
    }

    /// Values land in shared buffers (zero-copy); `bufs` only give their sizes.
    fn get_batch<'a, 'b: 'a>(&'a self, keys: &'a [Vec<u8>], bufs: &'a mut [&'b mut [u8]]) -> BoxFut<'a, Result<u64>> {
        Box::pin(async move {
            let need: usize = bufs.iter().map(|b| b.len()).sum();
            let taken = self.dests.lock().unwrap_or_else(|p| p.into_inner()).pop().filter(|b| b.len() >= need);
            let dest = match taken {
                Some(b) => b,
                None => self.client.alloc_buffer(need)?,
            };
            let mut at = 0;
            let mut slices = Vec::with_capacity(bufs.len());
            for b in bufs.iter() {
                slices.push(dest.slice(at, b.len())?);
                at += b.len();
            }
            let r = self.client.get_into_batch(keys, &slices).await;
            drop(slices);
            self.dests.lock().unwrap_or_else(|p| p.into_inner()).push(dest);
            let mut total = 0;
            for (i, item) in r?.iter().enumerate() {
                if item.status != ErrorCode::Ok {
                    bail!("get of item {i} failed: {}", item.status);
                }
                total += item.size;
            }
            Ok(total)
        })
    }

    fn cleanup<'a>(&'a self, keys: &'a [Vec<u8>]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let chunk = self.client().limits().max_batch.max(1) as usize;
            for part in keys.chunks(chunk) {
                self.client().remove_batch(part, true).await?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn udp_counters_are_read_from_the_servers_metrics_text() {
        let text = "# HELP kvpool_udp_recv_calls_total x\n# TYPE kvpool_udp_recv_calls_total counter\n\
                    kvpool_udp_recv_calls_total 3\nkvpool_udp_recv_messages_total 5\n\
                    kvpool_udp_recv_datagrams_total 47\nkvpool_udp_recv_bytes_total 69000\n\
                    kvpool_udp_send_calls_total 9\nkvpool_udp_send_datagrams_total 9\n";
        let s = super::udp_from_metrics(text);
        assert_eq!((s.recv_calls, s.recv_messages, s.recv_datagrams, s.recv_bytes), (3, 5, 47, 69_000));
        assert_eq!((s.send_calls, s.send_datagrams, s.send_bytes), (9, 9, 0));
        assert_eq!(super::udp_from_metrics("").recv_datagrams, 0);
    }
}
