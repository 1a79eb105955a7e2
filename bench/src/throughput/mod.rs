//! `kvpool-bench throughput`: put then get blocks of several sizes, batch sizes and
//! concurrencies through kvpool and its peers.

mod report;

use crate::peers::{MooncakeCluster, MooncakeInstall, MooncakePath, Place, RedisServer, RedisTarget};
use crate::plot;
use crate::target::{KvpoolShmTarget, KvpoolTarget, LocalServer, Target};
use anyhow::{bail, Context, Result};
use clap::Args;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use kvpool_client::ClientConfig;
use kvpool_client::{BulkChoice, TransportChoice};
use rand::{RngCore, SeedableRng};
use report::*;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct ThroughputArgs {
    /// Use a running server instead of starting one (needs --data-dir for its key and certificate)
    #[arg(long, env = "KVPOOL_SERVER", requires = "data_dir")]
    server: Option<String>,
    /// Data directory of a running server (endpoint.json and api-key are read from it)
    #[arg(long, env = "KVPOOL_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Block sizes
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB")]
    sizes: Vec<String>,
    /// Blocks per request
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    batches: Vec<usize>,
    /// Requests in flight on the one connection
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Bytes moved per phase (put or get) of each configuration, before rounding up to whole requests
    #[arg(long, default_value = "512MiB")]
    budget: String,
    /// Fewest requests per worker in a phase
    #[arg(long, default_value_t = 2)]
    min_ops: usize,
    /// DRAM segment of the server the bench starts; "auto" sizes it to hold the largest phase
    /// (every block of a configuration is resident before its gets start)
    #[arg(long, default_value = "auto")]
    dram: String,
    /// Tiny smoke run (small sizes, small budget)
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to this file
    #[arg(long)]
    json: Option<PathBuf>,
    /// Systems to measure, in order (kvpool, kvpool-shm, redis, mooncake, mooncake-shm); default:
    /// all whose peer is installed.
    /// A listed peer that is not installed is reported as skipped.
    #[arg(long, value_delimiter = ',', value_parser = TARGETS)]
    targets: Vec<String>,
    /// Systems that must run: a missing peer among them is an error instead of a skip
    #[arg(long, value_delimiter = ',', value_parser = TARGETS)]
    require: Vec<String>,
    /// Also draw MB/s per system per block size into this PNG file
    #[arg(long)]
    plot: Option<PathBuf>,
    /// How QUIC hands packets to the kernel, on both sides (auto, offload, large-datagrams)
    #[arg(long, default_value = "auto")]
    quic_segmentation: kvpool_client::Segmentation,
    /// Lookups of a 64-block chain to time after the kvpool (QUIC) run
    #[arg(long, default_value_t = 5000)]
    lookups: usize,
    /// Python interpreter that has Mooncake's client (`mooncake.store`) installed
    #[arg(long, env = "KVPOOL_BENCH_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// The Mooncake driver script
    #[arg(long, env = "KVPOOL_MOONCAKE_DRIVER", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mooncake_driver.py"))]
    mooncake_driver: PathBuf,
    /// Across hosts: every server side (kvpool, Redis, Mooncake's master and storage process)
    /// on a host of its own (a network namespace on a bridge), the clients in the root
    /// namespace, once per `--mtus` link MTU (needs root; same-host paths are skipped)
    #[arg(long, conflicts_with_all = ["server", "data_dir"])]
    hosts: bool,
    /// kvpool over QUIC is also run with each batch striped over this many connections (rows
    /// `kvpool-<n>conn`); 1 is the plain run
    #[arg(long, value_delimiter = ',', default_value = "1")]
    connections: Vec<usize>,
    /// Link MTUs of the `--hosts` run, in order
    #[arg(long, value_delimiter = ',', default_value = "1500,9000")]
    mtus: Vec<u32>,
    /// With `--hosts`: limit each direction of the link to this rate (bits per second, `tbf`)
    #[arg(long)]
    rate: Option<String>,
    /// With `--hosts`: the veths' offloads, each measured in turn at every MTU: `nic` (what a
    /// server NIC has on by default: GRO, GSO, TSO, UDP GSO, UDP GRO forwarding) or `bare` (the
    /// veth as the kernel makes it); default `nic`, or `bare` with `KVPOOL_NETNS_BARE=1`
    #[arg(long, value_delimiter = ',')]
    offloads: Vec<Offloads>,
}

