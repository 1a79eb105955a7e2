//! A UDP socket whose multi-packet sends always fit the kernel's limit, whatever the MTU.
//!
//! quinn hands the kernel up to 10 packets of the path MTU in one segmentation-offload send, and
//! Linux refuses a send of more than 65,507 bytes of UDP payload (`EMSGSIZE`, which quinn-udp
//! counts as sent: quinn issues #1635, #2199). With 10 packets that caps the MTU at about
//! 6,500 bytes, a third short of a 9,000-byte jumbo link. This wrapper cuts a send that is too
//! large into sends of whole packets that fit, so MTU discovery can climb to the link's MTU with
//! offload on. (quinn PR #2653 proposed the same inside quinn-udp; it was not merged.)
//!
//! Every call through it is counted ([`crate::udp_stats`]): datagrams per send and per
//! received message show whether segmentation and receive offload carry the packets.

use crate::counters::{UdpCounters, UDP};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Largest UDP payload of one IPv4 send: 65,535 minus the IP and UDP headers.
pub const MAX_SEND: usize = 65_507;

#[derive(Debug)]
pub struct SplitSends {
    inner: Arc<dyn AsyncUdpSocket>,
    counters: &'static UdpCounters,
    /// The task that reads the socket's ICMP errors ([`crate::Refusals`]): it lives as long
    /// as the socket.
    _watch: Option<crate::refusals::Watch>,
}

impl SplitSends {
    /// `inner`, its calls counted in this process's [`crate::udp_stats`].
    pub fn new(inner: Arc<dyn AsyncUdpSocket>) -> SplitSends {
        SplitSends { inner, counters: &UDP, _watch: None }
    }

    /// [`SplitSends::new`] for a socket whose ICMP errors `watch` reads
    /// ([`crate::Refusals::watch`]); the watch ends with the socket.
    pub(crate) fn watched(inner: Arc<dyn AsyncUdpSocket>, watch: Option<crate::refusals::Watch>) -> SplitSends {
        SplitSends { inner, counters: &UDP, _watch: watch }
    }

    /// The one send the kernel takes, counted when it took it.
    fn send(&self, t: &Transmit) -> io::Result<()> {
        self.inner.try_send(t)?;
        self.counters.sent(t.contents.len(), t.segment_size);
        Ok(())
    }
}

/// The sends `t` is cut into: whole packets of its segment size, at most [`MAX_SEND`] bytes each.
fn parts<'a>(t: &'a Transmit<'a>) -> impl Iterator<Item = Transmit<'a>> + 'a {
    let seg = t.segment_size.unwrap_or(t.contents.len()).max(1);
    let per = if t.contents.len() > MAX_SEND && t.segment_size.is_some() {
        (MAX_SEND / seg).max(1) * seg
    } else {
        t.contents.len().max(1)
    };
    t.contents.chunks(per).map(move |c| Transmit {
        destination: t.destination,
        ecn: t.ecn,
        contents: c,
        segment_size: t.segment_size.filter(|&s| c.len() > s),
        src_ip: t.src_ip,
    })
}

impl AsyncUdpSocket for SplitSends {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        if t.contents.len() <= MAX_SEND || t.segment_size.is_none() {
            return self.send(t);
        }
        for (i, part) in parts(t).enumerate() {
            match self.send(&part) {
                Ok(()) => {}
                // Nothing sent yet: quinn waits until the socket is writable and retries it all.
                Err(e) if i == 0 => return Err(e),
                // Part of it went out: retrying all of it would send that part twice. The rest
                // is lost, as a full socket buffer loses it, and QUIC's loss recovery resends it.
                Err(e) => {
                    tracing::debug!(error = %e, sent = i, "the rest of a split send was dropped");
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let got = self.inner.poll_recv(cx, bufs, meta);
        if let Poll::Ready(Ok(n)) = got {
            self.counters.received(meta.iter().take(n).map(|m| (m.len, m.stride)));
        }
        got
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket that takes every send and hands out one GRO message of 10 packets and one
    /// lone packet per receive.
    #[derive(Debug)]
    struct Canned;

    #[derive(Debug)]
    struct Writable;

    impl UdpPoller for Writable {
        fn poll_writable(self: Pin<&mut Self>, _: &mut Context) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncUdpSocket for Canned {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            Box::pin(Writable)
        }
        fn try_send(&self, _: &Transmit) -> io::Result<()> {
            Ok(())
        }
        fn poll_recv(
            &self,
            _: &mut Context,
            _: &mut [IoSliceMut<'_>],
            meta: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            meta[0] = RecvMeta { len: 10 * 1_472, stride: 1_472, ..RecvMeta::default() };
            meta[1] = RecvMeta { len: 300, stride: 300, ..RecvMeta::default() };
            // A stale slot past the count returned: never counted.
            meta[2] = RecvMeta { len: 5_000, stride: 1_000, ..RecvMeta::default() };
            Poll::Ready(Ok(2))
        }
        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok("127.0.0.1:1".parse().unwrap())
        }
    }

    #[test]
    fn receives_and_sends_are_counted_by_datagram() {
        let counters: &'static UdpCounters = Box::leak(Box::default());
        let s = SplitSends { inner: Arc::new(Canned), counters, _watch: None };
        let mut metas = [RecvMeta::default(); 3];
        let mut buf = [0u8; 16];
        let mut bufs = [IoSliceMut::new(&mut buf)];
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(matches!(s.poll_recv(&mut cx, &mut bufs, &mut metas), Poll::Ready(Ok(2))));
        let data = vec![0u8; 8_972 * 10];
        s.try_send(&transmit(&data, Some(8_972))).unwrap();
        let st = counters.snapshot();
        assert_eq!((st.recv_calls, st.recv_messages, st.recv_datagrams), (1, 2, 11));
        assert_eq!(st.recv_bytes, 10 * 1_472 + 300);
        // A jumbo send of 10 packets is cut in two calls, every datagram counted once.
        assert_eq!((st.send_calls, st.send_datagrams, st.send_bytes), (2, 10, 89_720));
    }

    fn transmit(contents: &[u8], seg: Option<usize>) -> Transmit<'_> {
        Transmit { destination: "10.0.0.1:1".parse().unwrap(), ecn: None, contents, segment_size: seg, src_ip: None }
    }

    #[test]
    fn a_jumbo_offload_send_is_cut_into_whole_packets_under_the_limit() {
        // 10 packets of a 9,000-byte link's payload, the last one short.
        let data: Vec<u8> = (0..8_972 * 9 + 100).map(|i| i as u8).collect();
        let t = transmit(&data, Some(8_972));
        let p: Vec<Transmit> = parts(&t).collect();
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|x| x.contents.len() <= MAX_SEND));
        assert_eq!(p[0].contents.len(), 7 * 8_972, "whole packets");
        assert_eq!(p[0].segment_size, Some(8_972));
        assert_eq!(p[1].contents.len(), 2 * 8_972 + 100);
        let joined: Vec<u8> = p.iter().flat_map(|x| x.contents.iter().copied()).collect();
        assert!(joined == data, "every byte once, in order");
        // A single leftover packet goes without a segment size.
        let t = transmit(&data[..8_972 * 8], Some(8_972));
        let p: Vec<Transmit> = parts(&t).collect();
        assert_eq!((p.len(), p[1].contents.len(), p[1].segment_size), (2, 8_972, None));
    }
}
