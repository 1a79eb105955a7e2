//! Admin operations (admin API key only): policy modules.

use crate::{read_response, unexpected, Client, Result};
use kvpool_proto::{frame, PolicyInfo, PolicyKind, PolicyLoadRequest, PolicyRollbackRequest, Request, Response};

impl Client {
    /// Load a Wasm policy component for `kind` and make it active (the server compiles it,
    /// rebuilds its state from the current block set, then swaps it in atomically).
    pub async fn policy_load(
        &self,
        kind: PolicyKind,
        name: &str,
        params: &[(String, String)],
        wasm: &[u8],
    ) -> Result<PolicyInfo> {
        // On a cluster: the master's (per node: `ClusterClient::policy_load`).
        let c = self.control();
        let req = Request::PolicyLoad(PolicyLoadRequest {
            kind,
            name: name.to_string(),
            params: params.to_vec(),
            module_size: wasm.len() as u64,
        });
        let frame = frame::encode_frame(&req)?;
        c.timed(async {
            let (conn, mut tx, mut rx) = c.open().await?;
            let sent = async {
                tx.write_all(&frame).await?;
                tx.write_all(wasm).await?;
                tx.finish()?;
                Ok::<_, crate::ClientError>(())
            }
            .await;
            // A refusal (not an admin key, a module too large) may stop our stream before the
            // module is sent: its typed answer says why, not the write it cut short.
            match (read_response(&conn, &mut rx).await, sent) {
                (Ok(Response::Policy(info)), Ok(())) => Ok(info),
                (Ok(other), Ok(())) => Err(unexpected("Policy", &other)),
                (Err(e @ crate::ClientError::Status { .. }), _) | (Err(e), Ok(())) => Err(e),
                (Ok(_), Err(e)) | (Err(_), Err(e)) => Err(e),
            }
        })
        .await
    }

    /// Active module of each kind, then each kind's history (newest first).
    pub async fn policy_list(&self) -> Result<Vec<PolicyInfo>> {
        match self.control().call(Request::PolicyList).await? {
            Response::PolicyList(l) => Ok(l.policies),
            other => Err(unexpected("PolicyList", &other)),
        }
    }

    /// Re-activate the module loaded before the current one (the built-in when none).
    pub async fn policy_rollback(&self, kind: PolicyKind) -> Result<PolicyInfo> {
        match self.control().call(Request::PolicyRollback(PolicyRollbackRequest { kind })).await? {
            Response::Policy(info) => Ok(info),
            other => Err(unexpected("Policy", &other)),
        }
    }
}