/// The veths' offloads of a `--hosts` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offloads {
    Nic,
    Bare,
}

/// Every system `throughput` knows how to drive: kvpool over QUIC, kvpool over same-host
/// shared memory (zero-copy buffers), Redis, Mooncake over TCP, and Mooncake's own same-host
/// path (a dummy client of `mooncake_client` over shared memory).
const TARGETS: [&str; 7] = ["kvpool", "kvpool-tls", "kvpool-tcp", "kvpool-shm", "redis", "mooncake", "mooncake-shm"];

/// The network of a run's hosts (a /24 around the server), or loopback.
fn trusted_net(place: &Place) -> ipnet::IpNet {
    let ip: std::net::IpAddr = place.ip.parse().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    ipnet::IpNet::new(ip, if ip.is_ipv4() { 24 } else { 64 }).map(|n| n.trunc()).expect("a valid prefix length")
}

fn parse_size(s: &str) -> Result<usize> {
    let b: bytesize::ByteSize = s.parse().map_err(|e| anyhow::anyhow!("bad size {s:?}: {e}"))?;
    Ok(b.as_u64() as usize)
}

pub async fn throughput(mut a: ThroughputArgs) -> Result<()> {
    if a.quick {
        a.sizes = vec!["64KiB".into(), "1MiB".into()];
        a.batches = vec![1, 16];
        a.concurrency = vec![1, 4];
        a.budget = "16MiB".into();
        a.min_ops = 1;
    }
    if !a.hosts {
        let report = run_link(&a, &Place::local(), "loopback", a.plot.clone()).await?;
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&report)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    if let Some(why) = kvpool_netns::unavailable() {
        bail!("--hosts: {why}");
    }
    let rate = a
        .rate
        .as_deref()
        .map(|r| r.parse::<bytesize::ByteSize>().map(|b| b.as_u64()).map_err(|e| anyhow::anyhow!("--rate {r:?}: {e}")))
        .transpose()?;
    let mut hosts = kvpool_netns::Hosts::new(1, *a.mtus.first().context("--mtus is empty")?)?;
    let place = Place::host(&hosts, 1)?;
    if a.offloads.is_empty() {
        a.offloads = vec![if kvpool_netns::bare_from_env() { Offloads::Bare } else { Offloads::Nic }];
    }
    let mut runs = Vec::new();
    for &mtu in &a.mtus.clone() {
        for &offloads in &a.offloads.clone() {
            hosts.set_mtu(mtu)?;
            hosts.rate(1, rate)?;
            hosts.set_offloads(offloads == Offloads::Nic)?;
            // As read back from the veths, not as asked.
            let read_back = hosts.offloads()?.to_string();
            let link = format!(
                "across hosts, link MTU {mtu}{}, {read_back}: servers at {}, clients at {}",
                rate.map(|r| format!(", {r} bit/s")).unwrap_or_default(),
                place.ip,
                place.client_ip
            );
            println!("\n== {link}");
            let tag = if a.offloads.len() > 1 {
                format!("mtu{mtu}-{offloads:?}").to_lowercase()
            } else {
                format!("mtu{mtu}")
            };
            let plot = a.plot.as_ref().map(|p| suffixed(p, &tag));
            runs.push(HostsRun { mtu, offloads, read_back, report: run_link(&a, &place, &link, plot).await? });
        }
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One link MTU's run of `--hosts`.
#[derive(Serialize)]
struct HostsRun {
    mtu: u32,
    offloads: Offloads,
    /// The veths' offloads as `ethtool -k` read them back.
    read_back: String,
    report: Report,
}

/// `path` with `-tag` before its extension.
fn suffixed(path: &std::path::Path, tag: &str) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}-{tag}{ext}"))
}

