//! The QUIC request service: hello/auth on the first stream, then one request per stream.

use crate::auth::{Auth, Principal};
use crate::metrics::Metrics;
use crate::store::{GetPlan, PutPlan, Served, Store};
use kvpool_proto::frame::{read_frame, write_message};
use kvpool_proto::{
    close, codec, message_tag, ErrorBody, ErrorCode, ExistsResponse, GetItem, GetResponse, HelloOk, Limits,
    LookupResponse, OpStats, PolicyListResponse, Pong, PutRequest, RemoveAllResponse, Request, Response, StatsReport,
    StatusList, TierStats, PROTOCOL_VERSION, REQUEST_TAGS,
};
use quinn::{RecvStream, SendStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn, Instrument};

pub struct Shared {
    pub store: Arc<Store>,
    pub auth: Auth,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub server_name: String,
    pub started: Instant,
    pub max_connections: u32,
    pub policies: Arc<crate::policy::PolicyManager>,
    pub max_module_size: u64,
}

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        if shared.metrics.connections.get() >= shared.max_connections as i64 {
            warn!("connection limit reached; refusing");
            incoming.refuse();
            continue;
        }
        let shared = shared.clone();
        let remote = incoming.remote_address();
        tokio::spawn(
            async move {
                if let Err(e) = handle_connection(incoming, shared).await {
                    debug!(error = %e, "connection ended");
                }
            }
            .instrument(tracing::info_span!("conn", %remote)),
        );
    }
}

struct ConnGuard(Arc<Metrics>);
impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.connections.dec();
    }
}

async fn handle_connection(incoming: quinn::Incoming, shared: Arc<Shared>) -> Result<(), quinn::ConnectionError> {
    let conn = incoming.await?;
    shared.metrics.connections.inc();
    let _guard = ConnGuard(shared.metrics.clone());
    let principal = match tokio::time::timeout(HELLO_TIMEOUT, hello(&conn, &shared)).await {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(()),
        Err(_) => {
            conn.close(close::UNAUTHORIZED.into(), b"no hello in time");
            return Ok(());
        }
    };
    debug!(tenant = %principal.tenant, "authenticated");
    let principal = Arc::new(principal);
    loop {
        let (send, recv) = conn.accept_bi().await?;
        let (p, s) = (principal.clone(), shared.clone());
        tokio::spawn(async move { handle_stream(send, recv, &p, &s).await });
    }
}

