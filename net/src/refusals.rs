//! Knowing at once that a peer's process is gone: ICMP port unreachable.
//!
//! A killed server sends no close, so a QUIC client only finds out when its idle timeout runs
//! out, or when a watchdog gives up on an answer (the cluster client's `node_answer_within`).
//! But when the process died and its host did not, the host answers the client's next packet
//! with ICMP port unreachable, within a round trip. quinn never sees it: its sockets are
//! unconnected, and the kernel drops ICMP errors for those unless `IP_RECVERR` is set.
//!
//! A watched socket has `IP_RECVERR` (`IPV6_RECVERR`) set; a task on the endpoint's runtime
//! wakes on the socket's error events only (an epoll instance of its own holds the socket with
//! an empty interest set, for which epoll still reports errors), drains the error queue and records each port unreachable
//! by the address the refused packet went to ([`Refusals`]). The task lives as long as the
//! socket: its [`Watch`] sits in the socket wrapper ([`crate::SplitSends`]) that quinn owns.
//! The kernel also reports the latest error once to the next receive or send on the socket:
//! quinn's Tokio socket passes over a failed receive, and a send that fails that way is lost
//! and resent by QUIC's loss recovery (the drain clears the error within the same wake-up).
//!
//! A refusal proves only that nothing listens on that port of that host now; the caller decides
//! what that means (the client closes its connection to that server: a dead node then costs a
//! round trip instead of a watchdog's bound). Linux rate-limits these answers per pair of hosts
//! (a burst of about six, then one a second): the first packets to a dead port are answered,
//! which is what a client needs. A forged ICMP error can close a connection as a forged TCP
//! reset can; an attacker who can forge them can also drop the packets.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// Port-unreachable errors seen on one socket, by the address the refused packet was sent to.
/// Cheap to clone.
#[derive(Clone, Default, Debug)]
pub struct Refusals {
    shared: Arc<Shared>,
}

#[derive(Default, Debug)]
struct Shared {
    /// When each address last refused a packet (one entry per peer this socket sent to).
    last: Mutex<HashMap<SocketAddr, Instant>>,
    changed: Notify,
    /// A task drains the socket's error queue.
    watching: AtomicBool,
}

/// The watching task of one socket: it ends when this is dropped (with the socket wrapper),
/// since a dropped sender wakes its receiver.
#[derive(Debug)]
pub(crate) struct Watch {
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Shared {
    fn record(&self, peer: SocketAddr) {
        let now = Instant::now();
        self.last.lock().unwrap_or_else(|p| p.into_inner()).insert(canonical(peer), now);
        self.changed.notify_waiters();
        tracing::debug!(%peer, "port unreachable: nothing listens there now");
    }
}

/// Addresses compare as the kernel reports them: an IPv4-mapped IPv6 address as its IPv4 one.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl Refusals {
    /// Whether `peer` refused a packet at or after `since`.
    pub fn refused_since(&self, peer: SocketAddr, since: Instant) -> bool {
        let last = self.shared.last.lock().unwrap_or_else(|p| p.into_inner());
        last.get(&canonical(peer)).is_some_and(|&t| t >= since)
    }

    /// Wait until `peer` refuses a packet at or after `since` (never, on a socket that is not
    /// watched).
    pub async fn refused(&self, peer: SocketAddr, since: Instant) {
        loop {
            let changed = self.shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.refused_since(peer, since) {
                return;
            }
            changed.await;
        }
    }

    /// Whether a task watches the socket (on Linux, where `IP_RECVERR` could be set, while the
    /// socket is open).
    pub fn watched(&self) -> bool {
        self.shared.watching.load(Ordering::Relaxed)
    }

    /// Watch `sock` (before it is handed to quinn): set `IP_RECVERR`, and start the task that
    /// drains its error queue on `runtime`; the task ends when the [`Watch`] is dropped, which
    /// belongs with the socket. Where watching is not possible the refusals record nothing and
    /// say so ([`Refusals::watched`]).
    pub(crate) fn watch(sock: &std::net::UdpSocket, runtime: &dyn quinn::Runtime) -> (Refusals, Option<Watch>) {
        let r = Refusals::default();
        #[cfg(target_os = "linux")]
        match linux::start(sock, runtime, r.shared.clone()) {
            Ok(w) => return (r, Some(w)),
            Err(e) => tracing::debug!(error = %e, "ICMP errors not watched on this socket"),
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (sock, runtime);
        (r, None)
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use super::{Shared, Watch};
    use std::io;
    use std::mem::{size_of, MaybeUninit};
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    fn set_int(fd: RawFd, level: libc::c_int, opt: libc::c_int, on: bool) -> io::Result<()> {
        let val = libc::c_int::from(on);
        // SAFETY: a valid socket descriptor, and a c_int option value of the size passed.
        let rc = unsafe {
            libc::setsockopt(fd, level, opt, (&val as *const libc::c_int).cast(), size_of::<libc::c_int>() as _)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Set or clear the error-queue options of the socket behind `fd`.
    fn recv_errors(fd: RawFd, v6: bool, on: bool) -> io::Result<()> {
        if v6 {
            set_int(fd, libc::SOL_IPV6, libc::IPV6_RECVERR, on)?;
            // A dual-stack socket's IPv4 peers report through the IPv4 option; an IPv6-only
            // socket refuses it, which is fine.
            let _ = set_int(fd, libc::SOL_IP, libc::IP_RECVERR, on);
            Ok(())
        } else {
            set_int(fd, libc::SOL_IP, libc::IP_RECVERR, on)
        }
    }

    /// An epoll instance that holds `fd` for its errors only: an interest set of nothing still
    /// reports `EPOLLERR`, so the instance turns readable on an error and never on a packet.
    /// (Registering the socket itself with the reactor would wake it on every received burst.)
    fn errors_only(fd: RawFd) -> io::Result<OwnedFd> {
        // SAFETY: plain epoll_create1; the descriptor returned is ours to own.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ep` is a fresh descriptor that nothing else owns.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: valid epoll and socket descriptors, and an event the call only reads.
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ep)
    }

    /// Take what the inner epoll instance reports, so that it is readable again only on the
    /// next error (its entry is level-triggered: once the queue is drained nothing is left).
    fn consume(ep: RawFd) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: a valid epoll descriptor and room for the events asked for; no wait.
        unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as libc::c_int, 0) };
    }

