//! kvpool server: a KV-cache pool node (the all-in-one role): QUIC API, sled metadata, DRAM and
//! SSD tiers, built-in admission and eviction policies.

pub mod auth;
pub mod cluster;
pub mod config;
pub mod events;
pub mod metrics;
pub mod policy;
pub mod service;
pub mod store;
pub mod tls;

use config::{ApiKeyEntry, Config};
use kvpool_proto::Limits;
use metrics::Metrics;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use store::{Store, StoreConfig};
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot use data directory {path}: {source}")]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
    #[error("invalid listen address {0:?}")]
    Addr(String),
    #[error("transport {protocol:?} is not available: {why}")]
    Transport { protocol: String, why: String },
    #[error("metadata store: {0}")]
    Meta(#[from] store::meta::MetaError),
    #[error("policy engine: {0}")]
    Policy(#[from] policy::PolicyError),
}

/// A running server.
pub struct ServerHandle {
    pub quic_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub fingerprint: String,
    pub cert_path: PathBuf,
    pub data_dir: PathBuf,
    /// Set when the embedded default generated (or reused) `<data_dir>/api-key`.
    pub api_key_file: Option<PathBuf>,
    endpoint: quinn::Endpoint,
    store: Arc<Store>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    hixl: Option<kvpool_hixl::HixlTransport>,
}

impl ServerHandle {
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The HIXL engine when `transport.protocol = "ascend"`.
    pub fn hixl(&self) -> Option<&kvpool_hixl::HixlTransport> {
        self.hixl.as_ref()
    }

    /// Stop accepting, close connections, flush metadata.
    pub async fn shutdown(self) {
        self.endpoint.close(kvpool_proto::close::SHUTDOWN.into(), b"server shutting down");
        for t in &self.tasks {
            t.abort();
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        self.store.flush();
        info!("server stopped");
    }
}

fn tenant_id(meta: &store::meta::Meta, name: &str) -> u32 {
    // Stable ids: sled keys are scoped by them, so they must survive restarts.
    let key = format!("tenant:{name}");
    if let Ok(Some(v)) = meta.kv.get(&key) {
        if v.len() == 4 {
            return u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
        }
    }
    let next =
        meta.kv.get("tenant-next").ok().flatten().map(|v| u32::from_be_bytes([v[0], v[1], v[2], v[3]])).unwrap_or(1);
    let _ = meta.kv.insert(&key, &next.to_be_bytes());
    let _ = meta.kv.insert("tenant-next", &(next + 1).to_be_bytes());
    next
}

/// The embedded default's admin key: generated once into `<data_dir>/api-key` (owner-only).
fn default_key(data_dir: &Path) -> Result<(ApiKeyEntry, PathBuf), ServerError> {
    let path = data_dir.join("api-key");
    let key = match std::fs::read_to_string(&path) {
        Ok(k) if !k.trim().is_empty() => k.trim().to_string(),
        _ => {
            let mut raw = [0u8; 24];
            getrandom::getrandom(&mut raw).map_err(|e| ServerError::DataDir {
                path: path.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let key = format!("kvp_{}", hex::encode(raw));
            tls::write_private(&path, format!("{key}\n").as_bytes())?;
            key
        }
    };
    let entry = ApiKeyEntry { tenant: "default".into(), sha256: hex::encode(auth::hash_key(&key)), admin: true };
    Ok((entry, path))
}

/// The server's TLS 1.3 configuration for one ALPN, with its certificate.
fn server_tls(tls: &tls::TlsMaterial, alpn: &[u8]) -> Result<rustls::ServerConfig, ServerError> {
    let mut c = rustls::ServerConfig::builder_with_provider(kvpool_net::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls::TlsError::from)?
        .with_no_client_auth()
        .with_single_cert(tls.certs.clone(), tls.key.clone_key())
        .map_err(tls::TlsError::from)?;
    c.alpn_protocols = vec![alpn.to_vec()];
    Ok(c)
}

/// The bulk channel's TLS: the QUIC certificate, its own ALPN. After the bind the channel
/// reads and writes the records itself with the keys rustls hands over (`kvpool_net::bulk`):
/// no session tickets, which would be records it must not see.
pub fn bulk_tls(tls: &tls::TlsMaterial) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let mut c = server_tls(tls, kvpool_proto::BULK_ALPN)?;
    c.enable_secret_extraction = true;
    c.send_tls13_tickets = 0;
    Ok(Arc::new(c))
}

fn quic_server_configs(
    tls: &tls::TlsMaterial,
    cfg: &Config,
    bufs: &kvpool_net::SocketBuffers,
) -> Result<service::QuicServerConfigs, ServerError> {
    let crypto = server_tls(tls, kvpool_proto::ALPN)?;
    let quic = Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(crypto)
            .map_err(|e| tls::TlsError::Generate(format!("quic tls: {e}")))?,
    );
    let tuning = cfg.quic.tuning();
    let build = |kind| {
        let mut t = kvpool_net::transport_config(kind, bufs, &tuning);
        t.max_concurrent_bidi_streams(cfg.server.max_streams_per_connection.into());
        t.max_concurrent_uni_streams(0u8.into());
        t.max_idle_timeout(Some(
            Duration::from_millis(cfg.server.idle_timeout_ms)
                .try_into()
                .unwrap_or(quinn::IdleTimeout::from(quinn::VarInt::from_u32(30_000))),
        ));
        let mut sc = quinn::ServerConfig::with_crypto(quic.clone());
        sc.transport_config(Arc::new(t));
        Arc::new(sc)
    };
    Ok(service::QuicServerConfigs {
        same_host: build(kvpool_net::PathKind::SameHost),
        network: build(kvpool_net::PathKind::Network),
    })
}

/// A node's request-serving state with no network attached: the store, the policy engine,
/// authentication and limits. [`start`] puts it behind QUIC; the fuzz driver and in-process
/// tests drive [`service::handle_stream`] on it directly.
pub struct Node {
    pub shared: Arc<service::Shared>,
    pub data_dir: PathBuf,
    /// Set when the embedded default generated (or reused) `<data_dir>/api-key`.
    pub api_key_file: Option<PathBuf>,
    /// The HIXL engine when `transport.protocol = "ascend"`.
    pub hixl: Option<kvpool_hixl::HixlTransport>,
}

/// The HIXL backend's settings from the server config (the seed's `[hixl]` fields land in
/// `transport` and `transport.hixl`).
pub fn hixl_config(cfg: &Config) -> kvpool_hixl::HixlConfig {
    let t = &cfg.transport;
    let h = t.hixl.clone().unwrap_or_default();
    kvpool_hixl::HixlConfig {
        shim_path: h.shim_path,
        local_host: h.local_host,
        engine_port: h.engine_port,
        device_type: h.device_type,
        device_id: t.device_id,
        link_type: h.protocol_desc,
        max_transfer_size: t.max_transfer_size.map(|s| s.0),
        num_workers: t.num_workers,
        enable_async: h.enable_async,
        timeout_ms: h.timeout_ms,
        connect_timeout_ms: None,
        retry_times: h.retry_times,
        memory: h
            .memory
            .into_iter()
            .map(|(k, v)| (k, serde_json::to_value(v).unwrap_or(serde_json::Value::Null)))
            .collect(),
        batch_enable: t.batch_enable,
        max_batch_size: t.max_batch_size,
        merge_threshold: t.merge_threshold.map(|s| s.0),
        batch_linger_us: 0,
    }
}

/// Check the transport choice: `ascend` loads kvpool's HIXL shim and starts the HIXL engine, or
/// stops start-up naming the library that is missing.
fn check_transport(cfg: &Config) -> Result<Option<kvpool_hixl::HixlTransport>, ServerError> {
    match cfg.transport.protocol {
        config::Protocol::Quic | config::Protocol::Shm => Ok(None),
        config::Protocol::Ascend => {
            let hcfg = hixl_config(cfg);
            let t = kvpool_hixl::HixlTransport::new(&hcfg)
                .map_err(|e| ServerError::Transport { protocol: "ascend".into(), why: e.to_string() })?;
            info!(engine = t.engine_name(), library = t.library(), backend = t.backend(), "HIXL engine started");
            if t.backend() != "hixl" {
                warn!(
                    library = t.library(),
                    "the HIXL library is kvpool's shared-memory stand-in, not HIXL: for tests only"
                );
            }
            warn!("protocol = \"ascend\": clients of this node are served over QUIC; the HIXL engine carries one-sided transfers between storage nodes");
            Ok(Some(t))
        }
    }
}

/// The copy engine with the DRAM segment registered, and the shm socket when `shm` is on.
fn data_path(cfg: &Config, store: &Store, data_dir: &Path) -> Option<service::DataPath> {
    use kvpool_transport::Transport;
    let transport = Arc::new(kvpool_transport::copy::CopyEngine::new(cfg.transport.copy_threads as usize));
    let (addr, len) = store.dram_segment();
    let region = kvpool_transport::Region { addr, len, kind: kvpool_transport::MemKind::Host };
    // SAFETY: the segment lives as long as the store, which outlives the server's requests.
    let segment = unsafe { transport.register(region) }.ok()?;
    let shm = match cfg.transport.protocol {
        config::Protocol::Shm => {
            let path = cfg.transport.shm_socket.clone().unwrap_or_else(|| data_dir.join("shm.sock"));
            let allowed = cfg.transport.shm_allowed_uids.clone();
            match kvpool_transport::shm::ShmServer::start(&path, transport.clone(), allowed) {
                Ok(s) => {
                    info!(socket = %path.display(), "shared memory offered to same-host clients");
                    Some(s)
                }
                Err(e) => {
                    warn!(socket = %path.display(), error = %e, "cannot open the shm socket; same-host clients use QUIC");
                    None
                }
            }
        }
        _ => None,
    };
    // The control channel goes with shm: both serve clients on this host only.
    let local = shm.as_ref().and_then(|s| {
        let mut path = s.path().as_os_str().to_owned();
        path.push(".ctl");
        let path = PathBuf::from(path);
        match service::local::LocalControl::bind(&path, cfg.transport.shm_allowed_uids.clone(), cfg.limits.max_frame.0 as u32) {
            Ok(l) => Some(l),
            Err(e) => {
                warn!(socket = %path.display(), error = %e, "cannot open the control socket; same-host clients send requests over QUIC");
                None
            }
        }
    });
    Some(service::DataPath { transport, segment, shm, local })
}

/// Open the data directory, the store and the policy engine (restoring active modules).
pub async fn open_node(cfg: &Config) -> Result<Node, ServerError> {
    cfg.validate()?;
    let hixl = check_transport(cfg)?;
    let data_dir = cfg.server.data_dir.clone();
    std::fs::create_dir_all(&data_dir).map_err(|source| ServerError::DataDir { path: data_dir.clone(), source })?;
    let metrics = Arc::new(Metrics::new());
    let store_cfg = StoreConfig {
        data_dir: data_dir.clone(),
        dram_bytes: cfg.dram.size.0,
        dram_high: cfg.dram.high_watermark,
        dram_low: cfg.dram.low_watermark,
        dram_populate: cfg.dram.populate,
        ssd_dir: (cfg.ssd.capacity.0 > 0).then(|| cfg.ssd_dir()),
        ssd_bytes: cfg.ssd.capacity.0,
        ssd_high: cfg.ssd.high_watermark,
        ssd_low: cfg.ssd.low_watermark,
        ssd_fsync: cfg.ssd.fsync,
        meta_cache: cfg.ssd.metadata_cache.0,
        lease_ttl: Duration::from_millis(cfg.cache.lease_ttl_ms),
        soft_pin_ttl: Duration::from_millis(cfg.cache.soft_pin_ttl_ms),
        put_wait: Duration::from_millis(cfg.cache.put_wait_ms),
        promote_on_hit: cfg.cache.promote_on_hit,
    };
    let store = Store::open(store_cfg, metrics.clone(), policy::builtin_policies(cfg.cache.store_threshold))?;
    let p = &cfg.policy;
    let host = kvpool_policy_host::HostConfig {
        deadline: if p.fuel_per_call > 0 {
            kvpool_policy_host::Deadline::Fuel(p.fuel_per_call)
        } else {
            kvpool_policy_host::Deadline::Epoch { tick: Duration::from_millis(1), ticks: p.call_deadline_ms.max(1) }
        },
        memory_limit: p.memory_limit.0 as usize,
        max_output: p.max_output as usize,
        cache_dir: Some(p.cache_dir.clone().unwrap_or_else(|| data_dir.join("policy-cache"))),
        max_consecutive_faults: p.max_faults,
        max_total_faults: p.max_faults,
        ..kvpool_policy_host::HostConfig::default()
    };
    let policies = policy::PolicyManager::new(host, store.clone(), store.meta().db(), cfg.cache.store_threshold)?;
    // Modules active before a restart come back before the first request is served.
    policies.restore().await;

    let mut keys = cfg.auth.keys.clone();
    let mut api_key_file = None;
    if keys.is_empty() {
        let (entry, path) = default_key(&data_dir)?;
        info!(path = %path.display(), "no api keys configured: embedded default admin key (tenant \"default\")");
        keys.push(entry);
        api_key_file = Some(path);
    }
    let auth = auth::Auth::new(&keys, |name| tenant_id(store.meta(), name));
    let limits = Limits {
        max_frame: cfg.limits.max_frame.0 as u32,
        max_key_len: cfg.limits.max_key_len,
        max_value_size: cfg.limits.max_value_size.0,
        max_batch: cfg.limits.max_batch,
    };
    let data_path = data_path(cfg, &store, &data_dir);
    let events = (cfg.events.buffer > 0).then(|| {
        let log = Arc::new(events::EventLog::new(
            cfg.events.buffer as usize,
            cfg.events.max_subscribers as usize,
            metrics.clone(),
        ));
        // A fresh store: nothing else has attached a log.
        let _ = store.attach_events(log.clone());
        log
    });
    let master = (cfg.cluster.role == config::Role::Master).then(|| {
        let meta_store = store.clone();
        Arc::new(cluster::Master::new(
            cfg.cluster.report_ms,
            Duration::from_millis(cfg.cluster.node_timeout_ms),
            Box::new(move |name: &str| tenant_id(meta_store.meta(), name)),
            events.clone(),
        ))
    });
    let shared = Arc::new(service::Shared {
        store,
        auth: Arc::new(auth),
        metrics,
        limits,
        timeouts: service::Timeouts {
            request: Duration::from_millis(cfg.limits.request_timeout_ms),
            min_rate: cfg.limits.min_transfer_rate.0,
        },
        server_name: format!("kvpool {}", env!("CARGO_PKG_VERSION")),
        started: Instant::now(),
        max_connections: cfg.server.max_connections,
        policies,
        max_module_size: cfg.policy.max_module_size.0,
        paths: Default::default(),
        data_path,
        events,
        node: node_name(cfg),
        role: match master {
            Some(m) => service::Role::Master(m),
            None => service::Role::Node,
        },
        bulk: Default::default(),
    });
    Ok(Node { shared, data_dir, api_key_file, hixl })
}

/// This node's name in KV events: `server.advertise_host`, else the host name.
fn node_name(cfg: &Config) -> String {
    cfg.server.advertise_host.clone().filter(|h| !h.is_empty()).unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into())
    })
}

