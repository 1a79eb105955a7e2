//! Cluster requests (PROTOCOL.md 11.8): storage nodes joining and reporting to the master, and
//! clients asking the master where blocks are and where new ones go.

use super::put::check_put;
use super::session::Session;
use super::shared::Shared;
use super::stream::{check_keys, error, expect_end, Fail, RequestRecv};
use crate::cluster::master::ReportError;
use kvpool_proto::{ErrorCode, Request, Response};
use std::sync::Arc;
use tokio::time::Instant as Deadline;

fn not_master() -> Fail {
    Fail::Reply(error(ErrorCode::Unsupported, "this server is not a cluster master (cluster.role is all or storage)"))
}

pub(super) async fn dispatch<R: RequestRecv>(
    req: Request,
    recv: &mut R,
    session: &Arc<Session>,
    s: &Shared,
    deadline: Deadline,
) -> Result<Response, Fail> {
    let p = &session.principal;
    let m = s.role.master().ok_or_else(not_master)?;
    if !m.is_leading() {
        let who = m.leader().map_or_else(|| "no master leads yet".to_string(), |a| format!("the leader is {a}"));
        return Err(Fail::Reply(error(ErrorCode::NotLeader, format!("this master does not lead the cluster: {who}"))));
    }
    match req {
        Request::NodeJoin(_) | Request::NodeReport(_) if !p.admin => {
            Err(Fail::Reply(error(ErrorCode::Forbidden, "storage nodes join with an admin api key")))
        }
        Request::NodeJoin(j) => {
            expect_end(recv, deadline).await?;
            if j.name.is_empty() || j.addr.is_empty() || j.fingerprint.len() != 32 {
                return Err(Fail::Reply(error(
                    ErrorCode::InvalidArgument,
                    "a node joins with a name, an address and a 32-byte certificate fingerprint",
                )));
            }
            Ok(Response::NodeJoined(m.join(j)))
        }
        Request::NodeReport(r) => {
            // Keys and parent keys within the limits: they go into the master's event log.
            check_keys(r.blocks.iter().map(|b| &b.key), 0, &s.limits)?;
            check_keys(r.blocks.iter().filter_map(|b| b.parent.as_ref()), 0, &s.limits)?;
            expect_end(recv, deadline).await?;
            match m.report(r) {
                Ok(()) => Ok(Response::Done),
                Err(e @ (ReportError::Unknown(_) | ReportError::Stale(_))) => {
                    Err(Fail::Reply(error(ErrorCode::Expired, e.to_string())))
                }
            }
        }
        Request::Nodes => {
            expect_end(recv, deadline).await?;
            Ok(Response::NodeList(m.nodes()))
        }
        Request::Route(r) => {
            check_keys(&r.keys, r.keys.len(), &s.limits)?;
            expect_end(recv, deadline).await?;
            Ok(Response::Routes(m.route(&p.tenant, &r.keys)))
        }
        Request::Place(r) => {
            check_put(&r.items, &s.limits)?;
            expect_end(recv, deadline).await?;
            let store = &s.store;
            Ok(Response::Routes(m.place(&p.tenant, &r.items, r.replicas, session.peer, |b, n| store.place(b, n))))
        }
        _ => Err(Fail::Reply(error(ErrorCode::Internal, "not a cluster request"))),
    }
}
