//! kvpool's HIXL settings (the seed's `hixl_transfer_config.toml` shape) and how they become
//! HIXL's real options, environment variables and kvpool's engine behaviour.
//!
//! HIXL has no `link_type`, `timeout_ms`, `retry_times`, `num_workers` or batching options: the
//! link type is `GlobalResourceConfig`'s `comm_resource_config.protocol_desc` (and HCCL's
//! `HCCL_INTRA_ROCE_ENABLE`), while timeouts, retries, concurrency and batching are the caller's
//! job, done here by the engine thread. See docs/HIXL.md for the table.

use crate::error::HixlError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Settings of the HIXL backend. Field names follow the seed's `[hixl]`, `[hixl.memory]` and
/// `[hixl.batch]` tables (flattened), plus what kvpool needs to name the engine and find the shim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HixlConfig {
    /// The shim library; unset: `KVPOOL_HIXL_SHIM`, then the shim this build compiled (where
    /// CANN was installed), then `libkvpool_hixl_shim.so` on the library path.
    pub shim_path: Option<PathBuf>,
    /// This host's address in the engine name (`ip:port`) that peers connect to.
    pub local_host: Option<String>,
    /// The engine's listen port; unset: the first free port from `ASCEND_BASE_PORT` (20000) +
    /// 1000 x device, as Mooncake picks it.
    pub engine_port: Option<u16>,
    pub device_type: Option<String>,
    pub device_id: Option<u32>,
    /// `hccs`, `roce`, `roce_host`, or a `protocol_desc` value such as `roce:host`.
    pub link_type: Option<String>,
    pub max_transfer_size: Option<u64>,
    pub num_workers: Option<u32>,
    pub enable_async: Option<bool>,
    pub timeout_ms: Option<u64>,
    /// Connect timeout; unset: `ASCEND_CONNECT_TIMEOUT`, then `timeout_ms`.
    pub connect_timeout_ms: Option<u64>,
    pub retry_times: Option<u32>,
    /// `[hixl.memory]`.
    pub memory: BTreeMap<String, serde_json::Value>,
    /// `[hixl.batch] enable`.
    pub batch_enable: bool,
    pub max_batch_size: Option<u32>,
    pub merge_threshold: Option<u64>,
    /// How long small descriptors may wait for company before they are submitted (0: only what
    /// queued up while the engine was busy is merged, so an idle engine adds no latency).
    pub batch_linger_us: u64,
}

impl Default for HixlConfig {
    fn default() -> Self {
        HixlConfig {
            shim_path: None,
            local_host: None,
            engine_port: None,
            device_type: None,
            device_id: None,
            link_type: None,
            max_transfer_size: None,
            num_workers: None,
            enable_async: None,
            timeout_ms: None,
            connect_timeout_ms: None,
            retry_times: None,
            memory: BTreeMap::new(),
            batch_enable: true,
            max_batch_size: None,
            merge_threshold: None,
            batch_linger_us: 0,
        }
    }
}

/// Mooncake's default transfer timeout (ASCEND_TRANSFER_TIMEOUT).
pub const DEFAULT_TIMEOUT_MS: u64 = 3000;
/// Mooncake retries a batch twice.
pub const DEFAULT_RETRIES: u32 = 2;
/// Mooncake's ASCEND_THREAD_POOL_SIZE default.
pub const DEFAULT_WORKERS: u32 = 8;
pub const DEFAULT_MAX_BATCH: u32 = 64;
pub const DEFAULT_MERGE_THRESHOLD: u64 = 64 << 10;
/// Mooncake's ASCEND_BASE_PORT default.
pub const DEFAULT_BASE_PORT: u16 = 20000;

/// HIXL's own option names (include/hixl/hixl_types.h); `[hixl.memory]` keys spelled exactly so
/// are passed through.
const HIXL_OPTIONS: [&str; 7] = [
    "BufferPool",
    "RdmaTrafficClass",
    "RdmaServiceLevel",
    "GlobalResourceConfig",
    "AutoConnect",
    "EnableUseFabricMem",
    "LocalCommRes",
];

/// How batches reach HIXL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `TransferAsync` + `GetTransferStatus` from the engine thread, at most this many requests
    /// in flight.
    Async { max_inflight: usize },
    /// `TransferSync` on this many worker threads bound to the engine's ACL context (the mode
    /// that can stage host memory through HIXL's BufferPool).
    Sync { workers: usize },
}

