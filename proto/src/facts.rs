//! The request table: one row per request variant, in tag order, with everything a server needs
//! to know about a request before its handler runs. A new request is a variant in `messages.rs`
//! and one row here; the server reads these facts instead of keeping its own lists, and
//! [`REQUEST_TAGS`], [`V1_REQUEST_TAGS`] and the server's metric series come from the table.

use crate::messages::Request;

/// What a server needs to know about a request before its handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    /// The operation's name in metrics and logs (`kvpool_op_duration_seconds{op=...}`).
    pub name: &'static str,
    /// The oldest protocol version (negotiated by `Hello`) in which the request exists.
    pub min_version: u16,
    /// About blocks a node holds: a cluster master answers it `unsupported`. `Subscribe` is not
    /// one (a master streams its storage nodes' KV events).
    pub holds_blocks: bool,
    /// Only a QUIC stream may carry it (not the Unix control socket, not the TCP bulk channel):
    /// it binds a channel to the QUIC connection, or its answer is a stream that lasts.
    pub quic_only: bool,
    /// Declared value bytes follow the frame (the handler reads them and the end of the
    /// stream); for every other request the stream must end right after the frame.
    pub values_follow: bool,
    /// Only an admin api key may ask it.
    pub admin: bool,
    /// Answered with a stream of frames that lasts until either side ends it (not one answer).
    pub streams: bool,
}

impl RequestFacts {
    const fn row(name: &'static str, min_version: u16) -> RequestFacts {
        RequestFacts {
            name,
            min_version,
            holds_blocks: false,
            quic_only: false,
            values_follow: false,
            admin: false,
            streams: false,
        }
    }
}

/// The table: a row is `Variant => "name", oldest version, [facts that hold]`. Rows are in tag
/// (declaration) order; the tests check that every variant has its row and only its own.
macro_rules! request_table {
    ($($variant:ident => $name:literal, $version:literal, [$($fact:ident),*];)*) => {
        /// Every request's facts, indexed by its wire tag.
        pub const REQUESTS: &[RequestFacts] = &[$({
            #[allow(unused_mut)]
            let mut row = RequestFacts::row($name, $version);
            $(row.$fact = true;)*
            row
        },)*];

        /// The tags in declaration order (each variant's discriminant is its wire tag).
        #[derive(Clone, Copy)]
        enum Tag { $($variant,)* }

        impl Request {
            /// The request's wire tag (its index in [`REQUESTS`]).
            pub fn tag(&self) -> u32 {
                let tag = match self { $(Request::$variant { .. } => Tag::$variant,)* };
                tag as u32
            }
        }
    };
}

request_table! {
    // `Hello` is answered `malformed` on any stream but a connection's first QUIC one.
    Hello          => "hello",           1, [];
    Put            => "put",             1, [holds_blocks, values_follow];
    Get            => "get",             1, [holds_blocks];
    Lookup         => "lookup",          1, [holds_blocks];
    Exists         => "exists",          1, [holds_blocks];
    Remove         => "remove",          1, [holds_blocks];
    RemoveAll      => "remove_all",      1, [holds_blocks];
    Stats          => "stats",           1, [];
    Ping           => "ping",            1, [];
    PolicyLoad     => "policy_load",     1, [admin, values_follow];
    PolicyList     => "policy_list",     1, [admin];
    PolicyRollback => "policy_rollback", 1, [admin];
    ShmAttach      => "shm_attach",      2, [holds_blocks];
    PutIntent      => "put_intent",      2, [holds_blocks];
    PutDone        => "put_done",        2, [holds_blocks];
    GetLocate      => "get_locate",      2, [holds_blocks];
    Release        => "release",         2, [holds_blocks];
    PutFrom        => "put_from",        2, [holds_blocks];
    GetInto        => "get_into",        2, [holds_blocks];
    Write          => "write",           2, [holds_blocks, values_follow];
    Read           => "read",            2, [holds_blocks];
    LocalAttach    => "local_attach",    2, [holds_blocks, quic_only];
    Subscribe      => "subscribe",       2, [quic_only, streams];
    NodeJoin       => "node_join",       2, [admin];
    NodeReport     => "node_report",     2, [admin];
    Nodes          => "nodes",           2, [];
    Route          => "route",           2, [];
    Place          => "place",           2, [];
    NodePut        => "node_put",        2, [holds_blocks, admin, values_follow];
    LookupLease    => "lookup_lease",    2, [holds_blocks];
    RemoveMatching => "remove_matching", 2, [holds_blocks];
    BulkAttach     => "bulk_attach",     2, [holds_blocks, quic_only];
}

