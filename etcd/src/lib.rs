//! The etcd v3 calls a kvpool cluster needs: leases (grant, keep alive, revoke), put-if-absent
//! under a lease, get and delete, through etcd's JSON gateway (`POST /v3/...` over HTTP/1.1).
//!
//! Hand-written rather than the `etcd-client` crate: that one brings a gRPC stack (tonic,
//! prost, h2) and a `protoc` build step into a build that must stay small, for five calls that
//! the gateway serves as plain JSON.
//!
//! On top of them, [`LeaderInfo`]: how the leading master of a cluster publishes itself under
//! `<prefix>leader`, and how storage nodes and clients find it.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use http_body_util::{BodyExt, Full};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd endpoint {0:?}: expected http://host:port")]
    Endpoint(String),
    #[error("etcd at {endpoint}: {message}")]
    Unreachable { endpoint: String, message: String },
    #[error("etcd at {endpoint} answered {status}: {body}")]
    Status { endpoint: String, status: u16, body: String },
    #[error("etcd answer not understood: {0}")]
    Answer(String),
}

pub type Result<T, E = EtcdError> = std::result::Result<T, E>;

/// A client of one etcd cluster (any of its endpoints may answer).
#[derive(Debug, Clone)]
pub struct Etcd {
    /// `host:port` of each endpoint, tried in order.
    endpoints: Vec<String>,
    timeout: Duration,
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: i64,
    /// Seconds (etcd may grant more than asked).
    pub ttl: i64,
}

/// etcd's JSON writes 64-bit integers as strings.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl Etcd {
    /// `endpoints`: comma-separated `http://host:port` (the scheme may be left out).
    pub fn new(endpoints: &str) -> Result<Etcd> {
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let hp = e.strip_prefix("http://").unwrap_or(e).trim_end_matches('/');
                if e.starts_with("https://") || hp.is_empty() || hp.contains('/') || !hp.contains(':') {
                    return Err(EtcdError::Endpoint(e.to_string()));
                }
                Ok(hp.to_string())
            })
            .collect::<Result<_>>()?;
        if endpoints.is_empty() {
            return Err(EtcdError::Endpoint(String::new()));
        }
        Ok(Etcd { endpoints, timeout: Duration::from_secs(3) })
    }

    async fn post_to(&self, endpoint: &str, path: &str, body: &Value) -> Result<Value> {
        let unreachable = |message: String| EtcdError::Unreachable { endpoint: endpoint.to_string(), message };
        let call = async {
            let tcp = tokio::net::TcpStream::connect(endpoint).await.map_err(|e| unreachable(e.to_string()))?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            tokio::spawn(conn);
            let req = hyper::Request::post(path)
                .header("host", endpoint)
                .header("content-type", "application/json")
                .body(Full::new(bytes::Bytes::from(body.to_string())))
                .map_err(|e| unreachable(e.to_string()))?;
            let resp = send.send_request(req).await.map_err(|e| unreachable(e.to_string()))?;
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await.map_err(|e| unreachable(e.to_string()))?.to_bytes();
            if status != 200 {
                return Err(EtcdError::Status {
                    endpoint: endpoint.to_string(),
                    status,
                    body: String::from_utf8_lossy(&bytes).into_owned(),
                });
            }
            serde_json::from_slice(&bytes).map_err(|e| EtcdError::Answer(e.to_string()))
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| unreachable(format!("no answer within {:?}", self.timeout)))?
    }

    /// POST to the first endpoint that answers.
    async fn post(&self, path: &str, body: Value) -> Result<Value> {
        let mut last = None;
        for e in &self.endpoints {
            match self.post_to(e, path, &body).await {
                Ok(v) => return Ok(v),
                Err(err @ EtcdError::Unreachable { .. }) => last = Some(err),
                Err(err) => return Err(err),
            }
        }
        Err(last.expect("at least one endpoint"))
    }

    pub async fn grant(&self, ttl_secs: i64) -> Result<Lease> {
        let v = self.post("/v3/lease/grant", json!({ "TTL": ttl_secs })).await?;
        match (int(&v["ID"]), int(&v["TTL"])) {
            (Some(id), Some(ttl)) if ttl > 0 => Ok(Lease { id, ttl }),
            _ => Err(EtcdError::Answer(format!("lease grant: {v}"))),
        }
    }

    /// Renew a lease; `false` when it no longer exists (it expired: whatever it held is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<bool> {
        let v = self.post("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(int(&v["result"]["TTL"]).is_some_and(|t| t > 0))
    }

    pub async fn revoke(&self, lease: i64) -> Result<()> {
        self.post("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(|_| ())
    }

    /// Put `key` = `value` under `lease` only if `key` does not exist; `true` when it was put.
    pub async fn create(&self, key: &[u8], value: &[u8], lease: i64) -> Result<bool> {
        let k = B64.encode(key);
        let body = json!({
            "compare": [{ "key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0" }],
            "success": [{ "requestPut": { "key": k, "value": B64.encode(value), "lease": lease.to_string() } }],
        });
        let v = self.post("/v3/kv/txn", body).await?;
        Ok(v["succeeded"].as_bool().unwrap_or(false))
    }

    /// The value of `key` and the lease that holds it (0: none), if it exists.
    pub async fn get(&self, key: &[u8]) -> Result<Option<(Vec<u8>, i64)>> {
        let v = self.post("/v3/kv/range", json!({ "key": B64.encode(key) })).await?;
        let Some(kv) = v["kvs"].as_array().and_then(|a| a.first()) else { return Ok(None) };
        let value = B64
            .decode(kv["value"].as_str().unwrap_or(""))
            .map_err(|e| EtcdError::Answer(format!("value of {}: {e}", String::from_utf8_lossy(key))))?;
        Ok(Some((value, int(&kv["lease"]).unwrap_or(0))))
    }

    pub async fn delete(&self, key: &[u8]) -> Result<()> {
        self.post("/v3/kv/deleterange", json!({ "key": B64.encode(key) })).await.map(|_| ())
    }
}

/// What the leading master publishes under `<prefix>leader`: how to reach and trust it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderInfo {
    /// The master's name (its `cluster.node_name`, else its address).
    pub name: String,
    /// QUIC address, `host:port`.
    pub addr: String,
    pub server_name: String,
    /// SHA-256 of its certificate, 64 hex digits.
    pub fingerprint: String,
}

/// The key the leader holds.
pub fn leader_key(prefix: &str) -> Vec<u8> {
    format!("{prefix}leader").into_bytes()
}

impl Etcd {
    /// The current leader of the cluster under `prefix`, if one holds the key.
    pub async fn leader(&self, prefix: &str) -> Result<Option<LeaderInfo>> {
        match self.get(&leader_key(prefix)).await? {
            None => Ok(None),
            Some((v, _)) => {
                serde_json::from_slice(&v).map(Some).map_err(|e| EtcdError::Answer(format!("leader key: {e}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        let e = Etcd::new("http://127.0.0.1:2379, 10.0.0.2:2379").unwrap();
        assert_eq!(e.endpoints, vec!["127.0.0.1:2379", "10.0.0.2:2379"]);
        assert!(Etcd::new("https://x:1").is_err());
        assert!(Etcd::new("").is_err());
        assert!(Etcd::new("http://x:1/path").is_err());
    }

    #[test]
    fn integers_come_as_strings() {
        assert_eq!(int(&json!("7587899346796671493")), Some(7_587_899_346_796_671_493));
        assert_eq!(int(&json!(5)), Some(5));
        assert_eq!(int(&json!(null)), None);
    }
}
