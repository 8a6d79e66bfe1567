//! The kernel's process events: which processes forked, exec'd, renamed themselves or exited,
//! pushed by the kernel as they happen through the proc connector (a netlink socket).
//!
//! Finding processes by name (`agent --comm`) used to mean reading every `/proc/PID/comm`
//! twice a second: on a quiet node as much CPU as the rest of the always-on agent. With these
//! events a name is read only for a process that just started, exec'd or renamed itself. The
//! kernel queues the events in the socket's receive buffer between reads; when that fills, it
//! drops them and says so (ENOBUFS), and the caller falls back to one full scan.
//!
//! Older kernels ask for CAP_NET_ADMIN to subscribe (recent ones let anyone listen): the agent
//! subscribes before it drops its capabilities, and reading needs none. The kernel sends these
//! events only to listeners in the initial network namespace; elsewhere the subscription is
//! not confirmed and the caller scans.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ProcEventsError {
    #[error("cannot open a proc connector socket: {0}")]
    Socket(io::Error),
    #[error("cannot subscribe to process events: {0}")]
    Subscribe(io::Error),
    #[error("the kernel did not confirm the process-events subscription within {0:?}")]
    NoAck(Duration),
}

/// One process event. Pids are thread ids, tgids process ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcEvent {
    /// A task was created: a process when `child_pid == child_tgid`, else a thread.
    Fork {
        parent_tgid: u32,
        child_pid: u32,
        child_tgid: u32,
    },
    /// Process `tgid` exec'd a new image.
    Exec { tgid: u32 },
    /// Thread `pid` of process `tgid` set its name (`prctl(PR_SET_NAME)`).
    Comm { pid: u32, tgid: u32 },
    /// Thread `pid` of process `tgid` exited: the process when `pid == tgid`.
    Exit { pid: u32, tgid: u32 },
}

/// A subscription to the kernel's process events. Dropping it unsubscribes.
pub struct ProcEvents {
    fd: OwnedFd,
    buf: Vec<u8>,
}

// From linux/netlink.h, linux/connector.h and linux/cn_proc.h.
const NETLINK_CONNECTOR: i32 = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const CN_MSG_LEN: usize = 20;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_CN_MCAST_IGNORE: u32 = 2;
const PROC_EVENT_NONE: u32 = 0;
const PROC_EVENT_FORK: u32 = 1;
const PROC_EVENT_EXEC: u32 = 2;
const PROC_EVENT_COMM: u32 = 0x200;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// `struct proc_event`: what, cpu, timestamp_ns, then the event's data.
const EVENT_DATA: usize = 16;

/// How much the kernel may queue between two reads: a few thousand events, the forks, execs
/// and exits of a busy build between two reads of the agent's loop. Only what is queued
/// uses memory.
const RECEIVE_BUFFER: i32 = 4 << 20;

/// How long [`ProcEvents::open`] waits for the kernel's reply to the subscription.
const ACK_WAIT: Duration = Duration::from_secs(2);

