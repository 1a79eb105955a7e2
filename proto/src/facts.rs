//! Facts about each request variant, kept in one table so that a new request is one row here
//! and one handler in the server (which reads these instead of keeping its own lists).

use crate::Request;

impl Request {
    /// The operation's name in metrics and logs (`kvpool_op_seconds{op=...}`).
    pub fn name(&self) -> &'static str {
        self.facts().name
    }

    /// The oldest protocol version (negotiated by `Hello`) in which this request exists.
    pub fn min_version(&self) -> u16 {
        self.facts().min_version
    }

    /// Whether the request is about blocks a node holds (a cluster master answers those
    /// `unsupported`). `Subscribe` is not one: a master streams its storage nodes' KV events.
    pub fn holds_blocks(&self) -> bool {
        self.facts().holds_blocks
    }

    fn facts(&self) -> Facts {
        // (name, oldest version, holds blocks)
        let (name, min_version, holds_blocks) = match self {
            Request::Hello(_) => ("hello", 1, false),
            Request::Put(_) => ("put", 1, true),
            Request::Get(_) => ("get", 1, true),
            Request::Lookup(_) => ("lookup", 1, true),
            Request::Exists(_) => ("exists", 1, true),
            Request::Remove(_) => ("remove", 1, true),
            Request::RemoveAll(_) => ("remove_all", 1, true),
            Request::Stats => ("stats", 1, false),
            Request::Ping(_) => ("ping", 1, false),
            Request::PolicyLoad(_) => ("policy_load", 1, false),
            Request::PolicyList => ("policy_list", 1, false),
            Request::PolicyRollback(_) => ("policy_rollback", 1, false),
            Request::ShmAttach => ("shm_attach", 2, true),
            Request::LocalAttach => ("local_attach", 2, true),
            Request::Subscribe(_) => ("subscribe", 2, false),
            Request::PutIntent(_) => ("put_intent", 2, true),
            Request::PutDone(_) => ("put_done", 2, true),
            Request::GetLocate(_) => ("get_locate", 2, true),
            Request::Release(_) => ("release", 2, true),
            Request::PutFrom(_) => ("put_from", 2, true),
            Request::GetInto(_) => ("get_into", 2, true),
            Request::Write(_) => ("write", 2, true),
            Request::Read(_) => ("read", 2, true),
            Request::NodeJoin(_) => ("node_join", 2, false),
            Request::NodeReport(_) => ("node_report", 2, false),
            Request::Nodes => ("nodes", 2, false),
            Request::Route(_) => ("route", 2, false),
            Request::Place(_) => ("place", 2, false),
            Request::NodePut(_) => ("node_put", 2, true),
            Request::LookupLease(_) => ("lookup_lease", 2, true),
            Request::RemoveMatching(_) => ("remove_matching", 2, true),
            Request::BulkAttach(_) => ("bulk_attach", 2, true),
        };
        Facts { name, min_version, holds_blocks }
    }
}

struct Facts {
    name: &'static str,
    min_version: u16,
    holds_blocks: bool,
}

#[cfg(test)]
mod tests {
    use crate::Request;

    #[test]
    fn every_name_is_distinct() {
        let all = [Request::Stats, Request::PolicyList, Request::ShmAttach, Request::LocalAttach, Request::Nodes];
        let names: std::collections::HashSet<_> = all.iter().map(Request::name).collect();
        assert_eq!(names.len(), all.len());
        assert_eq!(Request::Stats.min_version(), 1);
        assert!(Request::ShmAttach.holds_blocks());
        assert!(!Request::Nodes.holds_blocks());
    }
}