/// Start every part of the server and return once it accepts connections.
pub async fn start(cfg: Config) -> Result<ServerHandle, ServerError> {
    let Node { shared, data_dir, api_key_file, hixl } = open_node(&cfg).await?;
    let store = shared.store.clone();

    let tls = tls::load_or_generate(
        cfg.server.cert.as_deref(),
        cfg.server.key.as_deref(),
        &data_dir,
        &cfg.server.server_name,
    )?;
    if tls.generated {
        info!(cert = %tls.cert_path.display(), "generated a self-signed certificate");
    }
    info!(fingerprint = %tls.fingerprint, "server certificate SHA-256");

    let addr: SocketAddr = cfg.server.listen.parse().map_err(|_| ServerError::Addr(cfg.server.listen.clone()))?;
    let listen_err = |source| ServerError::Listen { addr: cfg.server.listen.clone(), source };
    let (sock, bufs) = kvpool_net::bind_udp(addr, cfg.quic.udp_buffer.0 as usize).map_err(|e| match e {
        kvpool_net::NetError::Socket { source, .. } => listen_err(source),
        other => listen_err(std::io::Error::other(other.to_string())),
    })?;
    info!(recv = bufs.recv, send = bufs.send, "UDP socket buffers granted");
    let configs = quic_server_configs(&tls, &cfg, &bufs)?;
    let endpoint = kvpool_net::endpoint_with(sock, Some((*configs.network).clone()), cfg.quic.drivers)
        .map_err(|e| listen_err(std::io::Error::other(e.to_string())))?;
    let quic_addr = endpoint.local_addr().map_err(listen_err)?;
    if cfg.bulk.tcp && shared.role.master().is_none() {
        let door = service::bulk::BulkDoor::bind(
            &cfg.bulk.listen,
            quic_addr,
            bulk_tls(&tls)?,
            cfg.bulk.trusted_networks.clone(),
        )
        .map_err(|source| ServerError::Listen { addr: format!("bulk.listen {:?}", cfg.bulk.listen), source })?;
        let _ = shared.bulk.set(door);
    }
    let mut tasks = vec![
        tokio::spawn(service::serve(endpoint.clone(), shared.clone(), Arc::new(configs))),
        tokio::spawn(service::local::serve(shared.clone())),
        tokio::spawn(service::bulk::serve(shared.clone())),
    ];

    let metrics_addr = match cfg.server.metrics_listen.trim() {
        "" | "off" => None,
        a => {
            let listener = tokio::net::TcpListener::bind(a)
                .await
                .map_err(|source| ServerError::Listen { addr: a.into(), source })?;
            let bound = listener.local_addr().ok();
            tasks.push(tokio::spawn(serve_metrics(listener, shared.clone())));
            bound
        }
    };

    let interval = Duration::from_millis(cfg.cache.eviction_interval_ms.max(1));
    let s2 = store.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = s2.kick.notified() => {}
            }
            s2.maintain().await;
        }
    }));

    if let (Some(m), Some(etcd)) = (shared.role.master().cloned(), etcd_of(&cfg)?) {
        // Follow until elected.
        m.set_leading(false);
        let addr = advertised_addr(&cfg, quic_addr);
        let me = kvpool_etcd::LeaderInfo {
            name: cfg.cluster.node_name.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| addr.clone()),
            addr,
            server_name: cfg.server.server_name.clone(),
            fingerprint: tls.fingerprint.clone(),
        };
        let (prefix, ttl) = (cfg.cluster.etcd_prefix.clone(), i64::from(cfg.cluster.leader_ttl_s));
        tasks.push(tokio::spawn(cluster::leader::campaign(m, etcd, prefix, me, ttl)));
    }
    if let Some(m) = shared.role.master().cloned() {
        let every = Duration::from_millis(u64::from(cfg.cluster.report_ms).max(10) / 2);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                // Forgetting a dead node walks the whole map (shard by shard): off the runtime.
                let m = m.clone();
                let _ = tokio::task::spawn_blocking(move || m.sweep(Instant::now())).await;
            }
        }));
    }
    if cfg.cluster.role == config::Role::Storage {
        let link = storage_link(&cfg, quic_addr, &tls.fingerprint)?;
        info!(master = %link.master, name = %link.name, addr = %link.addr, "storage node: joining the master");
        if cfg.cluster.offload_max_fill > 0.0 {
            let o = cluster::storage::Offloader::new(link.clone(), shared.auth.clone(), cfg.cluster.offload_max_fill);
            store.set_offload(Arc::new(o));
        }
        let node = cluster::storage::ThisNode {
            store: store.clone(),
            auth: shared.auth.clone(),
            metrics: shared.metrics.clone(),
            events: shared.events.clone(),
        };
        tasks.push(tokio::spawn(cluster::storage::run(node, link)));
    }

    let endpoint_info = serde_json::json!({
        "quic_addr": quic_addr.to_string(),
        "metrics_addr": metrics_addr.map(|a| a.to_string()),
        "fingerprint": tls.fingerprint,
        "cert_path": std::fs::canonicalize(&tls.cert_path).unwrap_or(tls.cert_path.clone()),
        "server_name": cfg.server.server_name,
        "pid": std::process::id(),
    });
    let ep_path = data_dir.join("endpoint.json");
    let tmp = data_dir.join("endpoint.json.tmp");
    if let Err(e) = std::fs::write(&tmp, endpoint_info.to_string()).and_then(|_| std::fs::rename(&tmp, &ep_path)) {
        warn!(error = %e, "cannot write endpoint.json");
    }
    info!(%quic_addr, metrics = ?metrics_addr, data_dir = %data_dir.display(), "kvpool server ready");
    Ok(ServerHandle {
        quic_addr,
        metrics_addr,
        fingerprint: tls.fingerprint,
        cert_path: tls.cert_path,
        data_dir,
        api_key_file,
        endpoint,
        store,
        tasks,
        hixl,
    })
}