impl ProcEvents {
    /// Subscribes to every process event of the node.
    pub fn open() -> Result<Self, ProcEventsError> {
        // SAFETY: a plain socket(2) call; the descriptor is owned right after.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                NETLINK_CONNECTOR,
            )
        };
        if raw < 0 {
            return Err(ProcEventsError::Socket(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a descriptor this function just opened and owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // A larger buffer than the system's maximum needs CAP_NET_ADMIN; without it the
        // default one holds a few hundred events, and overflows are still detected.
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            if setsockopt_int(&fd, opt, RECEIVE_BUFFER).is_ok() {
                break;
            }
        }
        let mut addr = sockaddr_nl(CN_IDX_PROC);
        // SAFETY: `addr` is a valid sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw mut addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc != 0 {
            return Err(ProcEventsError::Socket(io::Error::last_os_error()));
        }
        let mut events = Self {
            fd,
            buf: vec![0; 64 << 10],
        };
        events
            .control(PROC_CN_MCAST_LISTEN)
            .map_err(ProcEventsError::Subscribe)?;
        events.await_ack()?;
        Ok(events)
    }

    /// Sends a listen or ignore request to the kernel.
    fn control(&self, op: u32) -> io::Result<()> {
        let mut msg = [0u8; NLMSG_HDRLEN + CN_MSG_LEN + 4];
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() } as u32;
        msg[12..16].copy_from_slice(&pid.to_ne_bytes());
        let cn = NLMSG_HDRLEN;
        msg[cn..cn + 4].copy_from_slice(&CN_IDX_PROC.to_ne_bytes());
        msg[cn + 4..cn + 8].copy_from_slice(&CN_VAL_PROC.to_ne_bytes());
        msg[cn + 16..cn + 18].copy_from_slice(&4u16.to_ne_bytes());
        msg[cn + CN_MSG_LEN..].copy_from_slice(&op.to_ne_bytes());
        let mut kernel = sockaddr_nl(0);
        // SAFETY: the buffer and the address are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw mut kernel).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits for the kernel's reply to the subscription: an event with nothing but an error
    /// code (EPERM without CAP_NET_ADMIN). Events that arrive first are dropped: a caller
    /// scans every process once after subscribing.
    fn await_ack(&mut self) -> Result<(), ProcEventsError> {
        let deadline = Instant::now() + ACK_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.wait(left) {
                return Err(ProcEventsError::NoAck(ACK_WAIT));
            }
            let n = match self.recv() {
                Ok(Some(n)) => n,
                Ok(None) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                Err(e) => return Err(ProcEventsError::Subscribe(e)),
            };
            for (what, data) in messages(&self.buf[..n]) {
                if what == PROC_EVENT_NONE {
                    let err = data.get(..4).map_or(0, |b| u32_at(b, 0));
                    return match err {
                        0 => Ok(()),
                        e => Err(ProcEventsError::Subscribe(io::Error::from_raw_os_error(
                            e as i32,
                        ))),
                    };
                }
            }
        }
    }

    /// Waits up to `timeout` for events to read; false when none came.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) > 0 }
    }

    /// One datagram into the buffer: its length, or None when nothing is queued.
    fn recv(&mut self) -> io::Result<Option<usize>> {
        // SAFETY: the buffer is valid for its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            Some(libc::EINTR) => Ok(Some(0)),
            _ => Err(e),
        }
    }

    /// Appends the events queued since the last call to `out`, without blocking. Returns
    /// false when the kernel dropped events because the buffer was full (or the socket
    /// failed): the caller must then look at every process again.
    pub fn drain(&mut self, out: &mut Vec<ProcEvent>) -> bool {
        let mut complete = true;
        loop {
            let n = match self.recv() {
                Ok(Some(n)) => n,
                Ok(None) => return complete,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    complete = false;
                    continue;
                }
                Err(_) => return false,
            };
            out.extend(messages(&self.buf[..n]).filter_map(|(w, d)| parse(w, d)));
        }
    }
}

impl Drop for ProcEvents {
    /// The kernel counts listeners and builds events while any is left: say goodbye (an
    /// older kernel may refuse it once the agent has dropped CAP_NET_ADMIN; it is the
    /// agent's exit then, and nothing else can be done).
    fn drop(&mut self) {
        let _ = self.control(PROC_CN_MCAST_IGNORE);
    }
}

fn sockaddr_nl(groups: u32) -> libc::sockaddr_nl {
    // SAFETY: sockaddr_nl is plain data, valid all zeros.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    addr.nl_groups = groups;
    addr
}

fn setsockopt_int(fd: &OwnedFd, opt: i32, value: i32) -> io::Result<()> {
    // SAFETY: the value is a valid int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw const value).cast(),
            std::mem::size_of::<i32>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_ne_bytes(s.try_into().expect("4 bytes")))
}

/// The proc connector messages of one datagram: each event's kind and data.
fn messages(mut buf: &[u8]) -> impl Iterator<Item = (u32, &[u8])> {
    std::iter::from_fn(move || {
        loop {
            if buf.len() < NLMSG_HDRLEN {
                return None;
            }
            let len = u32_at(buf, 0) as usize;
            let kind = u16::from_ne_bytes([buf[4], buf[5]]);
            if len < NLMSG_HDRLEN || len > buf.len() {
                return None;
            }
            let msg = &buf[NLMSG_HDRLEN..len];
            buf = &buf[((len + 3) & !3).min(buf.len())..];
            if kind == NLMSG_ERROR || msg.len() < CN_MSG_LEN + EVENT_DATA {
                continue;
            }
            if u32_at(msg, 0) != CN_IDX_PROC || u32_at(msg, 4) != CN_VAL_PROC {
                continue;
            }
            let event = &msg[CN_MSG_LEN..];
            return Some((u32_at(event, 0), &event[EVENT_DATA..]));
        }
    })
}

