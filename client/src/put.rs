//! Writes: values over the QUIC stream, the TCP bulk channel (puts of 64 KiB and more), or
//! staged through shared buffers on the same host.

use crate::{bulk, expect_end, get, key_text, read_response, unexpected, Client, ClientError, Result};
use kvpool_proto::{ErrorCode, PinSpec, PutItem, PutMode, PutRequest, Request, Response};

/// Per-block metadata of a put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Key of the previous block of the prefix chain.
    pub parent: Option<Vec<u8>>,
    /// Tokens held by this block.
    pub tokens: u32,
    /// Length in tokens of the prefix this block completes (admission by `store_threshold`).
    pub seq_tokens: u64,
    pub pin: PinSpec,
}

impl Default for PutOptions {
    fn default() -> Self {
        PutOptions { parent: None, tokens: 0, seq_tokens: 0, pin: PinSpec::None }
    }
}

/// One item of [`Client::put_batch`]; the value is written to the stream straight from `value`.
#[derive(Debug, Clone)]
pub struct PutEntry<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub opts: PutOptions,
}

impl<'a> PutEntry<'a> {
    pub fn new(key: &'a [u8], value: &'a [u8]) -> Self {
        PutEntry { key, value, opts: PutOptions::default() }
    }
}

impl Client {
    /// Insert one block. An existing key fails with `AlreadyExists` and keeps its value.
    pub async fn put(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.put_one(key.as_ref(), value, PutOptions::default(), PutMode::Insert).await
    }

