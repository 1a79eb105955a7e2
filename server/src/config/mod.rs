//! kvpool configuration: its own TOML, plus the fields of Mooncake's `mooncake_store_config.json`
//! and of the HIXL transfer TOML, mapped onto the same settings. Unknown fields are reported
//! (never silently ignored) through `LoadedConfig::warnings`.

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

mod bulk;
mod foreign;
mod load;
#[cfg(test)]
mod tests;

pub use bulk::{trusted, BulkSection, PeerPath};
pub use load::load;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid setting {field}: {message}")]
    Invalid { field: &'static str, message: String },
}

/// A byte size that accepts `4294967296`, `"4GiB"`, `"4GB"`, `"512 MiB"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Size(pub u64);

impl Size {
    pub fn parse(s: &str) -> Result<Size, String> {
        let t = s.trim();
        if let Ok(n) = t.parse::<u64>() {
            return Ok(Size(n));
        }
        t.parse::<bytesize::ByteSize>()
            .map(|b| Size(b.as_u64()))
            .map_err(|e| format!("{s:?} is not a size ({e}); use e.g. 1073741824, \"1GiB\" or \"1GB\""))
    }
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", bytesize::ByteSize(self.0).to_string_as(true))
    }
}

impl Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => Size::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub server: ServerSection,
    pub limits: LimitsSection,
    pub dram: DramSection,
    pub ssd: SsdSection,
    pub cache: CacheSection,
    pub auth: AuthSection,
    pub transport: TransportSection,
    pub policy: PolicySection,
    pub quic: QuicSection,
    pub events: EventsSection,
    pub cluster: ClusterSection,
    pub bulk: BulkSection,
}

/// What this process is in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// One process that is the whole pool (the embedded default).
    #[default]
    All,
    /// The control plane of a cluster: where blocks are (reported by the storage nodes), node
    /// liveness, and placement of new blocks. Holds no block data.
    Master,
    /// Capacity of a cluster: stores and serves blocks, and reports them to the master.
    Storage,
}

/// Cluster roles (see README "Cluster").
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterSection {
    pub role: Role,
    /// Storage: the master's QUIC address (`host:port`).
    pub master: Option<String>,
    /// Storage: how to trust the master: the SHA-256 fingerprint of its certificate (64 hex
    /// digits) or a CA file.
    pub master_fingerprint: Option<String>,
    pub master_ca: Option<PathBuf>,
    /// Storage: TLS server name of the master.
    pub master_server_name: String,
    /// Storage: file holding an admin API key of the master (of every master, with etcd).
    pub master_key_file: Option<PathBuf>,
    /// Storage: this node's name in the pool (default: the address it advertises).
    pub node_name: Option<String>,
    /// Master: how often storage nodes report (ms); a node silent for `node_timeout_ms` is dead.
    pub report_ms: u32,
    pub node_timeout_ms: u64,
    /// etcd endpoints (`http://host:port`, comma-separated) for masters' leader election;
    /// storage nodes and clients then find the leader there (no `master` needed). Without it a
    /// single master runs with no outside dependency.
    pub etcd: Option<String>,
    /// Key prefix of this cluster in etcd.
    pub etcd_prefix: String,
    /// Master: TTL of the leader's etcd lease (seconds; etcd grants at least its minimum).
    pub leader_ttl_s: u32,
    /// Storage: DRAM victims go to another node's free DRAM before this node's SSD, while that
    /// node's DRAM stays below this fill with them; 0 turns it off.
    pub offload_max_fill: f64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            role: Role::All,
            master: None,
            master_fingerprint: None,
            master_ca: None,
            master_server_name: "localhost".into(),
            master_key_file: None,
            node_name: None,
            report_ms: 500,
            node_timeout_ms: 3_000,
            etcd: None,
            etcd_prefix: "/kvpool/".into(),
            leader_ttl_s: 2,
            offload_max_fill: 0.8,
        }
    }
}

/// KV events (`Subscribe`): the log subscribers read from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct EventsSection {
    /// Newest events kept for subscribers; one that falls further behind is told it lagged.
    /// 0 turns the log off (subscriptions are refused).
    pub buffer: u32,
    /// Subscriptions open at once, over all connections.
    pub max_subscribers: u32,
}

