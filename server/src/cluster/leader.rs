//! Leader election of masters on etcd: the leader holds `<prefix>leader` under a lease it
//! keeps alive and publishes there how to reach it; the others watch the key and campaign when
//! it goes (the lease expires within its TTL once the leader dies or loses etcd).

use super::Master;
use kvpool_etcd::{leader_key, Etcd, LeaderInfo};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Campaign for as long as the server runs.
pub async fn campaign(master: Arc<Master>, etcd: Etcd, prefix: String, me: LeaderInfo, ttl_secs: i64) {
    let key = leader_key(&prefix);
    let value = serde_json::to_vec(&me).expect("plain struct");
    let poll = Duration::from_millis(200);
    loop {
        let lease = match etcd.grant(ttl_secs).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "etcd: cannot get a lease; retrying");
                tokio::time::sleep(poll).await;
                continue;
            }
        };
        match etcd.create(&key, &value, lease.id).await {
            Ok(true) => {
                info!(name = %me.name, ttl_s = lease.ttl, "leading the cluster (etcd lease held)");
                master.set_leader(Some(me.addr.clone()));
                master.set_leading(true);
                hold(&etcd, lease).await;
                // Lost: stop answering before the lease could be someone else's.
                master.set_leading(false);
                warn!(name = %me.name, "no longer leading the cluster");
                let _ = etcd.revoke(lease.id).await;
            }
            Ok(false) => {
                let _ = etcd.revoke(lease.id).await;
                // Someone leads: follow until the key goes.
                loop {
                    match etcd.leader(&prefix).await {
                        Ok(Some(l)) => master.set_leader(Some(l.addr)),
                        Ok(None) => break,
                        Err(e) => warn!(error = %e, "etcd: cannot read the leader key"),
                    }
                    tokio::time::sleep(poll).await;
                }
            }
            Err(e) => {
                warn!(error = %e, "etcd: campaign failed; retrying");
                let _ = etcd.revoke(lease.id).await;
                tokio::time::sleep(poll).await;
            }
        }
    }
}

/// Keep the lease alive; return when it is lost, or when etcd has not confirmed it for two
/// thirds of its TTL (it may expire any moment: stepping down first keeps two leaders apart).
async fn hold(etcd: &Etcd, lease: kvpool_etcd::Lease) {
    let ttl = Duration::from_secs(lease.ttl as u64);
    let mut confirmed = Instant::now();
    loop {
        tokio::time::sleep(ttl / 4).await;
        match etcd.keep_alive(lease.id).await {
            Ok(true) => confirmed = Instant::now(),
            Ok(false) => return,
            Err(e) => warn!(error = %e, "etcd: keep-alive failed"),
        }
        if confirmed.elapsed() > ttl * 2 / 3 {
            return;
        }
    }
}