/// The address clients reach this node at: `server.advertise_host` (else the listen IP, else
/// loopback for a wildcard listen address: a one-host pool) and the bound port.
fn advertised_addr(cfg: &Config, quic_addr: SocketAddr) -> String {
    let host = match cfg.server.advertise_host.as_deref().filter(|h| !h.is_empty()) {
        Some(h) => h.to_string(),
        None if quic_addr.ip().is_unspecified() => "127.0.0.1".to_string(),
        None => quic_addr.ip().to_string(),
    };
    if host.contains(':') {
        format!("[{host}]:{}", quic_addr.port())
    } else {
        format!("{host}:{}", quic_addr.port())
    }
}

fn etcd_of(cfg: &Config) -> Result<Option<kvpool_etcd::Etcd>, ServerError> {
    cfg.cluster
        .etcd
        .as_deref()
        .map(|e| {
            kvpool_etcd::Etcd::new(e).map_err(|e| {
                ServerError::Config(config::ConfigError::Invalid { field: "cluster.etcd", message: e.to_string() })
            })
        })
        .transpose()
}

/// How a storage node reaches its master and presents itself (config validated beforehand).
fn storage_link(cfg: &Config, quic_addr: SocketAddr, fingerprint: &str) -> Result<cluster::storage::Link, ServerError> {
    let bad =
        |field: &'static str, message: String| ServerError::Config(config::ConfigError::Invalid { field, message });
    let c = &cfg.cluster;
    let master = match etcd_of(cfg)? {
        Some(etcd) => cluster::storage::MasterAt::Etcd { etcd, prefix: c.etcd_prefix.clone() },
        None => {
            let addr = c.master.clone().ok_or_else(|| bad("cluster.master", "missing".into()))?;
            let trust = match (&c.master_fingerprint, &c.master_ca) {
                (Some(fp), _) => kvpool_client::Trust::Fingerprint(
                    kvpool_client::parse_fingerprint(fp)
                        .map_err(|e| bad("cluster.master_fingerprint", e.to_string()))?,
                ),
                (None, Some(ca)) => kvpool_client::Trust::CaFile(ca.clone()),
                (None, None) => return Err(bad("cluster.master_fingerprint", "or cluster.master_ca is needed".into())),
            };
            cluster::storage::MasterAt::Fixed { addr, server_name: c.master_server_name.clone(), trust }
        }
    };
    let key_file = c.master_key_file.as_ref().ok_or_else(|| bad("cluster.master_key_file", "missing".into()))?;
    let api_key = kvpool_client::read_key_file(key_file).map_err(|e| bad("cluster.master_key_file", e.to_string()))?;
    let addr = advertised_addr(cfg, quic_addr);
    let mut fp = [0u8; 32];
    hex::decode_to_slice(fingerprint, &mut fp).map_err(|e| bad("server.cert", format!("fingerprint: {e}")))?;
    Ok(cluster::storage::Link {
        master,
        api_key,
        me: Arc::default(),
        name: c.node_name.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| addr.clone()),
        addr,
        server_name: cfg.server.server_name.clone(),
        fingerprint: fp,
        peers: match cfg.bulk.peers {
            config::PeerPath::Quic => kvpool_client::BulkChoice::Quic,
            config::PeerPath::Tcp => kvpool_client::BulkChoice::Tcp,
        },
        trusted_networks: cfg.bulk.trusted_networks.clone(),
    })
}