async fn reply(send: &mut SendStream, resp: &Response) {
    if write_message(send, resp).await.is_ok() {
        let _ = send.finish();
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody { code, message: message.into() }
}

/// Send a final error, let it reach the client, then close the connection.
async fn refuse(conn: &quinn::Connection, mut send: SendStream, code: ErrorCode, message: &str, metrics: &Metrics) {
    metrics.auth_failures.inc();
    reply(&mut send, &Response::Error(error(code, message))).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    conn.close(close::UNAUTHORIZED.into(), code.name().as_bytes());
}

async fn hello(conn: &quinn::Connection, shared: &Shared) -> Option<Principal> {
    let (mut send, mut recv) = conn.accept_bi().await.ok()?;
    let start = Instant::now();
    let req = match read_request(&mut recv, shared.limits.max_frame).await {
        Ok(Some(r)) => r,
        Ok(None) => {
            conn.close(close::PROTOCOL.into(), b"empty hello stream");
            return None;
        }
        Err((code, msg)) => {
            refuse(conn, send, code, &msg, &shared.metrics).await;
            return None;
        }
    };
    let Request::Hello(h) = req else {
        refuse(
            conn,
            send,
            ErrorCode::HelloRequired,
            "the first request of a connection must be a hello",
            &shared.metrics,
        )
        .await;
        return None;
    };
    if h.version != PROTOCOL_VERSION {
        let msg = format!("protocol version {} is not supported; this server speaks {PROTOCOL_VERSION}", h.version);
        refuse(conn, send, ErrorCode::UnsupportedVersion, &msg, &shared.metrics).await;
        return None;
    }
    let Some(p) = shared.auth.check(&h.api_key) else {
        info!(client = %h.client_name, "hello refused: unknown api key");
        refuse(conn, send, ErrorCode::Unauthorized, "unknown api key", &shared.metrics).await;
        return None;
    };
    let ok = HelloOk {
        version: PROTOCOL_VERSION,
        server: shared.server_name.clone(),
        tenant: p.tenant.clone(),
        admin: p.admin,
        limits: shared.limits,
    };
    reply(&mut send, &Response::Hello(ok)).await;
    shared.metrics.op_seconds.with_label_values(&["hello"]).observe(start.elapsed().as_secs_f64());
    Some(p)
}

/// Read and decode a request frame; `Err` carries the typed answer for the client.
async fn read_request(recv: &mut RecvStream, max_frame: u32) -> Result<Option<Request>, (ErrorCode, String)> {
    let body = match read_frame(recv, max_frame).await {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(None),
        Err(e) => return Err((e.code(), e.to_string())),
    };
    match codec::decode::<Request>(&body) {
        Ok(r) => Ok(Some(r)),
        Err(e) => match message_tag(&body) {
            Some(tag) if tag >= REQUEST_TAGS => Err((ErrorCode::UnknownMessage, format!("unknown request type {tag}"))),
            _ => Err((ErrorCode::Malformed, e.to_string())),
        },
    }
}

fn op_name(r: &Request) -> &'static str {
    match r {
        Request::Hello(_) => "hello",
        Request::Put(_) => "put",
        Request::Get(_) => "get",
        Request::Lookup(_) => "lookup",
        Request::Exists(_) => "exists",
        Request::Remove(_) => "remove",
        Request::RemoveAll(_) => "remove_all",
        Request::Stats => "stats",
        Request::Ping(_) => "ping",
        Request::PolicyLoad(_) => "policy_load",
        Request::PolicyList => "policy_list",
        Request::PolicyRollback(_) => "policy_rollback",
    }
}

async fn handle_stream(mut send: SendStream, mut recv: RecvStream, p: &Principal, s: &Shared) {
    let start = Instant::now();
    let req = match read_request(&mut recv, s.limits.max_frame).await {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err((code, msg)) => {
            debug!(%code, %msg, "bad request frame");
            reply(&mut send, &Response::Error(error(code, msg))).await;
            let _ = recv.stop(close::PROTOCOL.into());
            return;
        }
    };
    let op = op_name(&req);
    let ok = match dispatch(req, &mut send, &mut recv, p, s).await {
        Ok(()) => true,
        Err(body) => {
            reply(&mut send, &Response::Error(body)).await;
            let _ = recv.stop(close::PROTOCOL.into());
            false
        }
    };
    s.metrics.op_seconds.with_label_values(&[op]).observe(start.elapsed().as_secs_f64());
    if !ok {
        s.metrics.op_errors.with_label_values(&[op]).inc();
    }
}

fn check_keys<'a>(keys: impl IntoIterator<Item = &'a Vec<u8>>, count: usize, l: &Limits) -> Result<(), ErrorBody> {
    if count > l.max_batch as usize {
        return Err(error(ErrorCode::BatchTooLarge, format!("{count} items; the limit is {}", l.max_batch)));
    }
    for k in keys {
        if k.len() > l.max_key_len as usize {
            return Err(error(
                ErrorCode::KeyTooLong,
                format!("key of {} bytes; the limit is {}", k.len(), l.max_key_len),
            ));
        }
        if k.is_empty() {
            return Err(error(ErrorCode::InvalidArgument, "empty key"));
        }
    }
    Ok(())
}