/// Every target over one link: servers at `place`, clients here.
async fn run_link(a: &ThroughputArgs, place: &Place, link: &str, plot_path: Option<PathBuf>) -> Result<Report> {
    let sizes: Vec<usize> = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_>>()?;
    let budget = parse_size(&a.budget)?;
    if sizes.contains(&0) || a.batches.contains(&0) || a.concurrency.contains(&0) {
        bail!("sizes, batches and concurrency must be positive");
    }

    // Plan every configuration first so that the progress bar knows the total.
    let mut plan = Vec::new();
    for &size in &sizes {
        for &batch in &a.batches {
            for &conc in &a.concurrency {
                let per_op = size * batch;
                let ops = budget.div_ceil(per_op).max(conc * a.min_ops).div_ceil(conc);
                plan.push((size, batch, conc, ops));
            }
        }
    }
    let max_phase = plan.iter().map(|(size, batch, conc, ops)| size * batch * conc * ops).max().unwrap_or(0);
    let dram = if a.dram == "auto" {
        // Stay below the server's eviction watermark (95%) with room for allocator slack.
        let want = (max_phase as f64 / 0.8) as u64;
        let step = 256u64 << 20;
        format!("{}", want.div_ceil(step).max(2) * step)
    } else {
        a.dram.clone()
    };

    let (targets, skipped) = select_targets(a, place)?;
    for s in &skipped {
        tracing::warn!(target = %s.target, "skipped: {}", s.reason);
    }

    let max_size = *sizes.iter().max().expect("at least one size");
    let max_batch = *a.batches.iter().max().expect("at least one batch");
    let max_conc = *a.concurrency.iter().max().expect("at least one concurrency");
    let mut pool = vec![0u8; max_size * max_batch];
    rand::rngs::StdRng::seed_from_u64(0x6b76706f6f6c).fill_bytes(&mut pool);
    let pool = Arc::new(pool);
    // Unique per run, so that runs against a shared server never collide.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let run = Arc::new(format!("{:x}-{nanos:x}", std::process::id()));

    let per_target: u64 = plan.iter().map(|(_, _, c, o)| (2 * c * o) as u64).sum();
    let pb = ProgressBar::new(per_target * targets.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}")
            .expect("static template"),
    );

    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut peers_seen = Vec::new();
    let mut server = String::new();
    let mut lookup = None;
    print_header();
    for name in &targets {
        match name.as_str() {
            "kvpool" | "kvpool-tls" | "kvpool-tcp" | "kvpool-shm" => {
                // Start our own server unless pointed at one.
                let (server_proc, mut cfg) = match (&a.server, &a.data_dir) {
                    (_, Some(dir)) => {
                        let mut cfg = ClientConfig::from_data_dir(dir)?;
                        if let Some(s) = &a.server {
                            cfg.server = s.clone();
                        }
                        (None, cfg)
                    }
                    (None, None) => {
                        let seg = a.quic_segmentation.to_string();
                        let mut extra = vec!["--quic-segmentation".into(), seg];
                        if name == "kvpool-tcp" {
                            // The namespaces' bridge is the trusted network of this run.
                            extra.extend(["--bulk-trusted-networks".into(), trusted_net(place).to_string()]);
                        }
                        let s = LocalServer::start_at(place, &dram, &extra)?;
                        let cfg = ClientConfig::from_data_dir(s.path())?;
                        (Some(s), cfg)
                    }
                    (Some(_), None) => unreachable!("clap requires --data-dir with --server"),
                };
                cfg.client_name = "kvpool-bench".into();
                cfg.quic.segmentation = a.quic_segmentation;
                cfg.request_timeout = Duration::from_secs(300);
                let shm = name == "kvpool-shm";
                cfg.transport = if shm { TransportChoice::Shm } else { TransportChoice::Quic };
                // `kvpool` is QUIC alone; `kvpool-tls` and `kvpool-tcp` move bulk bytes over the
                // TCP channel, with TLS and in plaintext on the trusted network.
                cfg.bulk = match name.as_str() {
                    "kvpool-tls" | "kvpool-tcp" => BulkChoice::Tcp,
                    _ => BulkChoice::Quic,
                };
                if name == "kvpool-tcp" {
                    cfg.trusted_networks = vec![trusted_net(place)];
                }
                let (client, target): (kvpool_client::Client, Arc<dyn Target>) = if shm {
                    let t = KvpoolShmTarget::connect(cfg.clone(), &pool, max_conc, max_size * max_batch).await?;
                    (t.client().clone(), Arc::new(t))
                } else {
                    let t = KvpoolTarget::connect(cfg.clone()).await?.named(name);
                    (t.client().clone(), Arc::new(t))
                };
                server = client.hello().server;
                let limits = client.limits();
                if max_batch as u64 > limits.max_batch as u64 || max_size as u64 > limits.max_value_size {
                    bail!(
                        "the server limits (batch {}, value {}) are below this run's",
                        limits.max_batch,
                        limits.max_value_size
                    );
                }
                // The value bytes of `kvpool` (and its striped rows) go over QUIC: count them.
                let udp = (name == "kvpool").then_some(server_proc.as_ref());
                let udp_start = UdpSides::now(server_proc.as_ref());
                run_in_process(&target, &plan, &pool, &run, &pb, &mut rows, udp).await?;
                if name == "kvpool" {
                    for &n in a.connections.iter().filter(|&&n| n > 1) {
                        let striped: Arc<dyn Target> = Arc::new(KvpoolTarget::connect_striped(cfg.clone(), n).await?);
                        run_in_process(&striped, &plan, &pool, &run, &pb, &mut rows, udp).await?;
                    }
                    notes.push(quic_summary(&client));
                    let u = UdpSides::now(server_proc.as_ref()).since(&udp_start);
                    notes.push(format!("udp (client side): {}", u.client));
                    if server_proc.is_some() {
                        notes.push(format!("udp (server side): {}", u.server));
                    }
                    let l = lookup_latency(&client, &run, a.lookups).await?;
                    notes.push(format!(
                        "lookup of a {}-block chain ({} resident blocks, {} lookups, one request each): p50 {} us, p99 {} us",
                        LOOKUP_CHAIN, l.resident, l.count, l.p50_us, l.p99_us
                    ));
                    lookup = Some(l);
                }
            }
            "redis" => {
                let srv = RedisServer::start(place).await?;
                peers_seen.push(srv.version());
                let target: Arc<dyn Target> = Arc::new(RedisTarget::connect(&srv.ip, srv.port).await?);
                run_in_process(&target, &plan, &pool, &run, &pb, &mut rows, None).await?;
            }
            "mooncake" | "mooncake-shm" => {
                let (install, path, how) = if name == "mooncake" {
                    (MooncakeInstall::find(&a.python, &a.mooncake_driver), MooncakePath::Tcp, "tcp")
                } else {
                    let how = "same-host shared memory through mooncake_client, batch_put_from / batch_get_into";
                    (MooncakeInstall::find_shm(&a.python, &a.mooncake_driver), MooncakePath::Shm, how)
                };
                let install = install.map_err(anyhow::Error::msg)?;
                // Same room as kvpool's DRAM tier; the client buffer holds every batch in flight.
                let segment = parse_size(&dram)? as u64;
                let local_buffer = ((max_size * max_batch * max_conc) as u64).max(64 << 20) + (64 << 20);
                let mut mc = tokio::task::block_in_place(|| {
                    MooncakeCluster::start(
                        &install,
                        path,
                        segment,
                        local_buffer,
                        (max_size * max_batch) as u64,
                        max_conc,
                        place,
                    )
                })?;
                peers_seen.push(format!("mooncake-transfer-engine-non-cuda {} (python client, {how})", mc.version));
                for &(size, batch, conc, ops) in &plan {
                    let label = config_label(size, batch, conc);
                    pb.set_message(format!("{name} {label}"));
                    let mut bufs: Vec<WorkerBufs> =
                        (0..conc).map(|_| (0..batch).map(|_| vec![1u8; size]).collect()).collect();
                    let memcpy = run_memcpy(&pool, size, batch, &mut bufs, ops);
                    drop(bufs);
                    let (put, get) = tokio::task::block_in_place(|| mc.run(size, batch, conc, ops, &run))
                        .with_context(|| format!("{name} {label}"))?;
                    pb.inc((2 * conc * ops) as u64);
                    let bytes = (conc * ops * batch * size) as u64;
                    for (op, ph) in [("put", put), ("get", get)] {
                        let mut h = hist();
                        for l in &ph.lat_us {
                            let _ = h.record((*l).max(1));
                        }
                        let row = make_row(name, size, batch, conc, op, summarize(&h, bytes, ph.seconds), &memcpy);
                        pb.suspend(|| print_row(&row));
                        rows.push(row);
                    }
                }
            }
            other => bail!("unknown target {other}"),
        }
    }
    pb.finish_and_clear();
    for s in &skipped {
        println!("skipped {}: {}", s.target, s.reason);
    }
    for n in &notes {
        println!("{n}");
    }
    let goals = if place.is_local() { goals(&rows, lookup.as_ref()) } else { hosts_goals(&rows) };
    print_goals(&goals);

    if let Some(path) = &plot_path {
        let mut points: Vec<plot::Point> = rows
            .iter()
            .map(|r| plot::Point {
                system: r.target.clone(),
                op: r.op,
                block_size: r.block_size,
                mb_per_s: r.result.mb_per_s,
            })
            .collect();
        points.extend(rows.iter().map(|r| plot::Point {
            system: "memcpy".into(),
            op: r.op,
            block_size: r.block_size,
            mb_per_s: r.memcpy.mb_per_s,
        }));
        match plot::write_png(path, &points, &format!("kvpool-bench throughput ({link})")) {
            Ok(()) => println!("plot: {}", path.display()),
            // A missing font must not throw away a long run's numbers.
            Err(e) => tracing::warn!("no plot written: {e:#}"),
        }
    }

    Ok(Report {
        link: link.to_string(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        target: targets.join(","),
        skipped,
        peers: peers_seen,
        server,
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        mem_total: mem_total(),
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        quic: notes.join("\n"),
        rows,
        lookup,
        goals,
    })
}