/// How descriptors are grouped into HIXL descriptor lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Merge small descriptors of different posts to one peer and op into one list.
    pub merge: bool,
    /// Descriptors shorter than this are small.
    pub merge_threshold: u64,
    /// Descriptors per HIXL list.
    pub max_batch: usize,
    /// Longer descriptors are split.
    pub max_transfer: Option<u64>,
    pub linger: Duration,
}

/// Everything the engine needs, derived from a [`HixlConfig`] and the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct HixlPlan {
    /// For `aclrtSetDevice` on the engine thread.
    pub device_id: i32,
    pub local_host: String,
    pub engine_port: Option<u16>,
    pub base_port: u16,
    /// HIXL `Initialize` options; keys starting with `env:` are environment variables the shim
    /// sets (unless already set) before initialising.
    pub options: BTreeMap<String, String>,
    pub connect_timeout: Duration,
    pub transfer_timeout: Duration,
    pub retry_times: u32,
    pub mode: Mode,
    pub batch: BatchPolicy,
    /// Things worth a log line (defaults taken, settings without effect).
    pub warnings: Vec<String>,
}

impl HixlPlan {
    /// The engine name for a port: `ip:port`, or `[v6]:port`.
    pub fn engine_name(&self, port: u16) -> String {
        if self.local_host.contains(':') && !self.local_host.starts_with('[') {
            format!("[{}]:{port}", self.local_host)
        } else {
            format!("{}:{port}", self.local_host)
        }
    }
}

fn parse_ms(name: &str, v: Option<String>, warnings: &mut Vec<String>) -> Option<u64> {
    let v = v?;
    match v.trim().parse::<u64>() {
        Ok(ms) => Some(ms),
        Err(_) => {
            warnings.push(format!("{name}={v:?} is not a number of milliseconds; ignored"));
            None
        }
    }
}

fn value_str(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Bool(b) => (if *b { "1" } else { "0" }).to_string(),
        other => other.to_string(),
    }
}

