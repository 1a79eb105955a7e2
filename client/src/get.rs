//! Reads: values over the QUIC stream or the TCP bulk channel (checked against the server's
//! checksums as they land), or into caller buffers.

use crate::{key_text, read_response, unexpected, Client, ClientError, GetIntoResult, GetResult, Result};
use kvpool_proto::{ErrorCode, GetItem, KeysRequest, Request, Response};
use quinn::RecvStream;
use tokio::io::{AsyncRead, AsyncReadExt};

/// A bulk connection with a get's item headers read: its link, the connection, the headers.
type BulkOpened = (std::sync::Arc<crate::bulk::BulkLink>, crate::bulk::BulkConn, Vec<GetItem>);

/// Where a get's values are read from: a QUIC stream, or a bulk connection, whose values land
/// (under TLS decrypted) straight in the caller's buffer.
pub(crate) trait ValueRead: AsyncRead + Unpin + Send {
    /// Fill `dst`; the xxh3-64 of its bytes, hashed piece by piece as they land (while they
    /// are in cache) rather than in a second pass.
    fn read_hashed<'a>(&'a mut self, dst: &'a mut [u8]) -> kvpool_net::bulk::BoxFuture<'a, std::io::Result<u64>> {
        Box::pin(kvpool_net::bulk::read_hashed(self, dst))
    }
}

impl ValueRead for RecvStream {}

impl ValueRead for crate::bulk::BulkConn {
    fn read_hashed<'a>(&'a mut self, dst: &'a mut [u8]) -> kvpool_net::bulk::BoxFuture<'a, std::io::Result<u64>> {
        Box::pin(async move {
            let mut h = xxhash_rust::xxh3::Xxh3Default::new();
            self.read_value(dst, &mut |b| h.update(b)).await?;
            Ok(h.digest())
        })
    }
}

impl Client {
    /// Read one block; `None` when it is not in the pool. A `Corrupt` answer is an error.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        let mut r = self.get_batch(&[key]).await?;
        let r = r.pop().expect("one item checked by get_batch");
        match r.status {
            ErrorCode::Ok => Ok(r.value),
            ErrorCode::NotFound => Ok(None),
            code => Err(ClientError::status(code, format!("get of key {}", key_text(key)))),
        }
    }

    /// Read many blocks on one stream. Every value is checked against the server's xxh3-64;
    /// a mismatch fails the whole call with `ClientError::Checksum`.
    pub async fn get_batch<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<GetResult>> {
        if let Some(cc) = &self.cluster {
            return cc.get_batch(keys).await;
        }
        self.get_batch_direct(keys).await
    }

    /// [`Client::get_batch`] on this server itself.
    pub(crate) async fn get_batch_direct<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<GetResult>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let max_value = self.limits().max_value_size;
        let frame = self.get_frame(keys)?;
        self.timed(async {
            if let Some(opened) = self.bulk_get_open(&frame, keys.len()).await {
                let (link, mut c, items) = opened?;
                let r = take_values(&mut c, items, keys, max_value).await;
                link.keep(c);
                return r;
            }
            let (items, mut rx) = self.get_open(&frame, keys.len()).await?;
            take_values(&mut rx, items, keys, max_value).await
        })
        .await
    }

    /// Read one block into `buf`; `Some(len)` when found, `None` when not in the pool. A value
    /// larger than `buf` fails with `ValueTooLarge`.
    pub async fn get_into(&self, key: impl AsRef<[u8]>, buf: &mut [u8]) -> Result<Option<usize>> {
        let key = key.as_ref();
        let have = buf.len();
        let r = self.get_batch_into(&[key], &mut [buf]).await?[0];
        match r.status {
            ErrorCode::Ok => Ok(Some(r.size as usize)),
            ErrorCode::NotFound => Ok(None),
            ErrorCode::ValueTooLarge => Err(ClientError::status(
                ErrorCode::ValueTooLarge,
                format!("value of key {} has {} bytes, the buffer only {have}", key_text(key), r.size),
            )),
            code => Err(ClientError::status(code, format!("get of key {}", key_text(key)))),
        }
    }

    /// Read many blocks straight into caller buffers (`bufs[i]` for `keys[i]`), the way a
    /// connector fills registered memory. Checksums are verified as for `get_batch`.
    pub async fn get_batch_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetIntoResult>> {
        if let Some(cc) = &self.cluster {
            return cc.get_batch_into(keys, bufs).await;
        }
        self.get_batch_into_direct(keys, bufs).await
    }

    /// [`Client::get_batch_into`] on this server itself: through shared memory when this
    /// connection has it.
    pub(crate) async fn get_batch_into_direct<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetIntoResult>> {
        if keys.len() != bufs.len() {
            return Err(ClientError::Config(format!("{} keys but {} buffers", keys.len(), bufs.len())));
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.inner.registry.linked() {
            return self.get_batch_into_staged(keys, bufs).await;
        }
        self.get_batch_into_inband(keys, bufs).await
    }

    /// `get_batch_into` over QUIC: values come back on the request's stream.
    pub(crate) async fn get_batch_into_inband<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetIntoResult>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let frame = self.get_frame(keys)?;
        self.timed(async {
            if let Some(opened) = self.bulk_get_open(&frame, keys.len()).await {
                let (link, mut c, items) = opened?;
                let r = fill_values(&mut c, items, keys, bufs).await;
                link.keep(c);
                return r;
            }
            let (items, mut rx) = self.get_open(&frame, keys.len()).await?;
            fill_values(&mut rx, items, keys, bufs).await
        })
        .await
    }

    fn get_frame<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<u8>> {
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        self.encode_checked(&Request::Get(KeysRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect() }))
    }

    /// On the bulk channel when this call takes it (`None`: over QUIC): send a Get frame and
    /// return the item headers, the connection positioned at the first value.
    async fn bulk_get_open(&self, frame: &[u8], n: usize) -> Option<Result<BulkOpened>> {
        let (link, mut c) = self.bulk_conn(u64::MAX).await?;
        let opened = async {
            c.send(frame, &[]).await?;
            let items = get_items(crate::bulk::read_answer(&mut c).await?, n)?;
            Ok(items)
        }
        .await;
        Some(match opened {
            Ok(items) => Ok((link, c, items)),
            Err(e) => {
                // A typed refusal ends its answer: the connection goes on.
                if matches!(e, ClientError::Status { .. }) && crate::get::end_of(&mut c).await.is_ok() {
                    link.keep(c);
                }
                Err(e)
            }
        })
    }

    /// Send a Get frame; return the item headers with the stream positioned at the first value.
    async fn get_open(&self, frame: &[u8], n: usize) -> Result<(Vec<kvpool_proto::GetItem>, RecvStream)> {
        let (conn, mut tx, mut rx) = self.open().await?;
        tx.write_all(frame).await?;
        tx.finish()?;
        Ok((get_items(read_response(&conn, &mut rx).await?, n)?, rx))
    }
}

