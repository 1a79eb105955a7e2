//! Block metadata persisted in sled. The in-memory index is the working copy; sled receives every
//! change the index makes ([`MetaOp`]), in the order the index made them, from one writer thread:
//! requests never wait on sled while they hold the index lock. After a restart the SSD-tier
//! blocks are found again from these records (recovery checks every record against the files on
//! disk, so a record that outlived its file is dropped).

use kvpool_core::MetaOp;
use kvpool_proto::codec;
use std::path::Path;
use std::sync::mpsc;

pub use kvpool_core::BlockRecord;

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("metadata store: {0}")]
    Sled(#[from] sled::Error),
    #[error("metadata record: {0}")]
    Codec(#[from] kvpool_proto::ProtoError),
    #[error("metadata writer thread is gone")]
    WriterGone,
}

/// Work to run once every earlier op is durable.
type AfterDurable = Box<dyn FnOnce() + Send>;

enum Msg {
    Ops(Vec<MetaOp>),
    /// Reply once every earlier op is in sled and sled is flushed.
    Flush(mpsc::Sender<Result<(), String>>),
    /// Run once every earlier op is in sled and sled is flushed.
    After(AfterDurable),
    /// Reply once every earlier message is done.
    Barrier(tokio::sync::oneshot::Sender<()>),
}

/// The writer thread: applies ops in order; callbacks and barriers wait for the messages before
/// them, and one flush serves every callback that queued up meanwhile.
fn write_loop(rx: mpsc::Receiver<Msg>, db: sled::Db, blocks: sled::Tree) {
    let mut after: Vec<AfterDurable> = Vec::new();
    let mut barriers: Vec<tokio::sync::oneshot::Sender<()>> = Vec::new();
    let settle = |after: &mut Vec<AfterDurable>, barriers: &mut Vec<tokio::sync::oneshot::Sender<()>>| {
        if !after.is_empty() {
            if let Err(e) = db.flush() {
                tracing::warn!(error = %e, "metadata flush failed; freeing space anyway");
            }
            after.drain(..).for_each(|f| f());
        }
        barriers.drain(..).for_each(|b| {
            let _ = b.send(());
        });
    };
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(msg) = next {
            match msg {
                Msg::Ops(ops) => {
                    for op in &ops {
                        if let Err(e) = apply(&blocks, op) {
                            tracing::warn!(error = %e, "metadata write failed");
                        }
                    }
                }
                Msg::Flush(reply) => {
                    let _ = reply.send(db.flush().map(|_| ()).map_err(|e| e.to_string()));
                }
                Msg::After(f) => after.push(f),
                // In order: a barrier waits for the callbacks queued before it.
                Msg::Barrier(b) => {
                    settle(&mut after, &mut barriers);
                    let _ = b.send(());
                }
            }
            next = rx.try_recv().ok();
        }
        settle(&mut after, &mut barriers);
    }
    settle(&mut after, &mut barriers);
}

pub struct Meta {
    db: sled::Db,
    blocks: sled::Tree,
    pub kv: sled::Tree,
    queue: Option<mpsc::Sender<Msg>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Meta {
    /// Let the writer apply what is queued and release sled (its lock) before returning.
    fn drop(&mut self) {
        self.queue.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Scoped key: tenant id (4 bytes big endian) then the client's key bytes.
pub fn scoped(tenant: u32, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + key.len());
    k.extend_from_slice(&tenant.to_be_bytes());
    k.extend_from_slice(key);
    k
}

fn apply(blocks: &sled::Tree, op: &MetaOp) -> Result<(), MetaError> {
    match op {
        MetaOp::Put { tenant, key, record } => {
            blocks.insert(scoped(*tenant, key), codec::encode(record)?)?;
        }
        MetaOp::Remove { tenant, key } => {
            blocks.remove(scoped(*tenant, key))?;
        }
    }
    Ok(())
}

impl Meta {
    /// Open (or create) the database in `dir`; sled caches up to `cache_bytes` of it.
    pub fn open(dir: &Path, cache_bytes: u64) -> Result<Meta, MetaError> {
        let db = sled::Config::new().path(dir).cache_capacity(cache_bytes).flush_every_ms(Some(200)).open()?;
        let blocks = db.open_tree("blocks")?;
        let kv = db.open_tree("kv")?;
        let (tx, rx) = mpsc::channel::<Msg>();
        let (wdb, wblocks) = (db.clone(), blocks.clone());
        let writer = std::thread::Builder::new()
            .name("kvpool-meta".into())
            .spawn(move || write_loop(rx, wdb, wblocks))
            .map_err(|e| MetaError::Sled(sled::Error::Io(e)))?;
        Ok(Meta { db, blocks, kv, queue: Some(tx), writer: Some(writer) })
    }

    /// Run `f` once every op enqueued before it is applied and flushed to disk: space that a
    /// removed record named is reused only when no crash can bring that record back.
    pub fn after_durable(&self, f: impl FnOnce() + Send + 'static) {
        let Some(q) = &self.queue else { return f() };
        if let Err(mpsc::SendError(Msg::After(f))) = q.send(Msg::After(Box::new(f))) {
            // The writer is gone (shutting down): nothing more is persisted either.
            f();
        }
    }

    /// Resolves once everything enqueued before it (ops and [`Meta::after_durable`] work) is done.
    pub async fn barrier(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.queue.as_ref().is_some_and(|q| q.send(Msg::Barrier(tx)).is_ok()) {
            let _ = rx.await;
        }
    }

    /// Queue changes for the writer. Call while still holding the lock under which the index
    /// produced them, so that sled sees them in the index's order.
    pub fn enqueue(&self, ops: Vec<MetaOp>) {
        if ops.is_empty() {
            return;
        }
        if self.queue.as_ref().is_none_or(|q| q.send(Msg::Ops(ops)).is_err()) {
            tracing::error!("metadata writer thread is gone; changes are not persisted");
        }
    }

    /// Write a record at once, bypassing the queue (before the store serves, e.g. a migration).
    pub fn put_now(&self, tenant: u32, key: &[u8], record: &BlockRecord) -> Result<(), MetaError> {
        self.blocks.insert(scoped(tenant, key), codec::encode(record)?)?;
        Ok(())
    }

    /// Remove a record at once, bypassing the queue (before the store serves).
    pub fn remove_now(&self, tenant: u32, key: &[u8]) -> Result<(), MetaError> {
        self.blocks.remove(scoped(tenant, key))?;
        Ok(())
    }

    /// Every record: (tenant, key, record). Undecodable records come back as `None`.
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

    /// Wait until every queued change is in sled, then flush sled to disk.
    pub fn flush(&self) -> Result<(), MetaError> {
        let (tx, rx) = mpsc::channel();
        self.queue.as_ref().ok_or(MetaError::WriterGone)?.send(Msg::Flush(tx)).map_err(|_| MetaError::WriterGone)?;
        rx.recv().map_err(|_| MetaError::WriterGone)?.map_err(|e| MetaError::Sled(sled::Error::Unsupported(e)))
    }
}
