//! Protocol version 2's one-sided descriptors: reserve space and learn where it is, write the
//! bytes, commit; locate blocks under a lease, read them, release. A one-sided transport (HIXL)
//! moves the bytes itself between the `put_intent`/`get_locate` and `put_done`/`release` calls;
//! here `write_reservation` and `read_located` move them in band over QUIC, which makes the
//! protocol usable (and tested) anywhere.

use crate::error::{ClientError, Result};
use crate::{read_response, unexpected, Client, PutOptions};
use kvpool_proto::{
    ErrorCode, KeysRequest, Location, PutDoneRequest, PutIntentRequest, PutMode, ReadRequest, ReleaseRequest, Request,
    Response, WriteRequest,
};

/// Space granted for one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// `Ok`, or why there is no space for it (`AlreadyExists`, `Rejected`, `NoSpace`).
    pub status: ErrorCode,
    pub reservation: u64,
    /// Where the bytes go (node, registered region, offset).
    pub location: Location,
    /// The reservation is released unless committed within this many ms.
    pub expires_ms: u32,
}

/// One block of a `get_locate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocatedBlock {
    pub status: ErrorCode,
    pub size: u64,
    pub tier: u8,
    pub checksum: u64,
    pub location: Location,
}

/// Blocks held in place by a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub lease: u64,
    pub lease_ms: u32,
    pub blocks: Vec<LocatedBlock>,
}

impl Client {
    fn need_v2(&self) -> Result<()> {
        if self.hello().version < 2 {
            return Err(ClientError::status(ErrorCode::Unsupported, "the server speaks protocol version 1 only"));
        }
        Ok(())
    }

    /// Reserve space for blocks of the given sizes; one grant per entry.
    pub async fn put_intent<K: AsRef<[u8]>>(
        &self,
        entries: &[(K, u64, PutOptions)],
        mode: PutMode,
    ) -> Result<Vec<Grant>> {
        self.need_v2()?;
        let items = self.put_items(entries.iter().map(|(k, size, o)| (k.as_ref(), *size, o)))?;
        match self.call(Request::PutIntent(PutIntentRequest { mode, items })).await? {
            Response::PutGrant(g) if g.grants.len() == entries.len() => Ok(g
                .grants
                .into_iter()
                .map(|g| Grant {
                    status: g.status,
                    reservation: g.reservation,
                    location: g.location,
                    expires_ms: g.expires_ms,
                })
                .collect()),
            other => Err(unexpected("PutGrant", &other)),
        }
    }

    /// Write bytes into a granted reservation at `offset`.
    pub async fn write_reservation(&self, reservation: u64, offset: u64, bytes: &[u8]) -> Result<()> {
        self.need_v2()?;
        let frame =
            self.encode_checked(&Request::Write(WriteRequest { reservation, offset, size: bytes.len() as u64 }))?;
        self.timed(async {
            let (conn, mut tx, mut rx) = self.open().await?;
            let sent = async {
                tx.write_all(&frame).await?;
                tx.write_all(bytes).await?;
                tx.finish()?;
                Ok::<_, ClientError>(())
            }
            .await;
            match (read_response(&conn, &mut rx).await, sent) {
                (Ok(Response::Done), Ok(())) => Ok(()),
                (Ok(other), _) => Err(unexpected("Done", &other)),
                (Err(e), _) => Err(e),
            }
        })
        .await
    }

    /// Commit reservations whose bytes are complete; one status per reservation (`Expired`
    /// for one that no longer exists).
    pub async fn put_done(&self, reservations: &[u64]) -> Result<Vec<ErrorCode>> {
        self.need_v2()?;
        match self.call(Request::PutDone(PutDoneRequest { reservations: reservations.to_vec() })).await? {
            Response::Put(l) if l.results.len() == reservations.len() => Ok(l.results),
            other => Err(unexpected("Put", &other)),
        }
    }

    /// Locate blocks and lease them in place.
    /// Not offered through a cluster master (`unsupported`).
    pub async fn get_locate<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Located> {
        if self.is_cluster() {
            return Err(crate::ClientError::status(
                kvpool_proto::ErrorCode::Unsupported,
                "locating blocks in place is not offered through a cluster master",
            ));
        }
        self.need_v2()?;
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        let req = Request::GetLocate(KeysRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect() });
        match self.call(req).await? {
            Response::Located(l) if l.items.len() == keys.len() => Ok(Located {
                lease: l.lease,
                lease_ms: l.lease_ms,
                blocks: l
                    .items
                    .into_iter()
                    .map(|i| LocatedBlock {
                        status: i.status,
                        size: i.size,
                        tier: i.tier,
                        checksum: i.checksum,
                        location: i.location,
                    })
                    .collect(),
            }),
            other => Err(unexpected("Located", &other)),
        }
    }

    /// Read `buf.len()` bytes at `offset` of block `index` of a lease.
    pub async fn read_located(&self, lease: u64, index: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.need_v2()?;
        let req = Request::Read(ReadRequest { lease, index, offset, size: buf.len() as u64 });
        let frame = self.encode_checked(&req)?;
        self.timed(async {
            let (conn, mut tx, mut rx) = self.open().await?;
            tx.write_all(&frame).await?;
            tx.finish()?;
            match read_response(&conn, &mut rx).await? {
                Response::Data(h) if h.size == buf.len() as u64 => {}
                other => return Err(unexpected("Data", &other)),
            }
            rx.read_exact(buf).await?;
            crate::expect_end(&mut rx).await
        })
        .await
    }

    /// End a lease.
    pub async fn release(&self, lease: u64) -> Result<()> {
        self.need_v2()?;
        match self.call(Request::Release(ReleaseRequest { lease })).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("Done", &other)),
        }
    }
}