fn parse(what: u32, d: &[u8]) -> Option<ProcEvent> {
    let at = |i: usize| u32_at(d, i * 4);
    if d.len() < 8 {
        return None;
    }
    match what {
        PROC_EVENT_FORK if d.len() >= 16 => Some(ProcEvent::Fork {
            parent_tgid: at(1),
            child_pid: at(2),
            child_tgid: at(3),
        }),
        PROC_EVENT_EXEC => Some(ProcEvent::Exec { tgid: at(1) }),
        PROC_EVENT_COMM => Some(ProcEvent::Comm {
            pid: at(0),
            tgid: at(1),
        }),
        PROC_EVENT_EXIT => Some(ProcEvent::Exit {
            pid: at(0),
            tgid: at(1),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            skip_ledger::skip(
                "root",
                "subscribing to process events needs root (CAP_NET_ADMIN)",
            );
        }
        root
    }

    /// Reads events until `want` holds for one of them, for up to ten seconds (a busy
    /// machine's other processes send theirs too).
    fn wait_for(events: &mut ProcEvents, mut want: impl FnMut(&ProcEvent) -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while Instant::now() < deadline {
            events.wait(Duration::from_millis(100));
            got.clear();
            events.drain(&mut got);
            if got.iter().any(&mut want) {
                return true;
            }
        }
        false
    }

    #[test]
    fn a_child_forks_execs_and_exits_and_a_thread_renames_itself() {
        if !root() {
            return;
        }
        let mut events = ProcEvents::open().expect("subscribing as root");
        let me = std::process::id();
        let child = std::process::Command::new("/bin/sh")
            .args(["-c", "exec /bin/sleep 0.3"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut seen = (false, false);
        assert!(
            wait_for(&mut events, |e| {
                match *e {
                    ProcEvent::Fork {
                        parent_tgid,
                        child_pid,
                        child_tgid,
                    } if parent_tgid == me && child_pid == pid && child_tgid == pid => {
                        seen.0 = true
                    }
                    ProcEvent::Exec { tgid } if tgid == pid => seen.1 = true,
                    _ => {}
                }
                seen == (true, true)
            }),
            "fork and exec of pid {pid}: seen {seen:?}"
        );
        let mut child = child;
        child.wait().unwrap();
        assert!(
            wait_for(&mut events, |e| *e == ProcEvent::Exit { pid, tgid: pid }),
            "exit of pid {pid}"
        );
        // A named thread sets its comm: an event of this process, for the thread.
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::Builder::new()
            .name("pe-renamed".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let _ = tx.send(unsafe { libc::gettid() } as u32);
            })
            .unwrap();
        let tid = rx.recv().unwrap();
        t.join().unwrap();
        assert!(
            wait_for(&mut events, |e| *e
                == ProcEvent::Comm { pid: tid, tgid: me }),
            "comm of thread {tid}"
        );
    }

    #[test]
    fn messages_skip_other_connectors_and_truncated_ones() {
        let mut dgram = Vec::new();
        let mut push = |idx: u32, what: u32, data: &[u32]| {
            let len = NLMSG_HDRLEN + CN_MSG_LEN + EVENT_DATA + 4 * data.len();
            let mut m = vec![0u8; len];
            m[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
            m[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
            m[16..20].copy_from_slice(&idx.to_ne_bytes());
            m[20..24].copy_from_slice(&CN_VAL_PROC.to_ne_bytes());
            m[36..40].copy_from_slice(&what.to_ne_bytes());
            for (i, v) in data.iter().enumerate() {
                let at = NLMSG_HDRLEN + CN_MSG_LEN + EVENT_DATA + 4 * i;
                m[at..at + 4].copy_from_slice(&v.to_ne_bytes());
            }
            dgram.extend(m);
        };
        push(CN_IDX_PROC, PROC_EVENT_EXEC, &[7, 7]);
        push(9, PROC_EVENT_EXEC, &[8, 8]);
        push(CN_IDX_PROC, PROC_EVENT_EXIT, &[5, 4, 0, 17, 1, 1]);
        push(CN_IDX_PROC, PROC_EVENT_FORK, &[1, 1, 3, 3]);
        dgram.extend([1, 2, 3]);
        let got: Vec<_> = messages(&dgram).filter_map(|(w, d)| parse(w, d)).collect();
        assert_eq!(
            got,
            [
                ProcEvent::Exec { tgid: 7 },
                ProcEvent::Exit { pid: 5, tgid: 4 },
                ProcEvent::Fork {
                    parent_tgid: 1,
                    child_pid: 3,
                    child_tgid: 3
                }
            ]
        );
    }
}
