//! A client of a cluster pool: control requests go to the master (where are these keys, where
//! should these new blocks go), block bytes go straight to and from the storage nodes, which
//! the client reaches with the same API key, pinning the certificate the master vouches for.

use crate::nodes::Nodes;
use crate::{unexpected, Client, ClientConfig, GetResult, PutEntry, Result, Trust};
use futures_util::future::join_all;
use kvpool_proto::{
    ErrorCode, KeysRequest, NodeAddr, NodeInfo, NodeJoinRequest, NodeJoined, NodeReportRequest, PlaceRequest,
    PolicyInfo, PolicyKind, PutItem, PutMode, RemoveAllResponse, Request, Response, Routes,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

// ---- the cluster requests on a plain connection (to the master) -------------------------------

impl Client {
    /// Storage nodes: join the master (admin key); the answer is this node's id.
    pub async fn node_join(&self, req: NodeJoinRequest) -> Result<NodeJoined> {
        match self.call(Request::NodeJoin(req)).await? {
            Response::NodeJoined(j) => Ok(j),
            other => Err(unexpected("NodeJoined", &other)),
        }
    }

    /// Storage nodes: report tier use and the copies stored or dropped since the last report.
    /// `expired` means the master no longer knows this node's incarnation: join again.
    pub async fn node_report(&self, req: NodeReportRequest) -> Result<()> {
        match self.call(Request::NodeReport(req)).await? {
            Response::Done => Ok(()),
            other => Err(unexpected("Done", &other)),
        }
    }

    /// The pool's storage nodes, as the master sees them.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        match self.call(Request::Nodes).await? {
            Response::NodeList(l) => Ok(l.nodes),
            other => Err(unexpected("NodeList", &other)),
        }
    }

    /// What this server is: a cluster master answers `Nodes` (a standby master answers
    /// `not-leader`); a standalone server or a storage node answers `unsupported`, as does
    /// any server on a version 1 connection (any other refusal also means a server). One
    /// round trip.
    pub async fn role(&self) -> Result<ServerRole> {
        match self.nodes().await {
            Ok(_) => Ok(ServerRole::Master),
            Err(e) if e.code() == ErrorCode::NotLeader => Ok(ServerRole::Master),
            // Any other answer (`unsupported`, or an older server's `unknown-message`): a server
            // that does not list nodes holds its blocks itself.
            Err(crate::ClientError::Status { .. }) => Ok(ServerRole::Server),
            Err(e) => Err(e),
        }
    }

    /// Which live storage nodes hold each key (best first).
    pub async fn route<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Routes> {
        self.check_keys(keys.iter().map(|k| k.as_ref()))?;
        let req = Request::Route(KeysRequest { keys: keys.iter().map(|k| k.as_ref().to_vec()).collect() });
        routes(self.call(req).await?, keys.len())
    }

    /// Which storage nodes should store each new block (`replicas` distinct nodes each).
    pub async fn place(&self, items: Vec<PutItem>, replicas: u32) -> Result<Routes> {
        let n = items.len();
        routes(self.call(Request::Place(PlaceRequest { items, replicas })).await?, n)
    }
}

fn routes(resp: Response, n: usize) -> Result<Routes> {
    match resp {
        Response::Routes(r) if r.items.len() == n => Ok(r),
        Response::Routes(r) => {
            Err(crate::ClientError::Protocol(format!("{n} items answered with {} routes", r.items.len())))
        }
        other => Err(unexpected("Routes", &other)),
    }
}

/// What a server is to its clients (see [`Client::role`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerRole {
    /// It holds blocks and serves them itself.
    Server,
    /// A cluster master: blocks are on the storage nodes it names ([`ClusterClient`]).
    Master,
}

// ---- the cluster client ----------------------------------------------------------------------

/// Where the master is.
#[derive(Debug, Clone)]
enum MasterAt {
    Fixed,
    /// Whoever leads according to etcd; looked up again when the master fails.
    Etcd {
        etcd: kvpool_etcd::Etcd,
        prefix: String,
    },
}