/// Which targets run and which are skipped (peer not installed); a required one that is
/// missing is an error.
fn select_targets(a: &ThroughputArgs, place: &Place) -> Result<(Vec<String>, Vec<Skipped>)> {
    let asked: Vec<String> = if a.targets.is_empty() {
        // Default: everything, plus whatever --require names (already in TARGETS).
        TARGETS.iter().map(|s| s.to_string()).collect()
    } else {
        let mut t = a.targets.clone();
        for r in &a.require {
            if !t.contains(r) {
                t.push(r.clone());
            }
        }
        t
    };
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    for t in asked {
        if run.contains(&t) {
            continue;
        }
        let missing = match t.as_str() {
            "kvpool-shm" | "mooncake-shm" if !place.is_local() => {
                // Skipped even when required: across hosts there is no same-host path to take.
                skipped.push(Skipped { target: t, reason: "a same-host path: not run across hosts".into() });
                continue;
            }
            "redis" => RedisServer::available().is_none().then(|| "redis-server not found on PATH".to_string()),
            "mooncake" => MooncakeInstall::find(&a.python, &a.mooncake_driver).err(),
            "mooncake-shm" => MooncakeInstall::find_shm(&a.python, &a.mooncake_driver).err(),
            _ => None,
        };
        match missing {
            None => run.push(t),
            Some(reason) if a.require.contains(&t) => {
                bail!("required target {t} is not available: {reason} (install it with bench/peers/setup.sh)")
            }
            Some(reason) => skipped.push(Skipped { target: t, reason }),
        }
    }
    Ok((run, skipped))
}

