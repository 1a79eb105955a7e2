//! Requests an inference engine's connector leans on (version 2): `LookupLease`, a lookup that
//! holds the blocks it counted until the engine has loaded them, and `RemoveMatching`, which
//! drops one model's blocks (a prefix-cache reset after a weight update) or Mooncake's
//! `remove_by_regex`.

use super::session::{Held, LeaseHold, Session};
use super::shared::Shared;
use super::stream::{check_keys, error, Fail};
use kvpool_proto::{
    ErrorCode, LookupLeaseRequest, LookupLeased, RemoveAllResponse, RemoveMatchingRequest, Response, MAX_HOLD_MS,
};
use std::sync::Arc;
use std::time::Duration;

/// Largest compiled `RemoveMatching` pattern: a client's regex must not cost the server more.
const MAX_REGEX_BYTES: usize = 1 << 20;

pub(super) fn lookup_lease(l: LookupLeaseRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    check_keys(&l.chain, l.chain.len(), &s.limits)?;
    let ttl = match l.ttl_ms {
        0 => s.store.cfg.lease_ttl,
        ms => Duration::from_millis(u64::from(ms)),
    }
    .min(Duration::from_millis(u64::from(MAX_HOLD_MS)));
    let (resident, ids) = s.store.lookup_hold(session.principal.tenant_id, &l.chain);
    let lease = if ids.is_empty() {
        0
    } else {
        let held = Held { store: s.store.clone(), ids };
        session.lease(LeaseHold { blocks: Vec::new(), held: Some(held) }, ttl)
    };
    Ok(Response::LookupLeased(LookupLeased {
        resident,
        lease,
        lease_ms: ttl.as_millis().min(u128::from(u32::MAX)) as u32,
    }))
}

pub(super) fn remove_matching(r: RemoveMatchingRequest, session: &Session, s: &Shared) -> Result<Response, Fail> {
    if r.prefix.len() > s.limits.max_key_len as usize {
        return Err(Fail::Reply(error(ErrorCode::KeyTooLong, "prefix longer than the longest key")));
    }
    let re = match &r.pattern {
        None => None,
        Some(p) => Some(
            regex::bytes::RegexBuilder::new(p)
                .size_limit(MAX_REGEX_BYTES)
                .dfa_size_limit(MAX_REGEX_BYTES)
                .build()
                .map_err(|e| Fail::Reply(error(ErrorCode::InvalidArgument, format!("pattern: {e}"))))?,
        ),
    };
    let prefix = r.prefix;
    let (removed, skipped) = s.store.remove_matching(session.principal.tenant_id, r.force, |k| {
        k.starts_with(&prefix) && re.as_ref().is_none_or(|re| re.is_match(k))
    });
    Ok(Response::RemoveAll(RemoveAllResponse { removed, skipped }))
}
