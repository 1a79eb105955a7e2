//! The systems kvpool is compared with, each started by the harness on free loopback ports in a
//! temporary directory and killed on drop: Redis (driven from Rust through the `redis` crate) and
//! Mooncake Store (driven through its own Python client by `bench/peers/mooncake_driver.py`,
//! because that client is what vLLM's connector runs).

use crate::target::{BoxFut, Target};
use anyhow::{bail, Context, Result};
use redis::aio::MultiplexedConnection;
use serde::Deserialize;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Ask the kernel for a free loopback TCP port. The port is released before the peer binds it,
/// so another process could take it in between; a peer that then fails to start says so.
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// First executable called `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where the harness runs a peer's server side: on this host (loopback), or on a host of a
/// [`kvpool_netns::Hosts`] while the clients stay in the root namespace (`--hosts`).
#[derive(Clone, Debug)]
pub struct Place {
    /// Argv prefix that runs a program there (`ip netns exec <ns>`), empty on this host.
    prefix: Vec<String>,
    /// The server side's address.
    pub ip: String,
    /// The clients' address, as the server side reaches them.
    pub client_ip: String,
}

impl Place {
    pub fn local() -> Place {
        Place { prefix: Vec::new(), ip: "127.0.0.1".into(), client_ip: "127.0.0.1".into() }
    }

    /// The root namespace of `hosts`, at its address on the bridge.
    pub fn root(hosts: &kvpool_netns::Hosts) -> Place {
        Place { prefix: Vec::new(), ip: hosts.root_ip(), client_ip: hosts.root_ip() }
    }

    /// Host `i` of `hosts`, the clients in the root namespace.
    pub fn host(hosts: &kvpool_netns::Hosts, i: usize) -> Result<Place> {
        Ok(Place { prefix: hosts.prefix(i)?, ip: hosts.ip(i), client_ip: hosts.root_ip() })
    }

    pub fn is_local(&self) -> bool {
        self.prefix.is_empty()
    }

    /// `program`, to be run there.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        kvpool_netns::command_at(&self.prefix, program)
    }
}

/// A child process killed (and reaped) on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Redis

/// A throw-away `redis-server`: no persistence (`--save ''`, `--appendonly no`), loopback only.
pub struct RedisServer {
    _child: Reaped,
    pub port: u16,
    pub ip: String,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn available() -> Option<PathBuf> {
        which("redis-server")
    }

    pub async fn start(place: &Place) -> Result<Self> {
        let bin = Self::available().context("redis-server not found on PATH (bench/peers/setup.sh redis)")?;
        let dir = tempfile::Builder::new().prefix("kvpool-bench-redis-").tempdir()?;
        let port = free_port()?;
        let log = dir.path().join("redis.log");
        let child = place
            .command(&bin)
            .args(["--port", &port.to_string(), "--bind", &place.ip, "--save", "", "--appendonly", "no"])
            // A password-less Redis refuses other hosts in protected mode; this one is a
            // throw-away peer on a private bridge.
            .args(["--protected-mode", if place.is_local() { "yes" } else { "no" }])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log)
            // The largest batch (64 x 4 MiB) is one MSET; the default 1 GiB query buffer holds it,
            // but a bench must never be cut off by a client-output limit either.
            .args(["--client-output-buffer-limit", "normal 0 0 0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut child = Reaped(child);
        let client = redis::Client::open(format!("redis://{}:{port}/", place.ip))?;
        let start = Instant::now();
        loop {
            if let Some(st) = child.0.try_wait()? {
                bail!("redis-server exited with {st}:\n{}", tail(&log, 20));
            }
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                if redis::cmd("PING").query_async::<String>(&mut c).await.is_ok() {
                    break;
                }
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!("redis-server not ready after 20 s:\n{}", tail(&log, 20));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(RedisServer { _child: child, port, ip: place.ip.clone(), _dir: dir })
    }

    pub fn version(&self) -> String {
        Command::new("redis-server")
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
}

/// Redis through one multiplexed connection, the way kvpool is driven through one QUIC
/// connection: concurrent requests are pipelined on it. A batch is one MSET / MGET.
pub struct RedisTarget {
    conn: MultiplexedConnection,
}

impl RedisTarget {
    pub async fn connect(ip: &str, port: u16) -> Result<Self> {
        let client = redis::Client::open(format!("redis://{ip}:{port}/"))?;
        // Large batches take seconds on a busy machine; the crate's default would cut them off.
        let cfg = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Duration::from_secs(300))
            .set_connection_timeout(Duration::from_secs(10));
        let conn = client.get_multiplexed_async_connection_with_config(&cfg).await.context("connecting to redis")?;
        Ok(RedisTarget { conn })
    }
}

impl Target for RedisTarget {
    fn name(&self) -> String {
        "redis".into()
    }

    fn put_batch<'a>(&'a self, keys: &'a [Vec<u8>], values: &'a [&'a [u8]]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut cmd = redis::cmd("MSET");
            for (k, v) in keys.iter().zip(values) {
                cmd.arg(&k[..]).arg(*v);
            }
            cmd.query_async::<()>(&mut conn).await.context("redis MSET")?;
            Ok(())
        })
    }

