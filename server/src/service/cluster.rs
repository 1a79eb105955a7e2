//! Cluster requests (PROTOCOL.md 11.8): storage nodes joining and reporting to the master, and
//! clients asking the master where blocks are and where new ones go.

use super::put::check_put;
use super::session::Session;
use super::shared::Shared;
use super::stream::{check_keys, error, Fail};
use crate::cluster::master::{Master, ReportError};
use kvpool_proto::{ErrorCode, KeysRequest, NodeJoinRequest, NodeReportRequest, PlaceRequest, Response};
use std::sync::Arc;

/// The master's view, when this server is the master that leads the cluster.
fn leading(s: &Shared) -> Result<&Arc<Master>, Fail> {
    let m = s.role.master().ok_or_else(|| {
        Fail::Reply(error(
            ErrorCode::Unsupported,
            "this server is not a cluster master (cluster.role is all or storage)",
        ))
    })?;
    if !m.is_leading() {
        let who = m.leader().map_or_else(|| "no master leads yet".to_string(), |a| format!("the leader is {a}"));
        return Err(Fail::Reply(error(ErrorCode::NotLeader, format!("this master does not lead the cluster: {who}"))));
    }
    Ok(m)
}

/// `NodeJoin` (admin keys only, checked by the request table).
pub(super) fn node_join(j: NodeJoinRequest, s: &Shared) -> Result<Response, Fail> {
    let m = leading(s)?;
    if j.name.is_empty() || j.addr.is_empty() || j.fingerprint.len() != 32 {
        return Err(Fail::Reply(error(
            ErrorCode::InvalidArgument,
            "a node joins with a name, an address and a 32-byte certificate fingerprint",
        )));
    }
    Ok(Response::NodeJoined(m.join(j)))
}

/// `NodeReport` (admin keys only, checked by the request table).
pub(super) fn node_report(r: NodeReportRequest, s: &Shared) -> Result<Response, Fail> {
    let m = leading(s)?;
    // Keys and parent keys within the limits: they go into the master's event log.
    check_keys(r.blocks.iter().map(|b| &b.key), 0, &s.limits)?;
    check_keys(r.blocks.iter().filter_map(|b| b.parent.as_ref()), 0, &s.limits)?;
    match m.report(r) {
        Ok(()) => Ok(Response::Done),
        Err(e @ (ReportError::Unknown(_) | ReportError::Stale(_))) => {
            Err(Fail::Reply(error(ErrorCode::Expired, e.to_string())))
        }
    }
}

pub(super) fn nodes(s: &Shared) -> Result<Response, Fail> {
    Ok(Response::NodeList(leading(s)?.nodes()))
}

pub(super) fn route(r: KeysRequest, session: &Session, s: &Shared) -> Result<Response, Fail> {
    let m = leading(s)?;
    check_keys(&r.keys, r.keys.len(), &s.limits)?;
    Ok(Response::Routes(m.route(&session.principal.tenant, &r.keys)))
}

pub(super) fn place(r: PlaceRequest, session: &Session, s: &Shared) -> Result<Response, Fail> {
    let m = leading(s)?;
    check_put(&r.items, &s.limits)?;
    let store = &s.store;
    let tenant = &session.principal.tenant;
    Ok(Response::Routes(m.place(tenant, &r.items, r.replicas, session.peer, |b, n| store.place(b, n))))
}