impl Default for EventsSection {
    fn default() -> Self {
        EventsSection { buffer: 65_536, max_subscribers: 64 }
    }
}

/// UDP and QUIC settings of the client API (the defaults are the measured choice; see
/// `kvpool_net`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct QuicSection {
    /// `auto` (large datagrams with offload off for same-host peers, segmentation offload with
    /// path-MTU discovery up to 8,972 bytes across a network), `offload`, or `large-datagrams`.
    pub segmentation: kvpool_net::Segmentation,
    /// UDP socket buffer to ask the kernel for (capped by `net.core.rmem_max` / `wmem_max`).
    pub udp_buffer: Size,
    /// Where quinn's tasks run: `caller` (the server's worker threads: connections' packet work
    /// spreads over cores) or `io-thread` (one thread for the endpoint and every connection:
    /// fewer cross-thread hand-offs per packet, one core's worth of QUIC in all).
    pub drivers: kvpool_net::Drivers,
}

impl Default for QuicSection {
    fn default() -> Self {
        QuicSection {
            segmentation: kvpool_net::Segmentation::Auto,
            udp_buffer: Size(kvpool_net::DEFAULT_UDP_BUFFER as u64),
            drivers: kvpool_net::Drivers::Caller,
        }
    }
}

impl QuicSection {
    pub fn tuning(&self) -> kvpool_net::QuicTuning {
        kvpool_net::QuicTuning {
            segmentation: self.segmentation,
            udp_buffer: self.udp_buffer.0 as usize,
            drivers: self.drivers,
        }
    }
}

/// The Wasm policy sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicySection {
    /// Wall-clock deadline of one policy call (epoch interruption), milliseconds.
    pub call_deadline_ms: u64,
    /// When > 0, bound calls by fuel (Wasm operations) instead of a wall-clock deadline.
    pub fuel_per_call: u64,
    /// Linear memory limit of one module instance.
    pub memory_limit: Size,
    /// Faults (in a row, or in total) that quarantine a module.
    pub max_faults: u32,
    /// Longest list a module may return.
    pub max_output: u32,
    /// Compiled-module cache; empty = `<data_dir>/policy-cache`.
    pub cache_dir: Option<PathBuf>,
    /// Largest module accepted by `policy load`.
    pub max_module_size: Size,
}

