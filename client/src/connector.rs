//! Requests an inference engine's connector leans on (protocol version 2): a lookup that holds
//! what it counted until the engine has loaded it, and the removal of every block whose key
//! matches (one model's blocks after a weight update; Mooncake's `remove_by_regex`).

use crate::error::{ClientError, Result};
use crate::{unexpected, Client};
use kvpool_proto::{
    ErrorCode, LookupLeaseRequest, RemoveAllResponse, RemoveMatchingRequest, Request, Response, MAX_HOLD_MS,
};
use std::time::Duration;

/// The answer of [`Client::lookup_lease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupLease {
    /// Leading blocks of the chain that are resident.
    pub resident: usize,
    /// The hold on them, to end with [`Client::release`] (0: nothing was held).
    pub lease: u64,
    /// The hold ends by itself after this long.
    pub lease_ms: u32,
}

impl Client {
    /// Like [`Client::lookup`], and the resident leading blocks stay (neither evicted nor removed
    /// without `force`) until [`Client::release`] of the lease, `ttl` (the server's lease time
    /// when zero; at most 60 s), or the end of this connection. On a cluster it counts as
    /// [`Client::lookup`] does and holds nothing (lease 0): a block that goes before it is read
    /// is a miss, which a connector recovers from by computing it.
    pub async fn lookup_lease<K: AsRef<[u8]>>(&self, chain: &[K], ttl: Duration) -> Result<LookupLease> {
        if let Some(cc) = self.cluster() {
            return Ok(LookupLease { resident: cc.lookup(chain).await?, lease: 0, lease_ms: 0 });
        }
        if chain.is_empty() {
            return Ok(LookupLease { resident: 0, lease: 0, lease_ms: 0 });
        }
        if self.hello().version < 2 {
            return Err(ClientError::status(ErrorCode::Unsupported, "the server speaks protocol version 1 only"));
        }
        self.check_keys(chain.iter().map(|k| k.as_ref()))?;
        let ttl_ms = ttl.as_millis().min(u128::from(MAX_HOLD_MS)) as u32;
        let req = Request::LookupLease(LookupLeaseRequest {
            chain: chain.iter().map(|k| k.as_ref().to_vec()).collect(),
            ttl_ms,
        });
        match self.call(req).await? {
            Response::LookupLeased(l) if (l.resident as usize) <= chain.len() => {
                Ok(LookupLease { resident: l.resident as usize, lease: l.lease, lease_ms: l.lease_ms })
            }
            Response::LookupLeased(l) => {
                Err(ClientError::Protocol(format!("lookup of {} keys answered {} resident", chain.len(), l.resident)))
            }
            other => Err(unexpected("LookupLeased", &other)),
        }
    }

    /// Remove this tenant's blocks whose keys start with `prefix` and, when given, match
    /// `pattern` (a regular expression over the key's bytes); held and leased ones only with
    /// `force` (on a cluster: on every live storage node, summed).
    pub async fn remove_matching(
        &self,
        prefix: impl AsRef<[u8]>,
        pattern: Option<&str>,
        force: bool,
    ) -> Result<RemoveAllResponse> {
        if let Some(cc) = &self.cluster {
            return cc.remove_matching(prefix, pattern, force).await;
        }
        self.remove_matching_direct(prefix, pattern, force).await
    }

    /// [`Client::remove_matching`] on this server itself.
    pub(crate) async fn remove_matching_direct(
        &self,
        prefix: impl AsRef<[u8]>,
        pattern: Option<&str>,
        force: bool,
    ) -> Result<RemoveAllResponse> {
        if self.hello().version < 2 {
            return Err(ClientError::status(ErrorCode::Unsupported, "the server speaks protocol version 1 only"));
        }
        let req = Request::RemoveMatching(RemoveMatchingRequest {
            prefix: prefix.as_ref().to_vec(),
            pattern: pattern.map(str::to_owned),
            force,
        });
        match self.call(req).await? {
            Response::RemoveAll(r) => Ok(r),
            other => Err(unexpected("RemoveAll", &other)),
        }
    }
}