    fn get_batch<'a, 'b: 'a>(&'a self, keys: &'a [Vec<u8>], bufs: &'a mut [&'b mut [u8]]) -> BoxFut<'a, Result<u64>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut cmd = redis::cmd("MGET");
            for k in keys {
                cmd.arg(&k[..]);
            }
            let vals: Vec<Option<Vec<u8>>> = cmd.query_async(&mut conn).await.context("redis MGET")?;
            let mut total = 0u64;
            for (i, (v, buf)) in vals.into_iter().zip(bufs.iter_mut()).enumerate() {
                let v = v.with_context(|| format!("redis: item {i} missing"))?;
                if v.len() != buf.len() {
                    bail!("redis: item {i} has {} bytes, expected {}", v.len(), buf.len());
                }
                // The copy into the caller's buffer is part of the cost, as for kvpool's get_into.
                buf.copy_from_slice(&v);
                total += v.len() as u64;
            }
            Ok(total)
        })
    }

    fn cleanup<'a>(&'a self, keys: &'a [Vec<u8>]) -> BoxFut<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            for part in keys.chunks(1024) {
                let mut cmd = redis::cmd("DEL");
                for k in part {
                    cmd.arg(&k[..]);
                }
                cmd.query_async::<i64>(&mut conn).await.context("redis DEL")?;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Mooncake

/// Where Mooncake is installed: the Python interpreter that imports `mooncake.store` and the
/// `mooncake_master` binary the same pip package ships.
#[derive(Debug, Clone)]
pub struct MooncakeInstall {
    pub python: PathBuf,
    pub master: PathBuf,
    /// `mooncake_client`, the standalone "real client" that serves same-host dummy clients over
    /// shared memory (absent from older packages).
    pub real_client: Option<PathBuf>,
    pub driver: PathBuf,
    pub version: String,
}

impl MooncakeInstall {
    /// Find the installation, or say why it is not usable.
    pub fn find(python: &Path, driver: &Path) -> std::result::Result<Self, String> {
        if !driver.is_file() {
            return Err(format!("driver script {} not found", driver.display()));
        }
        // The pip package puts mooncake_master inside the package directory (plus a PATH shim).
        let probe = "import importlib.metadata as m, mooncake, mooncake.store, os\n\
                     print(os.path.dirname(mooncake.__file__))\n\
                     print(m.version('mooncake-transfer-engine-non-cuda') if any(d.metadata['Name'] == 'mooncake-transfer-engine-non-cuda' for d in m.distributions()) else '?')";
        let out =
            Command::new(python).args(["-c", probe]).output().map_err(|e| format!("{}: {e}", python.display()))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            return Err(format!("python cannot import mooncake.store ({last}); run bench/peers/setup.sh mooncake"));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut lines = text.lines();
        let pkg_dir = PathBuf::from(lines.next().unwrap_or_default());
        let version = lines.next().unwrap_or("?").to_string();
        let master = [pkg_dir.join("mooncake_master")]
            .into_iter()
            .find(|p| p.is_file())
            .or_else(|| which("mooncake_master"))
            .ok_or_else(|| "mooncake_master not found in the mooncake package nor on PATH".to_string())?;
        let real_client =
            [pkg_dir.join("mooncake_client")].into_iter().find(|p| p.is_file()).or_else(|| which("mooncake_client"));
        Ok(MooncakeInstall { python: python.to_path_buf(), master, real_client, driver: driver.to_path_buf(), version })
    }