fn config_label(size: usize, batch: usize, conc: usize) -> String {
    format!("{} x{batch} c{conc}", bytesize::ByteSize(size as u64).to_string_as(true))
}

fn make_row(
    target: &str,
    size: usize,
    batch: usize,
    conc: usize,
    op: &'static str,
    r: OpResult,
    memcpy: &OpResult,
) -> Row {
    let ratio = if memcpy.mb_per_s > 0.0 { r.mb_per_s / memcpy.mb_per_s } else { 0.0 };
    Row {
        target: target.into(),
        block_size: size,
        batch,
        concurrency: conc,
        op,
        result: r,
        memcpy: memcpy.clone(),
        ratio,
        udp: None,
    }
}

/// Every configuration of the plan against a target driven from this process: memcpy of the
/// same bytes first (so the ratio compares like with like, at that moment), then put, get,
/// cleanup.
///
/// `udp`: where the value bytes go over QUIC, the UDP counters of both ends are read around
/// each phase (`Some(server)`, the server the bench started, if any).
#[allow(clippy::too_many_arguments)]
async fn run_in_process(
    target: &Arc<dyn Target>,
    plan: &[(usize, usize, usize, usize)],
    pool: &Arc<Vec<u8>>,
    run: &Arc<String>,
    pb: &ProgressBar,
    rows: &mut Vec<Row>,
    udp: Option<Option<&LocalServer>>,
) -> Result<()> {
    let name = target.name();
    let snap = || udp.map(UdpSides::now);
    for &(size, batch, conc, ops) in plan {
        let label = config_label(size, batch, conc);
        pb.set_message(format!("{name} {label}"));
        let mut bufs: Vec<WorkerBufs> = (0..conc).map(|_| (0..batch).map(|_| vec![1u8; size]).collect()).collect();
        let memcpy = run_memcpy(pool, size, batch, &mut bufs, ops);
        let phase = Phase { target, pool, run, size, batch, ops_per_worker: ops, progress: pb };
        let u0 = snap();
        let put = phase.put(conc).await.with_context(|| format!("{name}: put phase of {label}"))?;
        let u1 = snap();
        let (get, _bufs) = phase.get(bufs).await.with_context(|| format!("{name}: get phase of {label}"))?;
        let u2 = snap();
        target.cleanup(&phase.all_keys(conc)).await.with_context(|| format!("{name}: cleanup of {label}"))?;
        let put_udp = u1.zip(u0).map(|(b, a)| b.since(&a));
        let get_udp = u2.zip(u1).map(|(b, a)| b.since(&a));
        for (op, r, udp) in [("put", put, put_udp), ("get", get, get_udp)] {
            let mut row = make_row(&name, size, batch, conc, op, r, &memcpy);
            row.udp = udp;
            pb.suspend(|| print_row(&row));
            rows.push(row);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn memcpy_baseline_counts_bytes() {
        let pool = vec![3u8; 4 * 1024];
        let mut bufs = vec![vec![vec![0u8; 1024]; 4]; 2];
        let r = run_memcpy(&pool, 1024, 4, &mut bufs, 3);
        assert_eq!(r.ops, 6);
        assert_eq!(r.bytes, 2 * 3 * 4 * 1024);
        assert!(bufs.iter().flatten().all(|b| b.iter().all(|x| *x == 3)));
    }
}