    pub(super) fn start(
        sock: &std::net::UdpSocket,
        runtime: &dyn quinn::Runtime,
        shared: Arc<Shared>,
    ) -> io::Result<Watch> {
        let v6 = sock.local_addr()?.is_ipv6();
        // The task reads a second descriptor of the same socket; quinn keeps the first.
        let dup: OwnedFd = sock.try_clone()?.into();
        let ep = errors_only(dup.as_raw_fd())?;
        recv_errors(dup.as_raw_fd(), v6, true)?;
        shared.watching.store(true, Ordering::Relaxed);
        let (tx, mut stop) = tokio::sync::oneshot::channel::<()>();
        runtime.spawn(Box::pin(async move {
            let fd = dup.as_raw_fd();
            // Nobody drains the queue any more: stop filling it (it is charged to the socket's
            // receive buffer), and say so.
            let give_up = |e: io::Error| {
                tracing::debug!(error = %e, "ICMP errors no longer watched on this socket");
                shared.watching.store(false, Ordering::Relaxed);
                let _ = recv_errors(fd, v6, false);
            };
            // Registered from inside the task: on the endpoint's runtime, whose reactor the
            // quinn tasks also use.
            // SAFETY: the descriptor is owned by the `OwnedFd` the AsyncFd holds: it stays open,
            // and the same, until the AsyncFd is dropped.
            let afd = match unsafe { AsyncFd::register_with_interest(ep, Interest::READABLE) } {
                Ok(afd) => afd,
                Err(e) => return give_up(e.into_parts().1),
            };
            // Errors queued before the registration would raise no edge: look once.
            drain(fd, &shared);
            loop {
                tokio::select! {
                    _ = &mut stop => {
                        shared.watching.store(false, Ordering::Relaxed);
                        return;
                    }
                    ready = afd.readable() => match ready {
                        Ok(mut guard) => {
                            drain(fd, &shared);
                            consume(afd.get_ref().as_raw_fd());
                            guard.clear_ready();
                        }
                        Err(e) => return give_up(e),
                    },
                }
            }
        }));
        Ok(Watch { _stop: tx })
    }

    /// Read the socket's error queue to its end; record each port unreachable.
    fn drain(fd: RawFd, shared: &Shared) {
        // Bounded: the queue is charged to the socket's receive buffer, so it cannot grow
        // without bound, and a pass takes what is there now.
        for _ in 0..1024 {
            let mut name = MaybeUninit::<libc::sockaddr_storage>::zeroed();
            // Room for the extended error and the offender's address, aligned for cmsghdr.
            let mut control = [0u64; 32];
            let mut data = [0u8; 64];
            let mut iov = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
            // SAFETY: an all-zero msghdr is a valid empty header; its pointers are set below.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_name = name.as_mut_ptr().cast();
            msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = size_of::<[u64; 32]>() as _;
            // SAFETY: every buffer msg points to lives, with the length given, for the call.
            let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
            if n < 0 {
                return; // EAGAIN: the queue is empty
            }
            // SAFETY: the kernel filled `msg_namelen` bytes of the zeroed storage.
            let peer = unsafe { to_addr(name.as_ptr(), msg.msg_namelen) };
            if refused(&msg) {
                if let Some(peer) = peer {
                    shared.record(peer);
                }
            }
        }
    }

    /// Whether the message's extended error is a port unreachable.
    fn refused(msg: &libc::msghdr) -> bool {
        // SAFETY: `msg` came back from recvmsg with its control buffer filled to
        // `msg_controllen`; the CMSG macros stay inside it.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(msg);
            while !c.is_null() {
                let h = &*c;
                let ours = (h.cmsg_level == libc::SOL_IP && h.cmsg_type == libc::IP_RECVERR)
                    || (h.cmsg_level == libc::SOL_IPV6 && h.cmsg_type == libc::IPV6_RECVERR);
                let whole = h.cmsg_len as usize >= libc::CMSG_LEN(size_of::<libc::sock_extended_err>() as u32) as usize;
                if ours && whole {
                    let ee: libc::sock_extended_err = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                    if ee.ee_errno == libc::ECONNREFUSED as u32 {
                        return true;
                    }
                }
                c = libc::CMSG_NXTHDR(msg, c);
            }
        }
        false
    }

    /// The socket address in `len` bytes of `storage`.
    ///
    /// # Safety
    /// `storage` points to a `sockaddr_storage` whose first `len` bytes the kernel wrote.
    unsafe fn to_addr(storage: *const libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
        let len = len as usize;
        // SAFETY: (the caller's) every sockaddr starts with its family.
        match unsafe { (*storage).ss_family } as libc::c_int {
            libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
                // SAFETY: an AF_INET address of the full size.
                let a = unsafe { &*(storage as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
                // SAFETY: an AF_INET6 address of the full size.
                let a = unsafe { &*(storage as *const libc::sockaddr_in6) };
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(a.sin6_port), a.sin6_flowinfo, a.sin6_scope_id)))
            }
            _ => None,
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests;