impl Default for PolicySection {
    fn default() -> Self {
        PolicySection {
            call_deadline_ms: 200,
            fuel_per_call: 0,
            // ~300-450 bytes of module state per resident block: room for ~600K blocks.
            memory_limit: Size(256 << 20),
            max_faults: 3,
            max_output: 1 << 20,
            cache_dir: None,
            max_module_size: Size(16 << 20),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerSection {
    /// QUIC listen address (UDP). Port 0 picks a free port (see `endpoint.json`).
    pub listen: String,
    /// Prometheus `/metrics` HTTP address; empty or "off" disables it.
    pub metrics_listen: String,
    /// Data directory: sled metadata, TLS material, SSD tier default, endpoint.json.
    pub data_dir: PathBuf,
    /// PEM certificate chain and private key; empty = self-signed, generated on first start.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Name put in the generated certificate and advertised to clients.
    pub server_name: String,
    pub idle_timeout_ms: u64,
    /// Concurrent request streams per connection.
    pub max_streams_per_connection: u32,
    pub max_connections: u32,
    /// Host other nodes reach us at (Mooncake's `local_hostname`); informational for now.
    pub advertise_host: Option<String>,
    /// Threads serving requests; 0 = one per core. On a host shared with inference engines,
    /// fewer threads mean fewer cross-thread wake-ups per request (lower latency) and cores left
    /// to the engines; copies to same-host clients run on `transport.copy_threads` besides.
    pub worker_threads: u32,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: "127.0.0.1:7100".into(),
            metrics_listen: "127.0.0.1:9100".into(),
            data_dir: PathBuf::from("kvpool-data"),
            cert: None,
            key: None,
            server_name: "localhost".into(),
            idle_timeout_ms: 30_000,
            max_streams_per_connection: 256,
            max_connections: 4096,
            advertise_host: None,
            worker_threads: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsSection {
    pub max_key_len: u32,
    pub max_value_size: Size,
    pub max_batch: u32,
    /// Largest request header frame (bulk bytes are not framed).
    pub max_frame: Size,
    /// Time a client has, from opening a request stream, to deliver the whole request frame and
    /// (for requests without value bytes) its end of stream; also the grace of the value deadline.
    pub request_timeout_ms: u64,
    /// Slowest transfer the server waits for, in bytes per second: value bytes must arrive (and
    /// response bytes be read) within `request_timeout_ms` plus their size at this rate. A
    /// stalled client can therefore hold DRAM only that long.
    pub min_transfer_rate: Size,
}

impl Default for LimitsSection {
    fn default() -> Self {
        LimitsSection {
            max_key_len: 1024,
            max_value_size: Size(64 << 20),
            max_batch: 1024,
            max_frame: Size(4 << 20),
            request_timeout_ms: 10_000,
            min_transfer_rate: Size(8 << 20),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct DramSection {
    /// Size of the pre-allocated DRAM segment (Mooncake `global_segment_size`).
    pub size: Size,
    /// Eviction starts above this fraction of `size` ...
    pub high_watermark: f64,
    /// ... and frees down to this one.
    pub low_watermark: f64,
    /// Fault every page of the segment in at start: the memory is committed up front (as
    /// memory registered with a transport must be) and no put pays for first-touch page faults.
    pub populate: bool,
}

impl Default for DramSection {
    fn default() -> Self {
        DramSection { size: Size(1 << 30), high_watermark: 0.95, low_watermark: 0.85, populate: true }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SsdSection {
    /// Directory of the SSD tier; empty = `<data_dir>/ssd`.
    pub dir: Option<PathBuf>,
    /// Capacity of the SSD tier; 0 disables the tier.
    pub capacity: Size,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// fsync every block file before it is committed (survives power loss, costs latency;
    /// without it a process crash still loses nothing that was committed).
    pub fsync: bool,
    /// Memory sled may use to cache the SSD blocks' records (sled's own default is 1 GiB, and
    /// left alone it holds every record: about 260 B per SSD block).
    pub metadata_cache: Size,
}

impl Default for SsdSection {
    fn default() -> Self {
        SsdSection {
            dir: None,
            capacity: Size(8 << 30),
            high_watermark: 0.95,
            low_watermark: 0.85,
            fsync: false,
            metadata_cache: Size(64 << 20),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheSection {
    /// Admission: a block enters only when the prefix it completes has at least this many
    /// tokens (vLLM `store_threshold`); 0 admits all.
    pub store_threshold: u64,
    /// Lease granted by `get` so eviction cannot free a block under an in-flight read.
    pub lease_ttl_ms: u64,
    /// Default soft-pin time to live.
    pub soft_pin_ttl_ms: u64,
    /// How long a put waits for eviction to make space before failing with `NoSpace`.
    pub put_wait_ms: u64,
    /// Period of the background evictor.
    pub eviction_interval_ms: u64,
    /// Copy an SSD hit back into DRAM when DRAM has room below its high watermark.
    pub promote_on_hit: bool,
}

impl Default for CacheSection {
    fn default() -> Self {
        CacheSection {
            store_threshold: 0,
            lease_ttl_ms: 5_000,
            soft_pin_ttl_ms: 30 * 60 * 1000,
            put_wait_ms: 2_000,
            eviction_interval_ms: 10,
            promote_on_hit: true,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AuthSection {
    /// API keys, stored as SHA-256 hashes only. Empty = the embedded default: one admin key
    /// generated on first start into `<data_dir>/api-key`.
    pub keys: Vec<ApiKeyEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiKeyEntry {
    pub tenant: String,
    /// Hex SHA-256 of the key.
    pub sha256: String,
    #[serde(default)]
    pub admin: bool,
}

/// The data paths a server offers (the QUIC control path is always there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Block bytes in band on QUIC only.
    Quic,
    /// QUIC, plus shared memory for clients on the same host (memfd buffers, the server copies).
    Shm,
    /// HIXL on Ascend NPUs (needs CANN; not in this build).
    Ascend,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Quic => "quic",
            Protocol::Shm => "shm",
            Protocol::Ascend => "ascend",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TransportSection {
    /// `shm` (default: QUIC, plus shared memory for same-host clients), `quic` (QUIC only),
    /// `ascend` (HIXL; needs CANN).
    pub protocol: Protocol,
    /// Unix socket same-host clients attach their buffers through; empty = `<data_dir>/shm.sock`.
    pub shm_socket: Option<PathBuf>,
    /// Users (uids) allowed on the shm socket besides the server's own; empty = only its own.
    pub shm_allowed_uids: Vec<u32>,
    /// Threads copying between the segment and same-host clients' buffers.
    pub copy_threads: u32,
    pub device_name: Option<String>,
    pub device_id: Option<u32>,
    /// Mooncake `metadata_server` (etcd endpoints or P2PHANDSHAKE); used by cluster roles.
    pub metadata_server: Option<String>,
    /// Client-side staging buffer (Mooncake `local_buffer_size`).
    pub local_buffer_size: Option<Size>,
    pub max_transfer_size: Option<Size>,
    pub num_workers: Option<u32>,
    pub batch_enable: bool,
    pub max_batch_size: Option<u32>,
    pub merge_threshold: Option<Size>,
    pub hixl: Option<HixlSettings>,
}

impl Default for TransportSection {
    fn default() -> Self {
        TransportSection {
            protocol: Protocol::Shm,
            shm_socket: None,
            shm_allowed_uids: Vec::new(),
            copy_threads: 2,
            device_name: None,
            device_id: None,
            metadata_server: None,
            local_buffer_size: None,
            max_transfer_size: None,
            num_workers: None,
            batch_enable: true,
            max_batch_size: None,
            merge_threshold: None,
            hixl: None,
        }
    }
}

/// HIXL-only settings kept for the Ascend transport (see docs/HIXL.md for how each reaches HIXL).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HixlSettings {
    /// kvpool's shim over HIXL (`libkvpool_hixl_shim.so`); unset: `KVPOOL_HIXL_SHIM`, then the
    /// shim this build compiled (only where CANN was installed), then the library path.
    pub shim_path: Option<PathBuf>,
    /// This host's address in the HIXL engine name (`ip:port`) that peers connect to.
    pub local_host: Option<String>,
    /// The HIXL engine's listen port; unset: the first free one from `ASCEND_BASE_PORT`.
    pub engine_port: Option<u16>,
    pub device_type: Option<String>,
    /// HIXL has no `link_type` option: "hccs"/"roce" map to `protocol_desc` ("hccs:device", ...).
    pub protocol_desc: Option<String>,
    pub enable_async: Option<bool>,
    pub timeout_ms: Option<u64>,
    pub retry_times: Option<u32>,
    pub memory: BTreeMap<String, toml::Value>,
}

/// The result of loading: the effective config, where it came from, and what was not understood.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub config: Config,
    pub sources: Vec<String>,
    pub warnings: Vec<String>,
}

impl Config {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let wm = |field: &'static str, hi: f64, lo: f64| {
            if !(0.0 < lo && lo <= hi && hi <= 1.0) {
                Err(ConfigError::Invalid { field, message: format!("need 0 < low ({lo}) <= high ({hi}) <= 1") })
            } else {
                Ok(())
            }
        };
        wm("dram watermarks", self.dram.high_watermark, self.dram.low_watermark)?;
        let c = &self.cluster;
        if c.role == Role::Storage {
            let missing = |field: &'static str| ConfigError::Invalid {
                field,
                message: "a storage node needs it (--master, --master-fingerprint or master_ca, --master-key-file)"
                    .into(),
            };
            // With etcd the leader's address and fingerprint come from there.
            if c.etcd.is_none() && c.master.as_deref().is_none_or(str::is_empty) {
                return Err(missing("cluster.master"));
            }
            if c.etcd.is_none() && c.master_fingerprint.is_none() && c.master_ca.is_none() {
                return Err(missing("cluster.master_fingerprint"));
            }
            if c.master_key_file.is_none() {
                return Err(missing("cluster.master_key_file"));
            }
            if self.events.buffer == 0 {
                return Err(ConfigError::Invalid {
                    field: "events.buffer",
                    message: "a storage node reports its changes to the master through the event log: it must be on"
                        .into(),
                });
            }
        }
        if let Some(e) = &c.etcd {
            kvpool_etcd::Etcd::new(e)
                .map_err(|e| ConfigError::Invalid { field: "cluster.etcd", message: e.to_string() })?;
        }
        if !(0.0..=1.0).contains(&c.offload_max_fill) {
            return Err(ConfigError::Invalid { field: "cluster.offload_max_fill", message: "between 0 and 1".into() });
        }
        if c.leader_ttl_s == 0 {
            return Err(ConfigError::Invalid { field: "cluster.leader_ttl_s", message: "must be positive".into() });
        }
        if c.report_ms == 0 || c.node_timeout_ms < 2 * u64::from(c.report_ms) {
            return Err(ConfigError::Invalid {
                field: "cluster.report_ms / cluster.node_timeout_ms",
                message: "reports must be positive and the node timeout at least two report intervals".into(),
            });
        }
        wm("ssd watermarks", self.ssd.high_watermark, self.ssd.low_watermark)?;
        if self.dram.size.0 < 1 << 20 {
            return Err(ConfigError::Invalid { field: "dram.size", message: "must be at least 1MiB".into() });
        }
        if self.dram.size.0 > crate::store::dram::MAX_SEGMENT {
            return Err(ConfigError::Invalid {
                field: "dram.size",
                message: format!("at most {} per node", Size(crate::store::dram::MAX_SEGMENT)),
            });
        }
        if self.limits.max_frame.0 > kvpool_proto::codec::DECODE_LIMIT as u64 || self.limits.max_frame.0 < 4096 {
            return Err(ConfigError::Invalid {
                field: "limits.max_frame",
                message: "must be between 4KiB and 64MiB".into(),
            });
        }
        if self.limits.max_key_len == 0 || self.limits.max_batch == 0 || self.limits.max_value_size.0 == 0 {
            return Err(ConfigError::Invalid { field: "limits", message: "limits must be positive".into() });
        }
        // A block's key length is kept in 2 bytes (paid per resident block).
        if self.limits.max_key_len as usize > kvpool_core::MAX_KEY_LEN {
            return Err(ConfigError::Invalid {
                field: "limits.max_key_len",
                message: format!("must be at most {} bytes", kvpool_core::MAX_KEY_LEN),
            });
        }
        // A block keeps its size in 4 bytes (paid per resident block).
        if self.limits.max_value_size.0 > u64::from(u32::MAX) {
            return Err(ConfigError::Invalid { field: "limits.max_value_size", message: "must be below 4GiB".into() });
        }
        if self.limits.request_timeout_ms == 0 || self.limits.min_transfer_rate.0 < 1024 {
            return Err(ConfigError::Invalid {
                field: "limits.request_timeout_ms / limits.min_transfer_rate",
                message: "the timeout must be positive and the rate at least 1KiB (per second)".into(),
            });
        }
        for k in &self.auth.keys {
            if k.sha256.len() != 64 || hex::decode(&k.sha256).is_err() {
                return Err(ConfigError::Invalid {
                    field: "auth.keys.sha256",
                    message: format!("tenant {:?}: expected 64 hex digits (sha256 of the key)", k.tenant),
                });
            }
        }
        if self.events.max_subscribers == 0 {
            return Err(ConfigError::Invalid {
                field: "events.max_subscribers",
                message: "at least 1 (to turn events off, set events.buffer = 0)".into(),
            });
        }
        if self.events.buffer > 1 << 24 {
            return Err(ConfigError::Invalid {
                field: "events.buffer",
                message: "at most 16777216 events (each holds its key: about 100 bytes plus the key)".into(),
            });
        }
        if self.transport.copy_threads == 0 || self.transport.copy_threads > 64 {
            return Err(ConfigError::Invalid { field: "transport.copy_threads", message: "1 to 64".into() });
        }
        Ok(())
    }

    pub fn ssd_dir(&self) -> PathBuf {
        self.ssd.dir.clone().unwrap_or_else(|| self.server.data_dir.join("ssd"))
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}
