//! Settings from the neighbours' files, mapped onto kvpool's: Mooncake's
//! `mooncake_store_config.json` and the HIXL transfer TOML. Unknown fields become warnings.

use super::{ConfigError, HixlSettings, LoadedConfig, Protocol, Size};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

pub(super) fn is_hixl_toml(text: &str) -> bool {
    toml::from_str::<toml::Table>(text).map(|t| t.contains_key("hixl") && t.len() == 1).unwrap_or(false)
}

/// Mooncake's `mooncake_store_config.json`.
#[derive(Debug, Default, Deserialize)]
struct MooncakeJson {
    local_hostname: Option<String>,
    metadata_server: Option<String>,
    master_server_address: Option<String>,
    local_buffer_size: Option<Size>,
    global_segment_size: Option<Size>,
    protocol: Option<String>,
    device_name: Option<String>,
    enable_batch_transfer: Option<bool>,
    batch_size: Option<u32>,
    transfer_engine: Option<MooncakeTransferEngine>,
}

#[derive(Debug, Default, Deserialize)]
struct MooncakeTransferEngine {
    backend: Option<String>,
    device_id: Option<u32>,
    max_transfer_size: Option<Size>,
    num_workers: Option<u32>,
}

/// Mooncake's `protocol`: its TCP transport serves remote and same-host clients alike, which in
/// kvpool is QUIC plus shared memory for same-host clients.
fn map_protocol(p: &str, warnings: &mut Vec<String>, origin: &str) -> Protocol {
    match p.to_ascii_lowercase().as_str() {
        "tcp" | "shm" => Protocol::Shm,
        "quic" => Protocol::Quic,
        "ascend" | "hixl" | "ascend_direct" => Protocol::Ascend,
        other => {
            warnings.push(format!(
                "{origin}: protocol {other:?} is not available in kvpool; using shm (QUIC and same-host shared memory)"
            ));
            Protocol::Shm
        }
    }
}

pub(super) fn apply_mooncake(out: &mut LoadedConfig, path: &Path, text: &str) -> Result<(), ConfigError> {
    let mut unknown = Vec::new();
    let mut de = serde_json::Deserializer::from_str(text);
    let m: MooncakeJson = serde_ignored::deserialize(&mut de, |p| unknown.push(p.to_string()))
        .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
    let origin = path.display().to_string();
    for u in unknown {
        out.warnings.push(format!("{origin}: unknown Mooncake field `{u}` ignored"));
    }
    let c = &mut out.config;
    if let Some(h) = m.local_hostname {
        c.server.advertise_host = Some(h);
    }
    if let Some(ms) = m.metadata_server {
        c.transport.metadata_server = Some(ms);
    }
    if let Some(addr) = m.master_server_address {
        // In the all-in-one role this server is the master: listen where connectors look for it.
        c.server.listen = addr;
    }
    if let Some(s) = m.local_buffer_size {
        c.transport.local_buffer_size = Some(s);
    }
    if let Some(s) = m.global_segment_size {
        c.dram.size = s;
    }
    if let Some(p) = m.protocol {
        c.transport.protocol = map_protocol(&p, &mut out.warnings, &origin);
    }
    if let Some(d) = m.device_name {
        c.transport.device_name = (!d.is_empty()).then_some(d);
    }
    if let Some(b) = m.enable_batch_transfer {
        c.transport.batch_enable = b;
    }
    if let Some(b) = m.batch_size {
        c.transport.max_batch_size = Some(b);
    }
    if let Some(te) = m.transfer_engine {
        if let Some(b) = te.backend {
            c.transport.protocol = map_protocol(&b, &mut out.warnings, &origin);
        }
        if te.device_id.is_some() {
            c.transport.device_id = te.device_id;
        }
        if te.max_transfer_size.is_some() {
            c.transport.max_transfer_size = te.max_transfer_size;
        }
        if te.num_workers.is_some() {
            c.transport.num_workers = te.num_workers;
        }
    }
    out.sources.push(format!("Mooncake config {origin}"));
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
struct HixlToml {
    hixl: HixlTable,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HixlTable {
    device_type: Option<String>,
    device_id: Option<u32>,
    link_type: Option<String>,
    max_transfer_size: Option<Size>,
    num_workers: Option<u32>,
    enable_async: Option<bool>,
    timeout_ms: Option<u64>,
    retry_times: Option<u32>,
    memory: Option<BTreeMap<String, toml::Value>>,
    batch: Option<HixlBatch>,
}

#[derive(Debug, Default, Deserialize)]
struct HixlBatch {
    enable: Option<bool>,
    max_batch_size: Option<u32>,
    merge_threshold: Option<Size>,
}

pub(super) fn apply_hixl(out: &mut LoadedConfig, path: &Path, text: &str) -> Result<(), ConfigError> {
    let mut unknown = Vec::new();
    let de = toml::Deserializer::new(text);
    let h: HixlToml = serde_ignored::deserialize(de, |p| unknown.push(p.to_string()))
        .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
    let origin = path.display().to_string();
    for u in unknown {
        out.warnings.push(format!("{origin}: unknown HIXL field `{u}` ignored"));
    }
    let h = h.hixl;
    let c = &mut out.config;
    c.transport.protocol = Protocol::Ascend;
    if h.device_id.is_some() {
        c.transport.device_id = h.device_id;
    }
    if h.max_transfer_size.is_some() {
        c.transport.max_transfer_size = h.max_transfer_size;
    }
    if h.num_workers.is_some() {
        c.transport.num_workers = h.num_workers;
    }
    let protocol_desc = h.link_type.as_deref().map(|l| match l.to_ascii_lowercase().as_str() {
        "hccs" => "hccs:device".to_string(),
        "roce" => "roce:device".to_string(),
        other => {
            out.warnings.push(format!("{origin}: link_type {other:?} passed through as protocol_desc"));
            other.to_string()
        }
    });
    if let Some(b) = h.batch {
        if let Some(e) = b.enable {
            c.transport.batch_enable = e;
        }
        if b.max_batch_size.is_some() {
            c.transport.max_batch_size = b.max_batch_size;
        }
        if b.merge_threshold.is_some() {
            c.transport.merge_threshold = b.merge_threshold;
        }
    }
    c.transport.hixl = Some(HixlSettings {
        shim_path: None,
        local_host: None,
        engine_port: None,
        device_type: h.device_type,
        protocol_desc,
        enable_async: h.enable_async,
        timeout_ms: h.timeout_ms,
        retry_times: h.retry_times,
        memory: h.memory.unwrap_or_default(),
    });
    out.sources.push(format!("HIXL config {origin}"));
    Ok(())
}