/// Map settings onto HIXL. `env` reads the environment (a parameter so that tests can give one).
pub fn plan(cfg: &HixlConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<HixlPlan, HixlError> {
    let mut warnings = Vec::new();
    let mut options: BTreeMap<String, String> = BTreeMap::new();
    let mut global: serde_json::Map<String, serde_json::Value> = serde_json::Map::new();

    if let Some(t) = cfg.device_type.as_deref() {
        if !matches!(t.to_ascii_lowercase().as_str(), "npu" | "ascend") {
            return Err(HixlError::Config(format!("device_type {t:?}: HIXL drives Ascend NPUs only (\"npu\")")));
        }
    }
    let device_id = match cfg.device_id {
        Some(d) => i32::try_from(d).map_err(|_| HixlError::Config(format!("device_id {d} is out of range")))?,
        None => {
            warnings.push("device_id not set: using NPU 0".into());
            0
        }
    };

    if let Some(l) = cfg.link_type.as_deref() {
        let desc = match l.to_ascii_lowercase().as_str() {
            "hccs" => "hccs:device".to_string(),
            // Older CANN only knows the HCCL switch; newer ones the protocol_desc. Both say RoCE.
            // (The server's config keeps the seed's "roce" as "roce:device": the same.)
            "roce" | "roce:device" => {
                options.insert("env:HCCL_INTRA_ROCE_ENABLE".into(), "1".into());
                "roce:device".to_string()
            }
            "roce_host" => "roce:host".to_string(),
            d if d.contains(':') => d.to_string(),
            other => {
                return Err(HixlError::Config(format!(
                    "link_type {other:?}: expected \"hccs\", \"roce\", \"roce_host\" or a protocol_desc such as \
                     \"roce:host\""
                )))
            }
        };
        global.insert("comm_resource_config.protocol_desc".into(), serde_json::json!([desc]));
    }

    // [hixl.memory]
    let mut buffer_pool: Option<String> = None;
    let mut fabric = false;
    let (mut buf_num, mut buf_mb) = (None, None);
    for (k, v) in &cfg.memory {
        let s = value_str(v);
        match k.as_str() {
            "buffer_pool" => buffer_pool = Some(s),
            "buffer_num" => buf_num = Some(s),
            "buffer_size_mb" => buf_mb = Some(s),
            "use_fabric_mem" | "enable_fabric_mem" => fabric = matches!(s.as_str(), "1" | "true"),
            "listen_port" => {
                global.insert("comm_resource_config.listen_port".into(), serde_json::Value::String(s));
            }
            "rdma_traffic_class" => {
                options.insert("RdmaTrafficClass".into(), s);
            }
            "rdma_service_level" => {
                options.insert("RdmaServiceLevel".into(), s);
            }
            "auto_connect" => {
                options.insert("AutoConnect".into(), s);
            }
            k if HIXL_OPTIONS.contains(&k) => {
                options.insert(k.to_string(), s);
            }
            // Dotted keys are GlobalResourceConfig entries (channel_pool.max_channel, ...).
            k if k.contains('.') => {
                global.insert(k.to_string(), serde_json::Value::String(s));
            }
            other => warnings.push(format!("[hixl.memory] {other} has no HIXL counterpart; ignored")),
        }
    }
    match (buf_num, buf_mb) {
        (Some(n), Some(m)) => buffer_pool = Some(format!("{n}:{m}")),
        (None, None) => {}
        _ => warnings.push("[hixl.memory] buffer_num and buffer_size_mb go together; ignored".into()),
    }
    // Mooncake's override, honoured the same way.
    if let Some(p) = env("ASCEND_BUFFER_POOL") {
        buffer_pool = Some(p);
    }
    if let Some(p) = buffer_pool {
        let ok = p.split_once(':').is_some_and(|(a, b)| a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok());
        if !ok {
            return Err(HixlError::Config(format!("BufferPool {p:?}: expected \"NUM:SIZE_MB\" such as \"4:8\"")));
        }
        options.insert("BufferPool".into(), p);
    }
    if fabric {
        if options.contains_key("BufferPool") {
            return Err(HixlError::Config("EnableUseFabricMem and BufferPool cannot be set together (HIXL)".into()));
        }
        options.insert("EnableUseFabricMem".into(), "1".into());
    }
    for (var, opt) in [("ASCEND_RDMA_TC", "RdmaTrafficClass"), ("ASCEND_RDMA_SL", "RdmaServiceLevel")] {
        if let Some(v) = env(var) {
            options.entry(opt.into()).or_insert(v);
        }
    }
    if !global.is_empty() {
        if options.contains_key("GlobalResourceConfig") {
            return Err(HixlError::Config(
                "GlobalResourceConfig given verbatim and through link_type/[hixl.memory] keys: use one".into(),
            ));
        }
        options.insert("GlobalResourceConfig".into(), serde_json::Value::Object(global).to_string());
    }

    let transfer_ms = cfg
        .timeout_ms
        .or_else(|| parse_ms("ASCEND_TRANSFER_TIMEOUT", env("ASCEND_TRANSFER_TIMEOUT"), &mut warnings))
        .unwrap_or(DEFAULT_TIMEOUT_MS);
    let connect_ms = cfg
        .connect_timeout_ms
        .or_else(|| parse_ms("ASCEND_CONNECT_TIMEOUT", env("ASCEND_CONNECT_TIMEOUT"), &mut warnings))
        .unwrap_or(transfer_ms);
    if transfer_ms == 0 || connect_ms == 0 || transfer_ms > i32::MAX as u64 || connect_ms > i32::MAX as u64 {
        return Err(HixlError::Config("timeouts must be between 1 ms and 2^31 ms".into()));
    }
    if connect_ms < 200 {
        warnings.push(format!("connect timeout {connect_ms} ms: HIXL recommends at least 200 ms"));
    }
    let workers = cfg
        .num_workers
        .or_else(|| env("ASCEND_THREAD_POOL_SIZE").and_then(|v| v.parse().ok()))
        .unwrap_or(DEFAULT_WORKERS)
        .clamp(1, 256) as usize;
    let asynchronous = cfg.enable_async.unwrap_or(true);
    if asynchronous && options.contains_key("BufferPool") {
        warnings.push(
            "BufferPool only stages TransferSync (enable_async = false); async transfers go direct and need \
             registered memory on both sides"
                .into(),
        );
    }
    let max_batch = cfg.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH).max(1) as usize;
    let max_transfer = match cfg.max_transfer_size {
        Some(0) => return Err(HixlError::Config("max_transfer_size must be positive".into())),
        m => m,
    };
    let base_port = env("ASCEND_BASE_PORT").and_then(|v| v.parse::<u16>().ok()).unwrap_or(DEFAULT_BASE_PORT);
    let local_host = match cfg.local_host.clone() {
        Some(h) if !h.is_empty() => h,
        _ => {
            warnings
                .push("local_host not set: the engine is named 127.0.0.1:<port>, unreachable from other hosts".into());
            "127.0.0.1".into()
        }
    };
    Ok(HixlPlan {
        device_id,
        local_host,
        engine_port: cfg.engine_port,
        base_port,
        options,
        connect_timeout: Duration::from_millis(connect_ms),
        transfer_timeout: Duration::from_millis(transfer_ms),
        retry_times: cfg.retry_times.unwrap_or(DEFAULT_RETRIES),
        mode: if asynchronous { Mode::Async { max_inflight: workers } } else { Mode::Sync { workers } },
        batch: BatchPolicy {
            merge: cfg.batch_enable,
            merge_threshold: cfg.merge_threshold.unwrap_or(DEFAULT_MERGE_THRESHOLD),
            max_batch,
            max_transfer,
            linger: Duration::from_micros(cfg.batch_linger_us),
        },
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn global(p: &HixlPlan) -> serde_json::Value {
        serde_json::from_str(&p.options["GlobalResourceConfig"]).unwrap()
    }

    #[test]
    fn seed_file_maps_onto_hixl_options() {
        // The seed's hixl_transfer_config.toml, as the server test loads it.
        let mut cfg = HixlConfig {
            device_type: Some("npu".into()),
            device_id: Some(3),
            link_type: Some("hccs".into()),
            timeout_ms: Some(3000),
            retry_times: Some(2),
            max_batch_size: Some(32),
            merge_threshold: Some(1 << 20),
            num_workers: Some(4),
            enable_async: Some(true),
            local_host: Some("10.0.0.1".into()),
            ..Default::default()
        };
        cfg.memory.insert("buffer_pool".into(), "8:16".into());
        cfg.memory.insert("listen_port".into(), serde_json::json!(26666));
        cfg.memory.insert("channel_pool.max_channel".into(), serde_json::json!(10));
        let p = plan(&cfg, &no_env).unwrap();
        assert_eq!(p.device_id, 3);
        assert_eq!(p.options["BufferPool"], "8:16");
        assert_eq!(
            global(&p),
            serde_json::json!({"comm_resource_config.protocol_desc": ["hccs:device"],
                "comm_resource_config.listen_port": "26666", "channel_pool.max_channel": "10"})
        );
        assert!(!p.options.contains_key("env:HCCL_INTRA_ROCE_ENABLE"));
        assert_eq!(p.transfer_timeout, Duration::from_millis(3000));
        assert_eq!(p.connect_timeout, Duration::from_millis(3000));
        assert_eq!(p.retry_times, 2);
        assert_eq!(p.mode, Mode::Async { max_inflight: 4 });
        assert_eq!(
            p.batch,
            BatchPolicy {
                merge: true,
                merge_threshold: 1 << 20,
                max_batch: 32,
                max_transfer: None,
                linger: Duration::ZERO
            }
        );
        assert!(p.warnings.iter().any(|w| w.contains("BufferPool only stages TransferSync")), "{:?}", p.warnings);
        assert_eq!(p.engine_name(16000), "10.0.0.1:16000");
    }

    #[test]
    fn roce_sets_protocol_desc_and_the_hccl_switch() {
        let cfg = HixlConfig { link_type: Some("RoCE".into()), ..Default::default() };
        let p = plan(&cfg, &no_env).unwrap();
        assert_eq!(global(&p)["comm_resource_config.protocol_desc"], serde_json::json!(["roce:device"]));
        assert_eq!(p.options["env:HCCL_INTRA_ROCE_ENABLE"], "1");
        // The server keeps the seed's "roce" as "roce:device": the same mapping.
        let cfg = HixlConfig { link_type: Some("roce:device".into()), ..Default::default() };
        assert_eq!(plan(&cfg, &no_env).unwrap().options["env:HCCL_INTRA_ROCE_ENABLE"], "1");
        let cfg = HixlConfig { link_type: Some("roce:host".into()), ..Default::default() };
        assert!(!plan(&cfg, &no_env).unwrap().options.contains_key("env:HCCL_INTRA_ROCE_ENABLE"));
        assert_eq!(global(&plan(&cfg, &no_env).unwrap())["comm_resource_config.protocol_desc"][0], "roce:host");
        let cfg = HixlConfig { link_type: Some("nvlink".into()), ..Default::default() };
        assert!(matches!(plan(&cfg, &no_env), Err(HixlError::Config(m)) if m.contains("nvlink")));
    }

    #[test]
    fn defaults_and_mooncake_environment() {
        let p = plan(&HixlConfig::default(), &no_env).unwrap();
        assert!(p.options.is_empty(), "{:?}", p.options);
        assert_eq!(p.transfer_timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
        assert_eq!(p.mode, Mode::Async { max_inflight: DEFAULT_WORKERS as usize });
        assert_eq!(p.retry_times, DEFAULT_RETRIES);
        assert_eq!(p.base_port, DEFAULT_BASE_PORT);
        assert!(p.warnings.iter().any(|w| w.contains("local_host")));
        let env = |k: &str| -> Option<String> {
            match k {
                "ASCEND_TRANSFER_TIMEOUT" => Some("5000".into()),
                "ASCEND_CONNECT_TIMEOUT" => Some("100".into()),
                "ASCEND_BUFFER_POOL" => Some("0:0".into()),
                "ASCEND_RDMA_TC" => Some("160".into()),
                "ASCEND_THREAD_POOL_SIZE" => Some("3".into()),
                "ASCEND_BASE_PORT" => Some("30000".into()),
                _ => None,
            }
        };
        let cfg = HixlConfig { enable_async: Some(false), ..Default::default() };
        let p = plan(&cfg, &env).unwrap();
        assert_eq!(p.transfer_timeout, Duration::from_millis(5000));
        assert_eq!(p.connect_timeout, Duration::from_millis(100));
        assert!(p.warnings.iter().any(|w| w.contains("at least 200 ms")));
        assert_eq!(p.options["BufferPool"], "0:0");
        assert_eq!(p.options["RdmaTrafficClass"], "160");
        assert_eq!(p.mode, Mode::Sync { workers: 3 });
        assert_eq!(p.base_port, 30000);
        // Explicit settings win over the environment.
        let cfg = HixlConfig { timeout_ms: Some(700), num_workers: Some(2), ..Default::default() };
        let p = plan(&cfg, &env).unwrap();
        assert_eq!(p.transfer_timeout, Duration::from_millis(700));
        assert_eq!(p.mode, Mode::Async { max_inflight: 2 });
    }

    #[test]
    fn memory_table_and_conflicts() {
        let mut cfg = HixlConfig::default();
        cfg.memory.insert("buffer_num".into(), serde_json::json!(4));
        cfg.memory.insert("buffer_size_mb".into(), serde_json::json!(8));
        cfg.memory.insert("RdmaServiceLevel".into(), "5".into());
        cfg.memory.insert("wat".into(), serde_json::json!(1));
        let p = plan(&cfg, &no_env).unwrap();
        assert_eq!(p.options["BufferPool"], "4:8");
        assert_eq!(p.options["RdmaServiceLevel"], "5");
        assert!(p.warnings.iter().any(|w| w.contains("wat")));
        cfg.memory.insert("use_fabric_mem".into(), serde_json::json!(true));
        assert!(matches!(plan(&cfg, &no_env), Err(HixlError::Config(m)) if m.contains("EnableUseFabricMem")));
        let mut cfg = HixlConfig::default();
        cfg.memory.insert("use_fabric_mem".into(), serde_json::json!(true));
        assert_eq!(plan(&cfg, &no_env).unwrap().options["EnableUseFabricMem"], "1");
        let mut cfg = HixlConfig::default();
        cfg.memory.insert("buffer_pool".into(), "lots".into());
        assert!(plan(&cfg, &no_env).is_err());
        let cfg = HixlConfig { device_type: Some("gpu".into()), ..Default::default() };
        assert!(plan(&cfg, &no_env).is_err());
        let cfg = HixlConfig { timeout_ms: Some(0), ..Default::default() };
        assert!(plan(&cfg, &no_env).is_err());
    }

    #[test]
    fn ipv6_engine_names_are_bracketed() {
        let cfg = HixlConfig { local_host: Some("fe80::1".into()), ..Default::default() };
        assert_eq!(plan(&cfg, &no_env).unwrap().engine_name(20001), "[fe80::1]:20001");
    }
}
