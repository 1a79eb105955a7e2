//! What the UDP sockets of this process did: calls, messages and datagrams, each way.
//!
//! The point is to see segmentation and receive offload at work. With GSO, one `sendmsg`
//! carries up to 10 packets (quinn's `MAX_TRANSMIT_SEGMENTS`); with `UDP_GRO` (which quinn-udp
//! sets on every socket), one received message may hold several packets of one flow, `len`
//! bytes cut every `stride` bytes. Datagrams per message is the receive offload's batch:
//! 1 means every packet costs a trip through the kernel's receive path and a `recvmmsg` slot.
//!
//! Counters are process-wide (every endpoint made by this crate adds to them): the server has
//! one endpoint, and a client process sums its connections, which is what `/metrics` and the
//! benchmark report. Relaxed atomics: each counter is exact, a snapshot is not one instant.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub(crate) struct UdpCounters {
    recv_calls: AtomicU64,
    recv_messages: AtomicU64,
    recv_datagrams: AtomicU64,
    recv_bytes: AtomicU64,
    send_calls: AtomicU64,
    send_datagrams: AtomicU64,
    send_bytes: AtomicU64,
}

pub(crate) static UDP: UdpCounters = UdpCounters {
    recv_calls: AtomicU64::new(0),
    recv_messages: AtomicU64::new(0),
    recv_datagrams: AtomicU64::new(0),
    recv_bytes: AtomicU64::new(0),
    send_calls: AtomicU64::new(0),
    send_datagrams: AtomicU64::new(0),
    send_bytes: AtomicU64::new(0),
};

/// Datagrams in a received message of `len` bytes cut every `stride` bytes (the last may be
/// short). A stride of 0 (never seen from quinn-udp) counts as one datagram.
pub(crate) fn datagrams_in(len: usize, stride: usize) -> u64 {
    if stride == 0 || len <= stride {
        1
    } else {
        len.div_ceil(stride) as u64
    }
}

impl UdpCounters {
    /// One receive call that returned `metas` (each one message of `len` bytes, `stride`
    /// apart).
    pub(crate) fn received(&self, metas: impl Iterator<Item = (usize, usize)>) {
        let (mut msgs, mut dgrams, mut bytes) = (0u64, 0u64, 0u64);
        for (len, stride) in metas {
            msgs += 1;
            dgrams += datagrams_in(len, stride);
            bytes += len as u64;
        }
        self.recv_calls.fetch_add(1, Relaxed);
        self.recv_messages.fetch_add(msgs, Relaxed);
        self.recv_datagrams.fetch_add(dgrams, Relaxed);
        self.recv_bytes.fetch_add(bytes, Relaxed);
    }

    /// One send call that the kernel took: `len` bytes, one datagram per `segment` bytes.
    pub(crate) fn sent(&self, len: usize, segment: Option<usize>) {
        self.send_calls.fetch_add(1, Relaxed);
        self.send_datagrams.fetch_add(datagrams_in(len, segment.unwrap_or(len)), Relaxed);
        self.send_bytes.fetch_add(len as u64, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> UdpStats {
        UdpStats {
            recv_calls: self.recv_calls.load(Relaxed),
            recv_messages: self.recv_messages.load(Relaxed),
            recv_datagrams: self.recv_datagrams.load(Relaxed),
            recv_bytes: self.recv_bytes.load(Relaxed),
            send_calls: self.send_calls.load(Relaxed),
            send_datagrams: self.send_datagrams.load(Relaxed),
            send_bytes: self.send_bytes.load(Relaxed),
        }
    }
}

/// The UDP counters of this process so far (every QUIC endpoint made by this crate).
pub fn udp_stats() -> UdpStats {
    UDP.snapshot()
}

/// A snapshot of the UDP counters; [`UdpStats::since`] gives what happened in between two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdpStats {
    /// Receive calls (`recvmmsg`) that returned data.
    pub recv_calls: u64,
    /// Messages received: what one `recvmsg` returns, one GRO batch.
    pub recv_messages: u64,
    /// Datagrams (QUIC packets) in those messages.
    pub recv_datagrams: u64,
    pub recv_bytes: u64,
    /// Send calls (`sendmsg`) the kernel took.
    pub send_calls: u64,
    /// Datagrams in them: more than one per call with segmentation offload (GSO).
    pub send_datagrams: u64,
    pub send_bytes: u64,
}

impl UdpStats {
    /// Counters from `earlier` to `self`.
    pub fn since(&self, earlier: &UdpStats) -> UdpStats {
        UdpStats {
            recv_calls: self.recv_calls.saturating_sub(earlier.recv_calls),
            recv_messages: self.recv_messages.saturating_sub(earlier.recv_messages),
            recv_datagrams: self.recv_datagrams.saturating_sub(earlier.recv_datagrams),
            recv_bytes: self.recv_bytes.saturating_sub(earlier.recv_bytes),
            send_calls: self.send_calls.saturating_sub(earlier.send_calls),
            send_datagrams: self.send_datagrams.saturating_sub(earlier.send_datagrams),
            send_bytes: self.send_bytes.saturating_sub(earlier.send_bytes),
        }
    }

    /// Datagrams per received message: the receive offload's batch (1.0 without GRO).
    pub fn datagrams_per_recv(&self) -> f64 {
        ratio(self.recv_datagrams, self.recv_messages)
    }

    /// Datagrams per send call: the segmentation offload's batch (1.0 without GSO).
    pub fn datagrams_per_send(&self) -> f64 {
        ratio(self.send_datagrams, self.send_calls)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl std::fmt::Display for UdpStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "received {} datagrams in {} messages ({:.2} per recvmsg, {} calls), sent {} datagrams in {} calls ({:.2} per sendmsg)",
            self.recv_datagrams,
            self.recv_messages,
            self.datagrams_per_recv(),
            self.recv_calls,
            self.send_datagrams,
            self.send_calls,
            self.datagrams_per_send()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gro_message_counts_its_datagrams_the_last_one_short() {
        assert_eq!(datagrams_in(1_472, 1_472), 1);
        assert_eq!(datagrams_in(10 * 1_472, 1_472), 10);
        assert_eq!(datagrams_in(9 * 1_472 + 100, 1_472), 10);
        assert_eq!(datagrams_in(100, 1_472), 1, "a short single datagram");
        assert_eq!(datagrams_in(100, 0), 1);
        let c = UdpCounters::default();
        c.received([(10 * 1_472, 1_472), (1_200, 1_200)].into_iter());
        c.sent(7 * 8_972, Some(8_972));
        c.sent(1_200, None);
        let s = c.snapshot();
        assert_eq!((s.recv_calls, s.recv_messages, s.recv_datagrams, s.recv_bytes), (1, 2, 11, 15_920));
        assert_eq!((s.send_calls, s.send_datagrams), (2, 8));
        assert_eq!(s.datagrams_per_recv(), 5.5);
        assert_eq!(s.datagrams_per_send(), 4.0);
        assert_eq!(s.since(&s), UdpStats::default());
    }
}