/// A connector's view of a cluster pool: [`Client`]'s calls, answered by the storage nodes the
/// master names. With etcd, a master that fails or no longer leads is replaced by the one etcd
/// names next, and the call is tried again. Cheap to clone.
#[derive(Clone)]
pub struct ClusterClient {
    master: Arc<std::sync::RwLock<Client>>,
    at: MasterAt,
    /// Connections to storage nodes, and which are down.
    nodes: Nodes,
    /// How to connect to a master or a node (server, name and trust are replaced).
    template: ClientConfig,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient").field("master", &self.master).finish()
    }
}

impl ClusterClient {
    /// Connect to the master; storage nodes are connected to when first needed, with the same
    /// API key and client settings.
    pub async fn connect(master: ClientConfig) -> Result<ClusterClient> {
        let template = master.clone();
        // The master holds no blocks, so it offers no shared memory: control goes over QUIC.
        let mut master = master;
        master.transport = crate::TransportChoice::Quic;
        let master = Client::connect_direct(master).await?;
        Ok(ClusterClient {
            master: Arc::new(std::sync::RwLock::new(master)),
            at: MasterAt::Fixed,
            nodes: Nodes::new(template.clone()),
            template,
        })
    }

    /// A cluster client over an open connection to a master (say, one [`Client::role`] found
    /// to be a master); storage nodes are reached with the settings that connection was made
    /// with.
    pub fn from_master(master: Client) -> ClusterClient {
        let template = master.config().clone();
        ClusterClient::from_master_as(master, template)
    }

    /// [`ClusterClient::from_master`], reaching the nodes with `template` (its server and trust
    /// are replaced per node).
    pub(crate) fn from_master_as(master: Client, template: ClientConfig) -> ClusterClient {
        // A client that already routes (`Client::connect` found the master) has one.
        if let Some(cc) = master.cluster() {
            return cc.clone();
        }
        ClusterClient {
            master: Arc::new(std::sync::RwLock::new(master)),
            at: MasterAt::Fixed,
            nodes: Nodes::new(template.clone()),
            template,
        }
    }

    /// Connect to the leading master of the cluster under `prefix` in etcd (`endpoints`:
    /// comma-separated `http://host:port`), trusting the certificate fingerprint it published
    /// there. `template` gives the API key and client settings (its server and trust are
    /// replaced).
    pub async fn connect_etcd(endpoints: &str, prefix: &str, template: ClientConfig) -> Result<ClusterClient> {
        let etcd = kvpool_etcd::Etcd::new(endpoints).map_err(|e| crate::ClientError::Config(e.to_string()))?;
        let at = MasterAt::Etcd { etcd, prefix: prefix.to_string() };
        let master = leader(&at, &template).await?;
        Ok(ClusterClient {
            master: Arc::new(std::sync::RwLock::new(master)),
            at,
            nodes: Nodes::new(template.clone()),
            template,
        })
    }

    /// The data path to each storage node this client is connected to, by node id: `shm` for
    /// a node on this host, else `quic`.
    pub fn node_transports(&self) -> Vec<(u32, &'static str)> {
        self.nodes.transports()
    }