    /// Insert one block with chain metadata and pinning.
    pub async fn put_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Insert).await
    }

    /// Insert or replace one block (fails with `Leased` while the old value is being read).
    pub async fn upsert(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.put_one(key.as_ref(), value, PutOptions::default(), PutMode::Upsert).await
    }

    /// Insert or replace one block, with metadata.
    pub async fn upsert_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Upsert).await
    }

    async fn put_one(&self, key: &[u8], value: &[u8], opts: PutOptions, mode: PutMode) -> Result<()> {
        let st = self.put_batch(&[PutEntry { key, value, opts }], mode).await?;
        match st[0] {
            ErrorCode::Ok => Ok(()),
            code => Err(ClientError::status(code, format!("put of key {}", key_text(key)))),
        }
    }

    /// Check put items against the server's limits and build their wire form.
    pub(crate) fn put_items<'k>(
        &self,
        entries: impl ExactSizeIterator<Item = (&'k [u8], u64, &'k PutOptions)> + Clone,
    ) -> Result<Vec<PutItem>> {
        self.check_keys(entries.clone().map(|(k, _, _)| k))?;
        let limits = self.limits();
        entries
            .map(|(key, size, opts)| {
                if let Some(p) = opts.parent.as_ref().filter(|p| p.len() as u64 > limits.max_key_len as u64) {
                    return Err(ClientError::LimitExceeded {
                        code: ErrorCode::KeyTooLong,
                        what: "parent key length",
                        value: p.len() as u64,
                        limit: limits.max_key_len as u64,
                    });
                }
                if size > limits.max_value_size {
                    return Err(ClientError::LimitExceeded {
                        code: ErrorCode::ValueTooLarge,
                        what: "value size",
                        value: size,
                        limit: limits.max_value_size,
                    });
                }
                Ok(PutItem {
                    key: key.to_vec(),
                    size,
                    parent: opts.parent.clone(),
                    tokens: opts.tokens,
                    seq_tokens: opts.seq_tokens,
                    pin: opts.pin,
                })
            })
            .collect()
    }

    /// Put many blocks on one stream; one status per entry, in order (`Ok`, `AlreadyExists`,
    /// `Rejected`, `NoSpace`, `Leased`, ...). A request-level failure is an `Err`.
    /// On a same-host connection the values are staged through shared buffers (one copy here,
    /// one in the server), otherwise sent over QUIC.
    pub async fn put_batch(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        if let Some(cc) = &self.cluster {
            return cc.put_batch(entries, mode, 1).await;
        }
        self.put_batch_direct(entries, mode).await
    }

    /// [`Client::put_batch`] on this server itself.
    pub(crate) async fn put_batch_direct(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        if self.inner.registry.linked() {
            return self.put_batch_staged(entries, mode).await;
        }
        self.put_batch_inband(entries, mode).await
    }

    /// Storage nodes (admin key): put blocks of `tenant` into this node, as `put_batch` does
    /// for the caller's own tenant. The values go over QUIC.
    pub async fn node_put(&self, tenant: &str, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let items = self.put_items(entries.iter().map(|e| (e.key, e.value.len() as u64, &e.opts)))?;
        let req = Request::NodePut(kvpool_proto::NodePutRequest { tenant: tenant.to_string(), mode, items });
        self.put_request_inband(req, entries).await
    }

    /// `put_batch` over QUIC: the values follow the request frame on its stream.
    pub(crate) async fn put_batch_inband(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        let items = self.put_items(entries.iter().map(|e| (e.key, e.value.len() as u64, &e.opts)))?;
        self.put_request_inband(Request::Put(PutRequest { mode, items }), entries).await
    }

    /// A put request, then the entries' values, on one QUIC stream (or the bulk channel).
    async fn put_request_inband(&self, req: Request, entries: &[PutEntry<'_>]) -> Result<Vec<ErrorCode>> {
        let frame = self.encode_checked(&req)?;
        let bytes: u64 = entries.iter().map(|e| e.value.len() as u64).sum();
        let resp = self
            .timed(async {
                if let Some((link, mut c)) = self.bulk_conn(bytes).await {
                    let values: Vec<&[u8]> = entries.iter().map(|e| e.value).collect();
                    let sent = c.send(&frame, &values).await;
                    let resp = match bulk::read_answer(&mut c).await {
                        Ok(r) => get::end_of(&mut c).await.map(|()| r),
                        // A typed refusal ends its answer: read the end, and the connection goes on.
                        Err(e @ ClientError::Status { .. }) => {
                            let _ = get::end_of(&mut c).await;
                            Err(e)
                        }
                        Err(e) => Err(e),
                    };
                    if sent.is_ok() {
                        link.keep(c);
                    }
                    return match (resp, sent) {
                        (Ok(r @ Response::Put(_)), Err(e)) => Err(ClientError::Protocol(format!(
                            "server answered {r:?} but stopped reading the values: {e}"
                        ))),
                        (Ok(r), _) => Ok(r),
                        (Err(e @ ClientError::Status { .. }), _) | (Err(e), Ok(())) => Err(e),
                        (Err(_), Err(e)) => Err(e),
                    };
                }
                let (conn, mut tx, mut rx) = self.open().await?;
                let sent = async {
                    tx.write_all(&frame).await?;
                    for e in entries {
                        tx.write_all(e.value).await?;
                    }
                    tx.finish()?;
                    Ok::<_, ClientError>(())
                }
                .await;
                // If the server refused early and stopped our stream, its typed answer explains why.
                let resp = read_response(&conn, &mut rx).await;
                match (resp, sent) {
                    (Ok(r), Ok(())) => {
                        expect_end(&mut rx).await?;
                        Ok(r)
                    }
                    (Ok(r @ Response::Put(_)), Err(e)) => {
                        Err(ClientError::Protocol(format!("server answered {r:?} but stopped reading the values: {e}")))
                    }
                    (Ok(r), Err(_)) => Ok(r),
                    (Err(e @ ClientError::Status { .. }), _) => Err(e),
                    (Err(_), Err(e)) => Err(e),
                    (Err(e), Ok(())) => Err(e),
                }
            })
            .await?;
        match resp {
            Response::Put(list) if list.results.len() == entries.len() => Ok(list.results),
            Response::Put(list) => Err(ClientError::Protocol(format!(
                "put of {} items answered with {} statuses",
                entries.len(),
                list.results.len()
            ))),
            other => Err(unexpected("Put", &other)),
        }
    }
}