    /// As [`MooncakeInstall::find`], for Mooncake's same-host path, which needs `mooncake_client`.
    pub fn find_shm(python: &Path, driver: &Path) -> std::result::Result<Self, String> {
        let install = Self::find(python, driver)?;
        if install.real_client.is_none() {
            return Err(
                "mooncake_client (the same-host real client) not found in the mooncake package nor on PATH".into()
            );
        }
        Ok(install)
    }
}

/// How the Mooncake client process reaches the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MooncakePath {
    /// A storage process mounts the segment; the client's transfer engine moves bytes over TCP.
    Tcp,
    /// A `mooncake_client` process mounts the segment and serves the client ("dummy client")
    /// through a shared-memory pool it maps: Mooncake's own same-host path.
    Shm,
}

/// Latencies of one phase as the driver measured them.
#[derive(Debug, Deserialize)]
pub struct DriverPhase {
    pub seconds: f64,
    pub lat_us: Vec<u64>,
}

#[derive(Debug, Deserialize)]
struct DriverReply {
    put: Option<DriverPhase>,
    get: Option<DriverPhase>,
    error: Option<String>,
}

/// A line-oriented Python driver process (`mooncake_driver.py client|serve`).
struct Driver {
    child: Reaped,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    log: PathBuf,
}

impl Driver {
    fn spawn(install: &MooncakeInstall, place: &Place, args: &[String], log: PathBuf) -> Result<Self> {
        let err = std::fs::File::create(&log)?;
        let mut child = place
            .command(&install.python)
            .arg(&install.driver)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {}", install.driver.display()))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("driver stdout")?);
        let mut d = Driver { child: Reaped(child), stdin, stdout, log };
        let line = d.read_line().context("waiting for the mooncake driver to be ready")?;
        if !line.contains("\"ready\"") {
            bail!("unexpected first line from the mooncake driver: {line}");
        }
        Ok(d)
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let st = self.child.0.wait().map(|s| s.to_string()).unwrap_or_default();
            bail!("mooncake driver exited ({st}):\n{}", tail(&self.log, 20));
        }
        Ok(line)
    }
}

/// `mooncake_master` plus one storage process (the segment holder, like kvpool's server) and one
/// client process that runs the workload; all on loopback, all killed on drop.
pub struct MooncakeCluster {
    client: Driver,
    storage: Storage,
    _master: Reaped,
    _dir: tempfile::TempDir,
    pub version: String,
}

impl MooncakeCluster {
    /// `segment`: bytes the storage process mounts; `local_buffer`: the client's transfer buffer
    /// (it must hold every batch in flight at once; TCP only); `max_bytes`: the largest batch;
    /// `workers`: the most concurrent workers (each has its own region of `max_bytes`; shm only).
    pub fn start(
        install: &MooncakeInstall,
        path: MooncakePath,
        segment: u64,
        local_buffer: u64,
        max_bytes: u64,
        workers: usize,
        place: &Place,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("kvpool-bench-mooncake-").tempdir()?;
        let (rpc, metrics) = (free_port()?, free_port()?);
        let log = dir.path().join("master.log");
        let out = std::fs::File::create(&log)?;
        let master = place
            .command(&install.master)
            .args([
                format!("--rpc_port={rpc}"),
                format!("--rpc_address={}", place.ip),
                format!("--metrics_port={metrics}"),
                format!("--metrics_host={}", place.ip),
                "--enable_http_metadata_server=false".into(),
            ])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", install.master.display()))?;
        let mut master = Reaped(master);
        // Ready when its RPC port accepts connections.
        wait_listening(&mut master, &place.ip, rpc, "mooncake_master", &log, Duration::from_secs(30))?;
        let addr = format!("{}:{rpc}", place.ip);
        let mut client_args = vec![
            "client".into(),
            "--host".into(),
            place.client_ip.clone(),
            "--master".into(),
            addr.clone(),
            "--local-buffer".into(),
            local_buffer.to_string(),
            "--max-bytes".into(),
            max_bytes.to_string(),
        ];
        let storage = match path {
            MooncakePath::Tcp => Storage::Driver(
                Driver::spawn(
                    install,
                    place,
                    &[
                        "serve".into(),
                        "--host".into(),
                        place.ip.clone(),
                        "--master".into(),
                        addr,
                        "--segment".into(),
                        segment.to_string(),
                    ],
                    dir.path().join("storage.log"),
                )
                .context("starting the mooncake storage process")?,
            ),
            MooncakePath::Shm => {
                let port = free_port()?;
                let real = Self::start_real_client(install, &dir, &addr, port, segment)?;
                client_args.extend([
                    "--shm".into(),
                    format!("127.0.0.1:{port}"),
                    "--workers".into(),
                    workers.to_string(),
                ]);
                Storage::RealClient { _process: real }
            }
        };
        let client = Driver::spawn(install, &Place::local(), &client_args, dir.path().join("client.log"))
            .context("starting the mooncake client process")?;
        Ok(MooncakeCluster { client, storage, _master: master, _dir: dir, version: install.version.clone() })
    }

