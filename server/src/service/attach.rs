//! Attachments of a connection (version 2): `ShmAttach` (the client's shared buffers, for
//! `PutFrom` and `GetInto`), `LocalAttach` (the Unix-socket control channel) and `BulkAttach`
//! (a TCP connection for bulk bytes).

use super::session::Session;
use super::shared::Shared;
use super::stream::{error, unsupported, Fail};
use kvpool_proto::{BulkAttachRequest, ErrorCode, Response, ShmOffer};
use std::sync::Arc;

pub(super) fn shm_attach(session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let shm = s.data_path.as_ref().and_then(|d| d.shm.as_ref()).ok_or_else(|| {
        unsupported("this server offers no shared-memory transport (transport.protocol is not \"shm\")")
    })?;
    let ticket = shm.issue().map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let offer = ShmOffer { socket_path: shm.path().display().to_string(), token: ticket.token.to_vec() };
    session.set_shm(ticket);
    Ok(Response::ShmOffer(offer))
}

pub(super) fn local_attach(session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let local = s.data_path.as_ref().and_then(|d| d.local.as_ref()).ok_or_else(|| {
        unsupported("this server offers no same-host control channel (transport.protocol is not \"shm\", or its socket could not be bound)")
    })?;
    let offer = local.issue(session).map_err(|e| Fail::Reply(error(e.code(), e.to_string())))?;
    Ok(Response::LocalOffer(offer))
}

pub(super) fn bulk_attach(r: BulkAttachRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let door = s.bulk.get().ok_or_else(|| unsupported("this server offers no TCP bulk channel (bulk.tcp is off)"))?;
    Ok(Response::BulkOffer(door.issue(session, r.plaintext)?))
}