    /// The connection to the master (the current leader).
    pub fn master(&self) -> Client {
        self.master.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Run `f` on the master; with etcd, when the master is gone or no longer leads, find the
    /// leader again and retry until the call's deadline (the client's request timeout).
    async fn on_master<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let deadline = std::time::Instant::now() + self.template.request_timeout;
        loop {
            let c = self.master();
            let e = match f(c).await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let failover = matches!(
                e,
                crate::ClientError::Connect { .. }
                    | crate::ClientError::Closed(_)
                    | crate::ClientError::Timeout(_)
                    | crate::ClientError::Io(_)
            ) || e.code() == ErrorCode::NotLeader;
            if !failover || matches!(self.at, MasterAt::Fixed) {
                return Err(e);
            }
            tracing::info!(error = %e, "master failed: looking up the leader again");
            // Even past the deadline: the next call should not wait on the failed master again.
            if let Ok(m) = leader(&self.at, &self.template).await {
                *self.master.write().unwrap_or_else(|p| p.into_inner()) = m;
            }
            if std::time::Instant::now() >= deadline {
                return Err(e);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Where each key is (see [`Client::route`]).
    pub async fn route<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Routes> {
        let keys: Vec<&[u8]> = keys.iter().map(AsRef::as_ref).collect();
        let keys = &keys;
        self.on_master(|m| async move { m.route(keys).await }).await
    }

    /// Number of leading blocks of `chain` that some live storage node holds.
    pub async fn lookup<K: AsRef<[u8]>>(&self, chain: &[K]) -> Result<usize> {
        if chain.is_empty() {
            return Ok(0);
        }
        let r = self.route(chain).await?;
        Ok(r.items.iter().take_while(|n| !n.is_empty()).count())
    }

    /// Put blocks on the nodes the master places them on (`replicas` distinct nodes each).
    /// One status per entry: `Ok` when every copy was stored, else the first other status
    /// (`NoSpace` when no storage node is live). The master learns of the new copies from the
    /// nodes' next reports, a moment later.
    pub async fn put_batch(&self, entries: &[PutEntry<'_>], mode: PutMode, replicas: u32) -> Result<Vec<ErrorCode>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let items = self.master().put_items(entries.iter().map(|e| (e.key, e.value.len() as u64, &e.opts)))?;
        let routes = self
            .on_master(|m| {
                let items = items.clone();
                async move { m.place(items, replicas).await }
            })
            .await?;
        let addrs: HashMap<u32, &NodeAddr> = routes.nodes.iter().map(|a| (a.node, a)).collect();
        let mut status: Vec<ErrorCode> =
            routes.items.iter().map(|n| if n.is_empty() { ErrorCode::NoSpace } else { ErrorCode::Ok }).collect();
        let by_node = by_node(&routes.items);
        let puts = by_node.into_iter().map(|(n, idx)| {
            let addr = addrs.get(&n).copied().cloned();
            async move {
                let Some(addr) = addr else {
                    return (idx, Err(crate::ClientError::Protocol(format!("node {n} is routed to but not named"))));
                };
                let batch: Vec<PutEntry<'_>> = idx.iter().map(|&i| entries[i].clone()).collect();
                let r = self.nodes.call(&addr, |c| async move { c.put_batch_direct(&batch, mode).await }).await;
                (idx, r)
            }
        });
        for (idx, r) in join_all(puts).await {
            match r {
                Ok(codes) => {
                    for (&i, c) in idx.iter().zip(codes) {
                        if status[i] == ErrorCode::Ok {
                            status[i] = c;
                        }
                    }
                }
                Err(e) => {
                    for &i in &idx {
                        if status[i] == ErrorCode::Ok {
                            status[i] = e.code();
                        }
                    }
                }
            }
        }
        Ok(status)
    }

    /// Get blocks from the nodes that hold them: each key from its best holder, then from the
    /// next one for keys that holder did not serve (node down, the copy went since the master
    /// heard of it, or it failed its checksum). A key no holder could serve is `NotFound` (or
    /// `Corrupt` when the last copy tried was). Bytes are checked
    /// against their checksums as with [`Client::get_batch`].
    pub async fn get_batch<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<GetResult>> {
        let miss = GetResult { status: ErrorCode::NotFound, value: None, tier: 0, lease_ms: 0 };
        self.each_holder(
            keys,
            miss,
            |r| r.status,
            |c, idx| async move {
                let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
                c.get_batch_direct(&ks).await
            },
        )
        .await
    }

    /// Run `fetch` for each key on its holders, best first, until one serves it (see
    /// [`ClusterClient::get_batch`]); `miss` is the answer of a key no holder served.
    async fn each_holder<K, T, F, Fut>(
        &self,
        keys: &[K],
        miss: T,
        status: impl Fn(&T) -> ErrorCode,
        fetch: F,
    ) -> Result<Vec<T>>
    where
        K: AsRef<[u8]>,
        T: Clone,
        F: Fn(Client, Vec<usize>) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<T>>>,
    {
        let mut out = vec![miss; keys.len()];
        if keys.is_empty() {
            return Ok(out);
        }
        let routes = self.route(keys).await?;
        let mut addrs: HashMap<u32, NodeAddr> = routes.nodes.iter().map(|a| (a.node, a.clone())).collect();
        // Per key, the holders still to try.
        let mut left: Vec<std::collections::VecDeque<u32>> =
            routes.items.into_iter().map(|v| v.into_iter().collect()).collect();
        let routed: Vec<bool> = left.iter().map(|q| !q.is_empty()).collect();
        // Keys whose last holder tried failed as a node (down, silent), not with an answer.
        let mut unanswered = vec![false; keys.len()];
        // A block may move between nodes while it is read (a full node hands its DRAM victims
        // to another): keys that had holders but were served by none are routed again.
        let mut reroutes = 2;
        loop {
            let mut by_node: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for (i, q) in left.iter_mut().enumerate() {
                // A copy that failed its checksum was dropped by its node: try another.
                if matches!(status(&out[i]), ErrorCode::NotFound | ErrorCode::Corrupt) {
                    if let Some(n) = q.pop_front() {
                        by_node.entry(n).or_default().push(i);
                    }
                }
            }
            if by_node.is_empty() {
                // Keys a holder answered for; a node that failed is not asked again (the master
                // would name it again until it times the node out).
                let missed: Vec<usize> = (0..keys.len())
                    .filter(|&i| routed[i] && !unanswered[i] && status(&out[i]) == ErrorCode::NotFound)
                    .collect();
                if missed.is_empty() || reroutes == 0 {
                    return Ok(out);
                }
                reroutes -= 1;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                let again = self.route(&missed.iter().map(|&i| keys[i].as_ref()).collect::<Vec<_>>()).await?;
                addrs.extend(again.nodes.into_iter().map(|a| (a.node, a)));
                for (&i, holders) in missed.iter().zip(again.items) {
                    left[i] = holders.into_iter().collect();
                }
                continue;
            }
            let gets = by_node.into_iter().map(|(n, idx)| {
                let addr = addrs.get(&n).cloned();
                let fetch = &fetch;
                async move {
                    let Some(addr) = addr else { return (idx, None) };
                    let mine = idx.clone();
                    match self.nodes.call(&addr, |c| fetch(c, mine)).await {
                        Ok(items) if items.len() == idx.len() => (idx, Some(items)),
                        Ok(items) => {
                            tracing::debug!(node = n, got = items.len(), "storage node answered the wrong count");
                            (idx, None)
                        }
                        Err(e) => {
                            tracing::debug!(node = n, error = %e, "storage node failed a get: trying other holders");
                            (idx, None)
                        }
                    }
                }
            });
            for (idx, r) in join_all(gets).await {
                let Some(items) = r else {
                    for i in idx {
                        unanswered[i] = true;
                    }
                    continue;
                };
                for (i, item) in idx.into_iter().zip(items) {
                    unanswered[i] = false;
                    out[i] = item;
                }
            }
        }
    }

    /// Read one block; `None` when no live node has it.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let mut r = self.get_batch(&[key.as_ref()]).await?;
        let r = r.pop().expect("one key");
        match r.status {
            ErrorCode::Ok => Ok(r.value),
            ErrorCode::NotFound => Ok(None),
            code => Err(crate::ClientError::status(code, "get")),
        }
    }

    /// The pool's storage nodes, as the master sees them.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        self.on_master(|m| async move { m.nodes().await }).await
    }

    /// Run `f` on every live storage node; per node, its name and the outcome.
    async fn on_every_node<T, F, Fut>(&self, f: F) -> Result<Vec<(String, Result<T>)>>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut out = Vec::new();
        for n in self.nodes().await?.into_iter().filter(|n| n.live) {
            let addr = NodeAddr { node: n.node, addr: n.addr, server_name: n.server_name, fingerprint: n.fingerprint };
            let r = self.nodes.call(&addr, &f).await;
            out.push((n.name, r));
        }
        Ok(out)
    }

    /// Load a policy module on the pool (admin key): a placement module on the master (it
    /// places), an eviction or admission module on every live storage node (each evicts and
    /// admits for itself). Per place, its name (`master` or the node's) and the outcome. A node
    /// that joins later keeps its own configured policy until it is loaded there too.
    pub async fn policy_load(
        &self,
        kind: PolicyKind,
        name: &str,
        params: &[(String, String)],
        wasm: &[u8],
    ) -> Result<Vec<(String, Result<PolicyInfo>)>> {
        if kind == PolicyKind::Placement {
            let r = self.on_master(|m| async move { m.policy_load(kind, name, params, wasm).await }).await;
            return Ok(vec![("master".to_string(), r)]);
        }
        self.on_every_node(|c| async move { c.policy_load(kind, name, params, wasm).await }).await
    }

    /// Roll back a kind's module where [`ClusterClient::policy_load`] loads it.
    pub async fn policy_rollback(&self, kind: PolicyKind) -> Result<Vec<(String, Result<PolicyInfo>)>> {
        if kind == PolicyKind::Placement {
            let r = self.on_master(|m| async move { m.policy_rollback(kind).await }).await;
            return Ok(vec![("master".to_string(), r)]);
        }
        self.on_every_node(|c| async move { c.policy_rollback(kind).await }).await
    }

    /// The policy modules of the master and of every live storage node.
    pub async fn policy_list(&self) -> Result<Vec<(String, Result<Vec<PolicyInfo>>)>> {
        let mut out = vec![("master".to_string(), self.on_master(|m| async move { m.policy_list().await }).await)];
        out.extend(self.on_every_node(|c| async move { c.policy_list().await }).await?);
        Ok(out)
    }

    /// Statistics of every live storage node (the master holds no blocks).
    pub async fn stats(&self) -> Result<Vec<(String, Result<crate::StatsReport>)>> {
        self.on_every_node(|c| async move { c.stats().await }).await
    }

    /// Whether some live node holds each key (as the master knows it).
    pub async fn exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<bool>> {
        Ok(self.route(keys).await?.items.iter().map(|n| !n.is_empty()).collect())
    }

    /// [`ClusterClient::get_batch`] into the caller's buffers (`bufs[i]` for `keys[i]`); a value
    /// larger than its buffer is `ValueTooLarge`, as with [`Client::get_batch_into`]. A node on
    /// this host copies its values through shared memory (no socket carries them).
    pub async fn get_batch_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<crate::GetIntoResult>> {
        if keys.len() != bufs.len() {
            return Err(crate::ClientError::Config(format!("{} keys but {} buffers", keys.len(), bufs.len())));
        }
        // Each node's call borrows its keys' buffers for its duration, and gives them back.
        let bufs = std::sync::Mutex::new(bufs);
        let miss = crate::GetIntoResult { status: ErrorCode::NotFound, size: 0, tier: 0, lease_ms: 0 };
        let bufs = &bufs;
        self.each_holder(
            keys,
            miss,
            |r| r.status,
            |c, idx| async move {
                let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
                let mut lent = Lent::take(bufs, idx);
                c.get_batch_into_direct(&ks, &mut lent.mine).await
            },
        )
        .await
    }

    /// Remove every block of this tenant on every live storage node: the sums of what each
    /// removed and kept (leased). A node that fails fails the call (what others removed stays
    /// removed).
    pub async fn remove_all(&self, force: bool) -> Result<RemoveAllResponse> {
        sum(self.on_every_node(|c| async move { c.remove_all_direct(force).await }).await?)
    }

    /// [`Client::remove_matching`] on every live storage node, summed as
    /// [`ClusterClient::remove_all`].
    pub async fn remove_matching(
        &self,
        prefix: impl AsRef<[u8]>,
        pattern: Option<&str>,
        force: bool,
    ) -> Result<RemoveAllResponse> {
        let prefix = prefix.as_ref();
        sum(self.on_every_node(|c| async move { c.remove_matching_direct(prefix, pattern, force).await }).await?)
    }

    /// Remove blocks from every node that holds them. Per key: the first refusal (`Leased`, ...)
    /// when a copy stays, else `Ok` when a copy was removed, else `NotFound`.
    pub async fn remove_batch<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<ErrorCode>> {
        let routes = self.route(keys).await?;
        let addrs: HashMap<u32, &NodeAddr> = routes.nodes.iter().map(|a| (a.node, a)).collect();
        let mut status = vec![ErrorCode::NotFound; keys.len()];
        for (n, idx) in by_node(&routes.items) {
            let Some(addr) = addrs.get(&n) else { continue };
            let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
            let ks = &ks;
            let codes = self.nodes.call(addr, |c| async move { c.remove_batch_direct(ks, force).await }).await?;
            for (&i, c) in idx.iter().zip(codes) {
                // A copy left behind (leased, ...) is the answer; else removed anywhere is `Ok`.
                status[i] = match (status[i], c) {
                    (ErrorCode::NotFound, other) => other,
                    (ErrorCode::Ok, ErrorCode::Ok | ErrorCode::NotFound) => ErrorCode::Ok,
                    (ErrorCode::Ok, refused) => refused,
                    (refused, _) => refused,
                };
            }
        }
        Ok(status)
    }
}

fn sum(per_node: Vec<(String, Result<RemoveAllResponse>)>) -> Result<RemoveAllResponse> {
    let mut out = RemoveAllResponse { removed: 0, skipped: 0 };
    for (_, r) in per_node {
        let r = r?;
        out.removed += r.removed;
        out.skipped += r.skipped;
    }
    Ok(out)
}

/// Buffers of some keys, taken from a batch's for one node's call and given back when it ends,
/// also when a silent node's call is abandoned (so another holder can fill them).
struct Lent<'m, 'b, 'c> {
    all: &'m std::sync::Mutex<&'b mut [&'c mut [u8]]>,
    idx: Vec<usize>,
    mine: Vec<&'c mut [u8]>,
}

impl<'m, 'b, 'c> Lent<'m, 'b, 'c> {
    fn take(all: &'m std::sync::Mutex<&'b mut [&'c mut [u8]]>, idx: Vec<usize>) -> Self {
        let mine = {
            let mut g = all.lock().unwrap_or_else(|p| p.into_inner());
            idx.iter().map(|&i| std::mem::take(&mut g[i])).collect()
        };
        Lent { all, idx, mine }
    }
}

impl Drop for Lent<'_, '_, '_> {
    fn drop(&mut self) {
        let mut g = self.all.lock().unwrap_or_else(|p| p.into_inner());
        for (&i, b) in self.idx.iter().zip(self.mine.drain(..)) {
            g[i] = b;
        }
    }
}

/// Item positions grouped by each node that `items` names for them.
fn by_node(items: &[Vec<u32>]) -> BTreeMap<u32, Vec<usize>> {
    let mut out: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, nodes) in items.iter().enumerate() {
        for &n in nodes {
            out.entry(n).or_default().push(i);
        }
    }
    out
}

/// Connect to the master `at` names.
async fn leader(at: &MasterAt, template: &ClientConfig) -> Result<Client> {
    let mut cfg = template.clone();
    cfg.transport = crate::TransportChoice::Quic;
    if let MasterAt::Etcd { etcd, prefix } = at {
        let l = etcd
            .leader(prefix)
            .await
            .map_err(|e| crate::ClientError::Connect { addr: "etcd".into(), message: e.to_string() })?
            .ok_or_else(|| crate::ClientError::Connect {
                addr: "etcd".into(),
                message: format!("no master leads the cluster under {prefix}"),
            })?;
        cfg.server = l.addr;
        cfg.server_name = l.server_name;
        cfg.trust = Trust::Fingerprint(crate::parse_fingerprint(&l.fingerprint)?);
    }
    Client::connect_direct(cfg).await
}