async fn dispatch(
    req: Request,
    send: &mut SendStream,
    recv: &mut RecvStream,
    p: &Principal,
    s: &Shared,
) -> Result<(), ErrorBody> {
    let store = &s.store;
    let t = p.tenant_id;
    let resp = match req {
        Request::Hello(_) => return Err(error(ErrorCode::Malformed, "hello is only valid as the first request")),
        Request::Put(put) => Response::Put(put_items(put, recv, p, s).await?),
        Request::Get(g) => {
            check_keys(&g.keys, g.keys.len(), &s.limits)?;
            return get_items(&g.keys, send, t, s).await;
        }
        Request::Lookup(l) => {
            check_keys(&l.chain, l.chain.len(), &s.limits)?;
            Response::Lookup(LookupResponse { resident: store.lookup(t, &l.chain) })
        }
        Request::Exists(e) => {
            check_keys(&e.keys, e.keys.len(), &s.limits)?;
            Response::Exists(ExistsResponse { present: store.exists(t, &e.keys) })
        }
        Request::Remove(r) => {
            check_keys(&r.keys, r.keys.len(), &s.limits)?;
            Response::Remove(StatusList { results: store.remove(t, &r.keys, r.force) })
        }
        Request::RemoveAll(r) => {
            let (removed, skipped) = store.remove_all(t, r.force);
            Response::RemoveAll(RemoveAllResponse { removed, skipped })
        }
        Request::Stats => Response::Stats(stats(s)),
        Request::PolicyLoad(_) | Request::PolicyList | Request::PolicyRollback(_) if !p.admin => {
            return Err(error(ErrorCode::Forbidden, "policy administration needs an admin api key"));
        }
        Request::PolicyLoad(l) => {
            if l.module_size > s.max_module_size {
                return Err(error(
                    ErrorCode::ValueTooLarge,
                    format!("module of {} bytes; the limit is {}", l.module_size, s.max_module_size),
                ));
            }
            let mut wasm = vec![0u8; l.module_size as usize];
            if recv.read_exact(&mut wasm).await.is_err() {
                return Err(error(ErrorCode::Malformed, "stream ended before the declared module bytes"));
            }
            match s.policies.load(l.kind, &l.name, l.params, wasm).await {
                Ok(info) => Response::Policy(info),
                Err(e) => return Err(error(ErrorCode::PolicyError, e.to_string())),
            }
        }
        Request::PolicyList => Response::PolicyList(PolicyListResponse { policies: s.policies.list() }),
        Request::PolicyRollback(r) => match s.policies.rollback(r.kind).await {
            Ok(info) => Response::Policy(info),
            Err(e) => return Err(error(ErrorCode::PolicyError, e.to_string())),
        },
        Request::Ping(ping) => Response::Pong(Pong {
            nonce: ping.nonce,
            server_time_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(0),
        }),
    };
    reply(send, &resp).await;
    Ok(())
}

/// Read and drop `n` bytes of a value that will not be stored.
async fn discard(recv: &mut RecvStream, mut n: u64) -> Result<(), ErrorBody> {
    let mut buf = vec![0u8; 64 * 1024];
    while n > 0 {
        let want = n.min(buf.len() as u64) as usize;
        match recv.read(&mut buf[..want]).await {
            Ok(Some(got)) => n -= got as u64,
            _ => return Err(error(ErrorCode::Malformed, "stream ended before the declared value bytes")),
        }
    }
    Ok(())
}

async fn put_items(put: PutRequest, recv: &mut RecvStream, p: &Principal, s: &Shared) -> Result<StatusList, ErrorBody> {
    let l = &s.limits;
    check_keys(put.items.iter().map(|i| &i.key), put.items.len(), l)?;
    for it in &put.items {
        if it.size > l.max_value_size {
            return Err(error(
                ErrorCode::ValueTooLarge,
                format!("value of {} bytes; the limit is {}", it.size, l.max_value_size),
            ));
        }
        if it.parent.as_ref().is_some_and(|k| k.len() > l.max_key_len as usize) {
            return Err(error(ErrorCode::KeyTooLong, "parent key too long"));
        }
    }
    let plans = s.store.plan_put(p.tenant_id, &put.items, put.mode);
    let mut results = Vec::with_capacity(put.items.len());
    for (it, plan) in put.items.iter().zip(plans) {
        let code = match plan {
            PutPlan::Skip(code) => {
                discard(recv, it.size).await?;
                code
            }
            PutPlan::Dram(id) => match s.store.reserve(it.size).await {
                Err(code) => {
                    discard(recv, it.size).await?;
                    code
                }
                Ok(mut blk) => {
                    // Straight from the QUIC stream into the segment: no staging copy.
                    if recv.read_exact(blk.bytes_mut()).await.is_err() {
                        return Err(error(ErrorCode::Malformed, "stream ended before the declared value bytes"));
                    }
                    s.store.commit(p.tenant_id, id, it, put.mode, blk)
                }
            },
            PutPlan::Ssd(id) => {
                let mut data = vec![0u8; it.size as usize];
                if recv.read_exact(&mut data).await.is_err() {
                    return Err(error(ErrorCode::Malformed, "stream ended before the declared value bytes"));
                }
                s.store.commit_ssd(p.tenant_id, id, it, put.mode, data).await
            }
        };
        results.push(code);
    }
    Ok(StatusList { results })
}

