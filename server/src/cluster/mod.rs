//! Cluster roles of the one binary (`cluster.role`): a **master** that knows where every block
//! is and places new ones, and **storage** nodes that hold the blocks, serve them to clients
//! directly, and report what they hold to the master. `all` (the default) is a pool of one.
//!
//! The storage nodes' own indexes are the truth; the master's view is rebuilt from their
//! reports, so nothing is lost when the master restarts (see `master`).

pub mod leader;
pub mod master;
pub mod storage;

pub use master::Master;