    /// `mooncake_client` on `port`, mounting `segment` bytes, with local memcpy forced on (it is
    /// Mooncake's default when TCP is the only transport; set so a changed default cannot slow it).
    fn start_real_client(
        install: &MooncakeInstall,
        dir: &tempfile::TempDir,
        master: &str,
        port: u16,
        segment: u64,
    ) -> Result<Reaped> {
        let bin = install.real_client.as_ref().context("mooncake_client not installed")?;
        let log = dir.path().join("real-client.log");
        let out = std::fs::File::create(&log)?;
        let child = Command::new(bin)
            .args([
                "--host=127.0.0.1".to_string(),
                format!("--port={port}"),
                "--protocol=tcp".into(),
                format!("--global_segment_size={segment}"),
                "--local_buffer_size=67108864".into(),
                format!("--master_server_address={master}"),
                "--metadata_server=P2PHANDSHAKE".into(),
                // One service thread per core of this machine (the default is 1).
                format!("--threads={}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)),
            ])
            .env("MC_STORE_MEMCPY", "1")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut child = Reaped(child);
        wait_listening(&mut child, "127.0.0.1", port, "mooncake_client", &log, Duration::from_secs(60))?;
        Ok(child)
    }

    /// Put then get `conc x ops` batches of `batch` blocks of `size` bytes; keys removed after.
    pub fn run(
        &mut self,
        size: usize,
        batch: usize,
        conc: usize,
        ops: usize,
        run: &str,
    ) -> Result<(DriverPhase, DriverPhase)> {
        let req = serde_json::json!({"size": size, "batch": batch, "conc": conc, "ops": ops, "run": run});
        let stdin = self.client.stdin.as_mut().context("driver stdin closed")?;
        writeln!(stdin, "{req}")?;
        stdin.flush()?;
        let line = self.client.read_line()?;
        let reply: DriverReply =
            serde_json::from_str(&line).with_context(|| format!("parsing the mooncake driver's reply {line:?}"))?;
        if let Some(e) = reply.error {
            bail!("mooncake: {e}");
        }
        match (reply.put, reply.get) {
            (Some(p), Some(g)) => Ok((p, g)),
            _ => bail!("mooncake driver reply without put/get: {line}"),
        }
    }
}

/// Wait until `child` accepts TCP connections on `ip:port`; fail with the tail of its log if it
/// exits first or is not listening within `limit`.
fn wait_listening(child: &mut Reaped, ip: &str, port: u16, name: &str, log: &Path, limit: Duration) -> Result<()> {
    let start = Instant::now();
    while std::net::TcpStream::connect((ip, port)).is_err() {
        if let Some(st) = child.0.try_wait()? {
            bail!("{name} exited with {st}:\n{}", tail(log, 20));
        }
        if start.elapsed() > limit {
            bail!("{name} not listening after {} s:\n{}", limit.as_secs(), tail(log, 20));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The process that mounts Mooncake's segment (kept alive, killed on drop).
enum Storage {
    Driver(Driver),
    RealClient { _process: Reaped },
}

impl Drop for MooncakeCluster {
    fn drop(&mut self) {
        // Closing stdin lets both drivers close their stores cleanly before they are killed.
        self.client.stdin.take();
        if let Storage::Driver(d) = &mut self.storage {
            d.stdin.take();
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if matches!(self.client.child.0.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