async fn get_items(keys: &[Vec<u8>], send: &mut SendStream, tenant: u32, s: &Shared) -> Result<(), ErrorBody> {
    let plans = s.store.plan_get(tenant, keys);
    let lease_ms = s.store.cfg.lease_ttl.as_millis().min(u32::MAX as u128) as u32;
    let mut items = Vec::with_capacity(plans.len());
    let mut served: Vec<Served> = Vec::new();
    for plan in plans {
        let r = match plan {
            GetPlan::Missing => Err(ErrorCode::NotFound),
            GetPlan::Dram { block, checksum } => Ok(Served::Dram(block, checksum, kvpool_policy_sdk::Tier::Dram)),
            GetPlan::Ssd { id, file, size, checksum } => s.store.read_ssd(id, file, size, checksum).await,
        };
        match r {
            Ok(sv) => {
                items.push(GetItem {
                    status: ErrorCode::Ok,
                    size: sv.bytes().len() as u64,
                    tier: sv.tier() as u8,
                    checksum: sv.checksum(),
                    lease_ms,
                });
                served.push(sv);
            }
            Err(code) => items.push(GetItem { status: code, size: 0, tier: 0, checksum: 0, lease_ms: 0 }),
        }
    }
    if write_message(send, &Response::Get(GetResponse { items })).await.is_err() {
        return Ok(());
    }
    for sv in &served {
        if send.write_all(sv.bytes()).await.is_err() {
            return Ok(());
        }
    }
    let _ = send.finish();
    Ok(())
}

fn stats(s: &Shared) -> StatsReport {
    let m = &s.metrics;
    s.store.update_gauges();
    let (blocks, dram_blocks, ssd_blocks) = s.store.counts();
    let tiers = s
        .store
        .tier_usage()
        .into_iter()
        .map(|(tier, cap, used)| {
            let name = tier.name();
            TierStats {
                tier: name.into(),
                capacity_bytes: cap,
                used_bytes: used,
                blocks: if name == "dram" { dram_blocks } else { ssd_blocks },
                hits: m.hits.with_label_values(&[name]).get(),
                misses: m.misses.with_label_values(&[name]).get(),
                evictions: m.evictions.with_label_values(&[name]).get(),
            }
        })
        .collect();
    let ops = crate::metrics::OPS
        .iter()
        .map(|op| {
            let (count, p50, p99, mean) = m.op_summary(op);
            OpStats {
                op: op.to_string(),
                count,
                errors: m.op_errors.with_label_values(&[op]).get(),
                p50_us: p50 * 1e6,
                p99_us: p99 * 1e6,
                mean_us: mean * 1e6,
            }
        })
        .collect();
    StatsReport {
        server: s.server_name.clone(),
        uptime_s: s.started.elapsed().as_secs(),
        blocks,
        tiers,
        demotions: m.demotions.get(),
        promotions: m.promotions.get(),
        rejected_puts: m.rejected_puts.with_label_values(&["admission"]).get()
            + m.rejected_puts.with_label_values(&["no_space"]).get(),
        corrupt_blocks: m.corrupt.get(),
        ops,
    }
}