async fn serve_metrics(listener: tokio::net::TcpListener, shared: Arc<service::Shared>) {
    use http_body_util::Full;
    use hyper::{body::Bytes, service::service_fn, Response};
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let shared = shared.clone();
                async move {
                    let resp = match req.uri().path() {
                        "/metrics" => Response::builder()
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(shared.render_metrics()))),
                        "/healthz" => Response::builder().body(Full::new(Bytes::from_static(b"ok\n"))),
                        _ => Response::builder().status(404).body(Full::new(Bytes::from_static(b"not found\n"))),
                    };
                    Ok::<_, hyper::http::Error>(resp.unwrap_or_default())
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
        });
    }
}

#[cfg(test)]
mod hixl_config_tests {
    use std::time::Duration;

    #[test]
    fn the_seed_hixl_file_reaches_the_hixl_plan() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("hixl.toml");
        std::fs::write(
            &f,
            "[hixl]\ndevice_type = \"npu\"\ndevice_id = 3\nlink_type = \"roce\"\nmax_transfer_size = \"4MiB\"\n\
             num_workers = 4\nenable_async = false\ntimeout_ms = 2500\nretry_times = 1\n[hixl.memory]\n\
             buffer_pool = \"4:8\"\n[hixl.batch]\nenable = true\nmax_batch_size = 16\nmerge_threshold = \"256KiB\"\n",
        )
        .unwrap();
        let loaded = crate::config::load(None, None, Some(&f)).unwrap();
        let h = super::hixl_config(&loaded.config);
        let p = kvpool_hixl::plan(&h, &|_| None).unwrap();
        assert_eq!(p.device_id, 3);
        assert_eq!(p.options["BufferPool"], "4:8");
        assert_eq!(p.options["env:HCCL_INTRA_ROCE_ENABLE"], "1");
        assert!(p.options["GlobalResourceConfig"].contains("roce:device"), "{:?}", p.options);
        assert_eq!(p.transfer_timeout, Duration::from_millis(2500));
        assert_eq!(p.retry_times, 1);
        assert_eq!(p.mode, kvpool_hixl::config::Mode::Sync { workers: 4 });
        assert_eq!(p.batch.max_batch, 16);
        assert_eq!(p.batch.merge_threshold, 256 << 10);
        assert_eq!(p.batch.max_transfer, Some(4 << 20));
    }
}