/// Number of request variants this version knows (tags `0..REQUEST_TAGS`).
pub const REQUEST_TAGS: u32 = REQUESTS.len() as u32;

/// Requests of version 1 (tags `0..V1_REQUEST_TAGS`); later tags need a version 2 hello.
pub const V1_REQUEST_TAGS: u32 = {
    let mut n = 0;
    while n < REQUESTS.len() && REQUESTS[n].min_version == 1 {
        n += 1;
    }
    n as u32
};

/// Every request's name, in tag order (the server's metric series).
pub const REQUEST_NAMES: [&str; REQUESTS.len()] = {
    let mut names = [""; REQUESTS.len()];
    let mut i = 0;
    while i < REQUESTS.len() {
        names[i] = REQUESTS[i].name;
        i += 1;
    }
    names
};

impl Request {
    /// This request's row of the table.
    pub fn facts(&self) -> &'static RequestFacts {
        &REQUESTS[self.tag() as usize]
    }

    /// The operation's name in metrics and logs (`kvpool_op_duration_seconds{op=...}`).
    pub fn name(&self) -> &'static str {
        self.facts().name
    }

    /// The oldest protocol version (negotiated by `Hello`) in which this request exists.
    pub fn min_version(&self) -> u16 {
        self.facts().min_version
    }

    /// Whether the request is about blocks a node holds (a cluster master answers those
    /// `unsupported`).
    pub fn holds_blocks(&self) -> bool {
        self.facts().holds_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::{REQUESTS, REQUEST_NAMES, REQUEST_TAGS, V1_REQUEST_TAGS};
    use crate::messages::Request;
    use crate::{codec, message_tag};

    /// A request of wire tag `tag` with every field zero or empty, if the tag is a request:
    /// its shortest encoding is the tag and enough zero bytes for its fields.
    fn sample(tag: u32) -> Option<Request> {
        (0..=256).find_map(|n| {
            let mut body = tag.to_le_bytes().to_vec();
            body.resize(4 + n, 0);
            codec::decode::<Request>(&body).ok()
        })
    }

    fn snake(variant: &str) -> String {
        let mut out = String::new();
        for (i, c) in variant.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        }
        out
    }

    #[test]
    fn every_request_variant_has_its_own_row() {
        for tag in 0..REQUEST_TAGS {
            let r = sample(tag).unwrap_or_else(|| panic!("no request of tag {tag}: the table has a row too many"));
            assert_eq!(r.tag(), tag, "{r:?}: rows out of declaration order");
            assert_eq!(message_tag(&codec::encode(&r).unwrap()), Some(tag));
            let variant = format!("{r:?}");
            let variant = variant.split(['(', ' ', '{']).next().unwrap();
            assert_eq!(r.name(), snake(variant), "tag {tag} is the row of another request");
        }
        // A variant appended without a row decodes here: the table must grow with the enum.
        assert!(sample(REQUEST_TAGS).is_none(), "request tag {REQUEST_TAGS} exists but has no row in the table");
    }

    #[test]
    fn the_derived_counts_and_names_follow_the_table() {
        assert_eq!(REQUEST_TAGS, 32);
        assert_eq!(V1_REQUEST_TAGS, 12);
        assert!(REQUESTS[V1_REQUEST_TAGS as usize..].iter().all(|r| r.min_version == 2), "version 1 rows first");
        let names: std::collections::HashSet<_> = REQUEST_NAMES.iter().collect();
        assert_eq!(names.len(), REQUESTS.len(), "names are distinct");
        assert!(Request::ShmAttach.holds_blocks() && !Request::Nodes.holds_blocks());
        // Exactly the requests that bind a channel to the QUIC connection or answer with a
        // stream stay on QUIC; exactly those with value bytes declare them.
        let quic_only: Vec<_> = REQUESTS.iter().filter(|r| r.quic_only).map(|r| r.name).collect();
        assert_eq!(quic_only, ["local_attach", "subscribe", "bulk_attach"]);
        let values: Vec<_> = REQUESTS.iter().filter(|r| r.values_follow).map(|r| r.name).collect();
        assert_eq!(values, ["put", "policy_load", "write", "node_put"]);
        let admin: Vec<_> = REQUESTS.iter().filter(|r| r.admin).map(|r| r.name).collect();
        assert_eq!(admin, ["policy_load", "policy_list", "policy_rollback", "node_join", "node_report", "node_put"]);
    }
}
