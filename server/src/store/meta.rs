//! Block metadata persisted in sled. The in-memory index is the working copy; sled is written
//! at every commit, demotion, promotion and removal, so after a restart the SSD-tier blocks are
//! found again. A record is written only after its bytes are complete (two-phase commit), and
//! removed before its file is deleted, so the index never points at missing or partial data.

use kvpool_proto::codec;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("metadata store: {0}")]
    Sled(#[from] sled::Error),
    #[error("metadata record: {0}")]
    Codec(#[from] kvpool_proto::ProtoError),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    pub size: u64,
    pub tokens: u32,
    pub seq_tokens: u64,
    pub parent: Option<Vec<u8>>,
    pub checksum: u64,
    pub created_ms: u64,
    /// 0 none, 1 soft, 2 hard.
    pub pin: u8,
    /// Wall-clock ms when a soft pin ends.
    pub pin_until_ms: u64,
    pub ssd_file: Option<u64>,
    pub in_dram: bool,
}

pub struct Meta {
    db: sled::Db,
    blocks: sled::Tree,
    pub kv: sled::Tree,
}

/// Scoped key: tenant id (4 bytes big endian) then the client's key bytes.
pub fn scoped(tenant: u32, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + key.len());
    k.extend_from_slice(&tenant.to_be_bytes());
    k.extend_from_slice(key);
    k
}

impl Meta {
    pub fn open(dir: &Path) -> Result<Meta, MetaError> {
        let db = sled::Config::new().path(dir).flush_every_ms(Some(200)).open()?;
        let blocks = db.open_tree("blocks")?;
        let kv = db.open_tree("kv")?;
        Ok(Meta { db, blocks, kv })
    }

    pub fn put(&self, tenant: u32, key: &[u8], rec: &BlockRecord) -> Result<(), MetaError> {
        self.blocks.insert(scoped(tenant, key), codec::encode(rec)?)?;
        Ok(())
    }

    pub fn remove(&self, tenant: u32, key: &[u8]) -> Result<(), MetaError> {
        self.blocks.remove(scoped(tenant, key))?;
        Ok(())
    }

    /// Every record: (tenant, key, record). Undecodable records are reported and skipped.
    pub fn all(&self) -> Vec<(u32, Vec<u8>, Option<BlockRecord>)> {
        self.blocks
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| k.len() >= 4)
            .map(|(k, v)| {
                let tenant = u32::from_be_bytes([k[0], k[1], k[2], k[3]]);
                (tenant, k[4..].to_vec(), codec::decode(&v).ok())
            })
            .collect()
    }

    pub fn db(&self) -> &sled::Db {
        &self.db
    }

    pub fn flush(&self) -> Result<(), MetaError> {
        self.db.flush()?;
        Ok(())
    }
}