/// The item headers of a `Get` answer for `n` keys.
fn get_items(resp: Response, n: usize) -> Result<Vec<GetItem>> {
    match resp {
        Response::Get(g) if g.items.len() == n => Ok(g.items),
        Response::Get(g) => {
            Err(ClientError::Protocol(format!("get of {n} keys answered with {} items", g.items.len())))
        }
        other => Err(unexpected("Get", &other)),
    }
}

/// The values a `Get` answer announced, each checked as it lands, then the end of the answer.
async fn take_values<R: ValueRead, K: AsRef<[u8]>>(
    rx: &mut R,
    items: Vec<GetItem>,
    keys: &[K],
    max_value: u64,
) -> Result<Vec<GetResult>> {
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let mut value = None;
        if item.status == ErrorCode::Ok {
            if item.size > max_value {
                return Err(ClientError::Protocol(format!(
                    "server announced a value of {} bytes, above its own limit of {max_value}",
                    item.size
                )));
            }
            let mut buf = vec![0u8; item.size as usize];
            read_verified(rx, keys[i].as_ref(), item.checksum, &mut buf).await?;
            value = Some(buf);
        }
        out.push(GetResult { status: item.status, value, tier: item.tier, lease_ms: item.lease_ms });
    }
    end_of(rx).await?;
    Ok(out)
}

/// As [`take_values`], into the caller's buffers (`bufs[i]` for `keys[i]`).
async fn fill_values<R: ValueRead, K: AsRef<[u8]>>(
    rx: &mut R,
    items: Vec<GetItem>,
    keys: &[K],
    bufs: &mut [&mut [u8]],
) -> Result<Vec<GetIntoResult>> {
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let buf: &mut [u8] = bufs[i];
        let mut status = item.status;
        if status == ErrorCode::Ok {
            if item.size > buf.len() as u64 {
                discard(rx, item.size).await?;
                status = ErrorCode::ValueTooLarge;
            } else {
                let dst = &mut buf[..item.size as usize];
                read_verified(rx, keys[i].as_ref(), item.checksum, dst).await?;
            }
        }
        out.push(GetIntoResult { status, size: item.size, tier: item.tier, lease_ms: item.lease_ms });
    }
    end_of(rx).await?;
    Ok(out)
}

/// After the last declared byte the server must end the answer.
pub(crate) async fn end_of<R: AsyncRead + Unpin>(rx: &mut R) -> Result<()> {
    let mut probe = [0u8; 1];
    match rx.read(&mut probe).await.map_err(io_err)? {
        0 => Ok(()),
        _ => Err(ClientError::Protocol("bytes after the last declared value".into())),
    }
}

fn io_err(e: std::io::Error) -> ClientError {
    ClientError::Io(e.to_string())
}

/// Read exactly `dst.len()` value bytes and check them against `expected`, hashing each piece
/// as it lands (while it is still in cache) rather than in a second pass over the value.
pub(crate) async fn read_verified<R: ValueRead>(rx: &mut R, key: &[u8], expected: u64, dst: &mut [u8]) -> Result<()> {
    let actual = rx.read_hashed(dst).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => ClientError::Protocol(e.to_string()),
        _ => io_err(e),
    })?;
    if actual != expected {
        return Err(ClientError::Checksum { key: key_text(key), expected, actual });
    }
    Ok(())
}

pub(crate) fn verify(key: &[u8], expected: u64, bytes: &[u8]) -> Result<()> {
    let actual = xxhash_rust::xxh3::xxh3_64(bytes);
    if actual != expected {
        return Err(ClientError::Checksum { key: key_text(key), expected, actual });
    }
    Ok(())
}

pub(crate) async fn discard<R: AsyncRead + Unpin>(rx: &mut R, mut n: u64) -> Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    while n > 0 {
        let take = n.min(scratch.len() as u64) as usize;
        rx.read_exact(&mut scratch[..take]).await.map_err(io_err)?;
        n -= take as u64;
    }
    Ok(())
}
