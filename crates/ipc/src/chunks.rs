//! Memory of expandable segments across processes: the producer's chunks named by file
//! descriptors ([`ChunkHandle`], PyTorch's handle type `'e'`), and how the consumer obtains those
//! descriptors.
//!
//! An expandable segment is a reserved address range with physical chunks mapped into it
//! (`cuMemCreate` / `cuMemMap`); `cuIpcGetMemHandle` does not work on such memory. Instead each
//! chunk under the shared block is exported as a POSIX file descriptor
//! (`cuMemExportToShareableHandle`) and the handle carries the producer's pid and the descriptor
//! numbers. The consumer takes copies of those descriptors from the producer, imports the chunks
//! (`cuMemImportFromShareableHandle`) and maps them into a range of its own that covers only the
//! shared chunks (PyTorch reserves 9/8 of the device's memory per imported segment, and runs out of
//! address space after about 1 450 imports on an 80 GB device).
//!
//! # Getting the descriptors: two ways
//!
//! 1. [`FdRoute::PidfdGetfd`]: `pidfd_open(pid)` and `pidfd_getfd` copy each descriptor straight
//!    out of the producer, as PyTorch does. Linux 5.6 or later, and ptrace permission over the
//!    producer (same user and `kernel.yama.ptrace_scope` 0, or `CAP_SYS_PTRACE`); containers often
//!    lack it, where PyTorch fails.
//! 2. [`FdRoute::Socket`]: a tensormem producer also answers on a Unix socket in the abstract
//!    namespace, `tensormem-ipc-fds.<pid>`, and sends the descriptors with `SCM_RIGHTS`. It hands
//!    out only descriptors it exported for a share (checked against the file they name when they
//!    were exported), and only to processes of its own user (or root). A PyTorch producer has no
//!    such socket.
//!
//! [`ChunkFdRoutes`] chooses which ways a consumer tries ([`ConsumerConfig::chunk_fds`]); the way
//! taken is in [`ReceivedMemory::fd_route`] and a `tracing` event.
//!
//! Batches and weights publications carry the same handles, one per range of contiguous chunks
//! (see [`crate::batch#ranges-of-expandable-segments`]), and their consumers take the descriptors
//! the same ways.
//!
//! # Who answers on the socket
//!
//! The handle is PyTorch's wire format: the producer's pid and its descriptor numbers, nothing
//! else, so there is no room in it for a secret (a socket path with a random part, a token) that
//! only the producer and its consumers would know. The rendezvous is therefore a name derived from
//! the pid, and any local process, of any user, can bind `@tensormem-ipc-fds.<pid>` before the
//! producer does (abstract names have no permissions). The consumer guards against that:
//!
//! - **It never takes descriptors from another process.** Right after connecting it asks the
//!   kernel who listens (`SO_PEERCRED`, which the listener cannot forge: the kernel records the
//!   process that called `listen`), and refuses, before sending a request, a listener whose pid is
//!   not the handle's or whose user is neither this process's effective user nor root
//!   ([`Error::ImpostorPeer`], and a `warn` event of target `tensormem_ipc`). A squatter can thus
//!   make the socket route fail, a denial that is reported as such, but never hand the consumer
//!   memory of its own to map in place of the producer's.
//! - **It never waits without bound.** The connection is made without blocking and retried while
//!   the listener's backlog is full (`EAGAIN`), until a deadline; each answer has the same
//!   deadline ([`ConsumerConfig::chunk_fd_timeout`], [`DEFAULT_CHUNK_FD_TIMEOUT`] by default). A
//!   squatter that binds the name and never accepts costs the consumer that much time and
//!   [`Error::ChunkSocketTimedOut`], never a hang.
//!
//! What stays trusted is the pid itself: a producer that died and whose pid was reused by a
//! process of the same user that also listens on the name would pass the check (as that process
//! would pass `pidfd_open` of the same pid). A producer in another pid namespace than the
//! consumer's (two containers sharing a network namespace but not their pids) is refused: its
//! pid in the handle is not the number this process sees.
//!
//! # PyTorch's wire format
//!
//! `[version 2]['e']` then a 24-byte header in native byte order (`pid: i32`, 4 bytes of padding,
//! `segment_size: u64`, `num_handles: u64`) then `num_handles` descriptors (`i32` each). tensormem
//! writes the padding as zeros, so the same chunks always give the same bytes (PyTorch leaves it
//! uninitialised, which defeats its own cache of opened handles keyed by those bytes).
//!
//! [`ConsumerConfig::chunk_fds`]: crate::ConsumerConfig::chunk_fds
//! [`ConsumerConfig::chunk_fd_timeout`]: crate::ConsumerConfig::chunk_fd_timeout
//! [`ReceivedMemory::fd_route`]: crate::ReceivedMemory::fd_route

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::error::{Error, Result};

/// The version byte PyTorch writes before a handle's type.
pub(crate) const TORCH_HANDLE_VERSION: u8 = 2;
/// The type byte of an expandable segment's handle (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`).
pub(crate) const TORCH_EXPANDABLE: u8 = b'e';
/// PyTorch's `ShareHeader`: pid, padding, segment size, number of handles.
const HEADER_LEN: usize = 24;
/// Bytes of a fabric handle (`CUmemFabricHandle`), what PyTorch writes per chunk instead of a
/// descriptor on systems with multi-node NVLink.
const FABRIC_HANDLE_LEN: usize = 64;
/// Most chunks one handle may name: 2^20 chunks of 2 MiB is 2 TiB, more than any device has.
pub const MAX_CHUNKS: usize = 1 << 20;
/// Descriptors per `SCM_RIGHTS` message (the kernel allows 253).
const FDS_PER_MESSAGE: usize = 128;
const REQUEST_MAGIC: &[u8; 4] = b"TMFD";
/// How long a consumer waits by default for a producer's descriptor socket to take its
/// connection, and then for each answer (see the [module docs](self#who-answers-on-the-socket)).
pub const DEFAULT_CHUNK_FD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the producer's socket waits for a consumer's next request or for room to answer.
const SERVER_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest pause between two tries to connect to a socket whose backlog is full.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_millis(50);

/// The physical chunks of an expandable segment under a shared block, as the producer exported
/// them (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunkHandle {
    /// The producer's process id.
    pub pid: u32,
    /// The size of each chunk in bytes (2 MiB in the small pool, 20 MiB in the large one).
    pub chunk_size: u64,
    /// The producer's descriptor of each chunk, in address order.
    pub fds: Vec<i32>,
}

/// Every chunk size is a multiple of this (2 MiB: the mapping granularity of current devices,
/// and the small pool's chunk size).
const CHUNK_GRANULE: u64 = 2 << 20;

impl ChunkHandle {
    /// The bytes of the extent the chunks cover (saturating: a handle whose extent overflows is
    /// refused wherever one is read or opened).
    #[must_use]
    pub fn extent(&self) -> u64 {
        self.chunk_size.saturating_mul(self.fds.len() as u64)
    }

    /// What is wrong with this handle as memory to import, if anything: a chunk count outside 1
    /// to [`MAX_CHUNKS`], a chunk size that is not a positive multiple of 2 MiB, an extent past
    /// 2^64 bytes, or a negative descriptor. Every wire form that carries chunks (PyTorch's tuple,
    /// [`IpcHandle`](crate::IpcHandle), batches) checks it.
    pub(crate) fn problem(&self) -> Option<String> {
        let count = self.fds.len();
        if count == 0 || count > MAX_CHUNKS {
            return Some(format!("{count} chunks (1 to {MAX_CHUNKS} expected)"));
        }
        if self.chunk_size == 0 || !self.chunk_size.is_multiple_of(CHUNK_GRANULE) {
            return Some(format!(
                "chunk size {} is not a positive multiple of 2 MiB",
                self.chunk_size
            ));
        }
        if self.chunk_size.checked_mul(count as u64).is_none() {
            return Some(format!(
                "{count} chunks of {} bytes cover more than 2^64 bytes",
                self.chunk_size
            ));
        }
        if let Some(fd) = self.fds.iter().find(|&&fd| fd < 0) {
            return Some(format!("descriptor {fd} is negative"));
        }
        None
    }

    /// PyTorch's handle bytes (see the [module docs](self)): what `_share_cuda_` puts in its
    /// tuple for memory of an expandable segment.
    #[must_use]
    pub fn to_torch(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + HEADER_LEN + 4 * self.fds.len());
        out.push(TORCH_HANDLE_VERSION);
        out.push(TORCH_EXPANDABLE);
        out.extend_from_slice(&(self.pid as i32).to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.chunk_size.to_ne_bytes());
        out.extend_from_slice(&(self.fds.len() as u64).to_ne_bytes());
        for fd in &self.fds {
            out.extend_from_slice(&fd.to_ne_bytes());
        }
        out
    }

    /// Reads PyTorch's handle of expandable-segment memory (version byte, `'e'`, header,
    /// descriptors); the padding is ignored.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTuple`] for another type byte, a length that does not match the header,
    /// fabric handles (multi-node NVLink systems, which tensormem does not import), a chunk size
    /// that is 0 or not a multiple of 2 MiB, no chunks or more than [`MAX_CHUNKS`], or a negative
    /// pid or descriptor.
    pub fn from_torch(bytes: &[u8]) -> Result<Self> {
        let bad = |problem: String| Error::InvalidTuple { problem };
        if bytes.len() < 2 + HEADER_LEN || bytes[1] != TORCH_EXPANDABLE {
            return Err(bad(format!(
                "{} bytes are not an expandable segment's handle (version byte, 'e', a {HEADER_LEN}-byte \
                 header, descriptors)",
                bytes.len()
            )));
        }
        let body = &bytes[2..];
        let u64_at = |i: usize| u64::from_ne_bytes(body[i..i + 8].try_into().expect("8 bytes"));
        let pid = i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
        let chunk_size = u64_at(8);
        let count = u64_at(16);
        let rest = body.len() - HEADER_LEN;
        if count == 0 || count > MAX_CHUNKS as u64 {
            return Err(bad(format!(
                "the handle names {count} chunks (1 to {MAX_CHUNKS} expected)"
            )));
        }
        let count = count as usize;
        if rest == count * FABRIC_HANDLE_LEN && rest != count * 4 {
            return Err(bad(
                "the handle carries fabric handles (PyTorch on a multi-node NVLink system); \
                 tensormem imports POSIX file descriptors only: share with \
                 expandable_segments:False there"
                    .into(),
            ));
        }
        if rest != count * 4 {
            return Err(bad(format!(
                "{rest} bytes of descriptors for {count} chunks (4 bytes each expected)"
            )));
        }
        let pid = u32::try_from(pid).map_err(|_| bad(format!("pid {pid} is negative")))?;
        let handle = Self {
            pid,
            chunk_size,
            fds: body[HEADER_LEN..]
                .chunks_exact(4)
                .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
                .collect(),
        };
        match handle.problem() {
            Some(problem) => Err(bad(problem)),
            None => Ok(handle),
        }
    }
}

/// How a consumer obtained a producer's chunk descriptors (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FdRoute {
    /// Copied with `pidfd_getfd`, as PyTorch does.
    PidfdGetfd,
    /// Received over the producer's Unix socket (`SCM_RIGHTS`).
    Socket,
}

/// Which ways a consumer tries to obtain chunk descriptors (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ChunkFdRoutes {
    /// `pidfd_getfd` first; the producer's socket where that is not permitted or not supported
    /// (the default).
    #[default]
    Auto,
    /// Only `pidfd_getfd` (what PyTorch does).
    PidfdOnly,
    /// Only the producer's socket (needs a tensormem producer; no ptrace permission involved).
    SocketOnly,
}

impl ChunkHandle {
    /// Copies of the producer's descriptors, taken the ways `routes` allows (see the
    /// [module docs](self)), and the way that worked: what a consumer imports the chunks from.
    /// Waits at most [`DEFAULT_CHUNK_FD_TIMEOUT`] for the producer's socket (see
    /// [`take_descriptors_within`](Self::take_descriptors_within)).
    ///
    /// # Errors
    ///
    /// As [`take_descriptors_within`](Self::take_descriptors_within).
    pub fn take_descriptors(&self, routes: ChunkFdRoutes) -> Result<(Vec<OwnedFd>, FdRoute)> {
        self.take_descriptors_within(routes, DEFAULT_CHUNK_FD_TIMEOUT)
    }

    /// [`take_descriptors`](Self::take_descriptors), waiting at most `timeout` for the producer's
    /// socket to take the connection, and as long again for each of its answers (see the
    /// [module docs](self#who-answers-on-the-socket)); `pidfd_getfd` does not wait.
    ///
    /// # Errors
    ///
    /// [`Error::ImpostorPeer`] when another process than the producer listens on its socket's
    /// name; [`Error::ChunkSocketTimedOut`] when the socket did not take the connection or answer
    /// within `timeout`; [`Error::ChunkDescriptors`] for everything else, saying what each way
    /// answered and what to do. Nothing is taken from the socket in any of these cases.
    pub fn take_descriptors_within(
        &self,
        routes: ChunkFdRoutes,
        timeout: Duration,
    ) -> Result<(Vec<OwnedFd>, FdRoute)> {
        let fail = |problem: String| Error::ChunkDescriptors {
            pid: self.pid,
            problem,
        };
        let pidfd_error = match routes {
            ChunkFdRoutes::SocketOnly => None,
            ChunkFdRoutes::Auto | ChunkFdRoutes::PidfdOnly => match via_pidfd(self) {
                Ok(fds) => return Ok((fds, FdRoute::PidfdGetfd)),
                Err(errno) => Some(errno),
            },
        };
        let denied = |e: Errno| matches!(e, Errno::PERM | Errno::ACCESS | Errno::NOSYS);
        match (routes, pidfd_error) {
            (ChunkFdRoutes::PidfdOnly, Some(e)) => Err(fail(pidfd_problem(e))),
            (ChunkFdRoutes::Auto, Some(e)) if !denied(e) => Err(fail(pidfd_problem(e))),
            _ => {
                let pidfd = pidfd_error.map(pidfd_problem);
                match via_socket(self, timeout) {
                    Ok(fds) => Ok((fds, FdRoute::Socket)),
                    Err(SocketFailure::Problem(problem)) => Err(fail(match pidfd {
                        Some(pidfd) => format!("{pidfd}; and {problem}"),
                        None => problem,
                    })),
                    Err(SocketFailure::TimedOut { waiting_for }) => {
                        Err(Error::ChunkSocketTimedOut {
                            pid: self.pid,
                            socket: socket_name(self.pid),
                            waiting_for,
                            timeout,
                            pidfd,
                        })
                    }
                    Err(SocketFailure::Impostor { peer_pid, peer_uid }) => {
                        tracing::warn!(
                            target: "tensormem_ipc",
                            pid = self.pid,
                            peer_pid,
                            peer_uid,
                            socket = %socket_name(self.pid),
                            "refused the descriptors of another process than the producer \
                             listening on its socket's name"
                        );
                        Err(Error::ImpostorPeer {
                            pid: self.pid,
                            socket: socket_name(self.pid),
                            peer_pid,
                            peer_uid,
                            pidfd,
                        })
                    }
                }
            }
        }
    }
}

fn pidfd_problem(e: Errno) -> String {
    match e {
        Errno::PERM | Errno::ACCESS => format!(
            "pidfd_getfd was refused ({e}): this process may not ptrace the producer (another \
             user, kernel.yama.ptrace_scope above 0 and not its parent, or a container without \
             CAP_SYS_PTRACE)"
        ),
        Errno::NOSYS => {
            format!("the kernel has no pidfd_open/pidfd_getfd ({e}; Linux 5.6 or later needed)")
        }
        Errno::SRCH => format!("the producer process is gone ({e})"),
        Errno::BADF => format!(
            "a descriptor of the handle is not open in the producer ({e}): the memory was freed \
             or the handle is stale or forged"
        ),
        other => format!("pidfd_getfd failed ({other})"),
    }
}

fn via_pidfd(handle: &ChunkHandle) -> std::result::Result<Vec<OwnedFd>, Errno> {
    let pid = rustix::process::Pid::from_raw(handle.pid as i32).ok_or(Errno::SRCH)?;
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    handle
        .fds
        .iter()
        .map(|&fd| {
            rustix::process::pidfd_getfd(&pidfd, fd, rustix::process::PidfdGetfdFlags::empty())
        })
        .collect()
}

fn socket_name(pid: u32) -> String {
    format!("tensormem-ipc-fds.{pid}")
}

/// Why the socket route gave no descriptors.
#[derive(Debug)]
enum SocketFailure {
    /// No such socket, a refusal, a broken answer: said in [`Error::ChunkDescriptors`].
    Problem(String),
    /// The deadline passed (see [`Error::ChunkSocketTimedOut`]).
    TimedOut {
        /// What the consumer was waiting for.
        waiting_for: &'static str,
    },
    /// Another process than the producer listens on the name (see [`Error::ImpostorPeer`]).
    Impostor {
        /// The listener's pid as this process sees it (`None`: not visible here).
        peer_pid: Option<u32>,
        /// The listener's user.
        peer_uid: u32,
    },
}

/// Whether the listener the kernel reports (`peer_pid`, `peer_uid`) may hand out the descriptors
/// of `producer`'s handle to a process whose effective user is `me`: it must be that very process,
/// of this user or root.
fn is_producer(producer: u32, peer_pid: Option<u32>, peer_uid: u32, me: u32) -> bool {
    peer_pid == Some(producer) && (peer_uid == me || peer_uid == 0)
}

/// Connects to `name` in the abstract namespace within `deadline`: without blocking, trying again
/// (with a growing pause) while the listener's backlog is full.
fn connect_by(name: &str, deadline: Instant) -> std::result::Result<OwnedFd, SocketFailure> {
    let problem = |e: Errno| {
        SocketFailure::Problem(format!(
            "the producer answers on no descriptor socket (@{name}: {e}); a PyTorch producer has \
             none: let this process ptrace the producer, or share with expandable_segments:False"
        ))
    };
    let addr = SocketAddrUnix::new_abstract_name(name.as_bytes()).map_err(problem)?;
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .map_err(problem)?;
    let mut pause = Duration::from_millis(1);
    loop {
        match rustix::net::connect(&socket, &addr) {
            Ok(()) => return Ok(socket),
            Err(Errno::INTR) => {}
            // The listener's backlog is full: it is busy, or it does not accept at all.
            Err(Errno::AGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(SocketFailure::TimedOut {
                        waiting_for: "take the connection (its backlog stayed full)",
                    });
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(MAX_CONNECT_BACKOFF);
            }
            Err(e) => return Err(problem(e)),
        }
    }
}

fn via_socket(
    handle: &ChunkHandle,
    timeout: Duration,
) -> std::result::Result<Vec<OwnedFd>, SocketFailure> {
    // A zero timeout is refused by SO_RCVTIMEO (it means "no timeout" there).
    let timeout = timeout.max(Duration::from_millis(1));
    let name = socket_name(handle.pid);
    let socket = connect_by(&name, Instant::now() + timeout)?;
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            SocketFailure::TimedOut {
                waiting_for: "answer",
            }
        } else {
            SocketFailure::Problem(format!("the producer's descriptor socket @{name}: {e}"))
        }
    };
    // Who listens, in the kernel's words, before anything is asked or received.
    let cred = rustix::net::sockopt::socket_peercred(&socket).map_err(|e| io(e.into()))?;
    let peer_pid = u32::try_from(cred.pid.as_raw_pid()).ok();
    let peer_uid = cred.uid.as_raw();
    if !is_producer(
        handle.pid,
        peer_pid,
        peer_uid,
        rustix::process::geteuid().as_raw(),
    ) {
        return Err(SocketFailure::Impostor { peer_pid, peer_uid });
    }
    rustix::io::ioctl_fionbio(&socket, false).map_err(|e| io(e.into()))?;
    let mut stream = UnixStream::from(socket);
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut out = Vec::with_capacity(handle.fds.len());
    for group in handle.fds.chunks(FDS_PER_MESSAGE) {
        let mut request = Vec::with_capacity(8 + 4 * group.len());
        request.extend_from_slice(REQUEST_MAGIC);
        request.extend_from_slice(&(group.len() as u32).to_le_bytes());
        for fd in group {
            request.extend_from_slice(&fd.to_le_bytes());
        }
        stream.write_all(&request).map_err(io)?;
        let (status, fds) = receive_reply(&stream).map_err(|e| io(e.into()))?;
        if status != 0 {
            return Err(SocketFailure::Problem(format!(
                "the producer refused to hand out descriptors {group:?} ({}): they are not \
                 exported for a share (freed memory, a stale or forged handle)",
                Errno::from_raw_os_error(status as i32)
            )));
        }
        if fds.len() != group.len() {
            return Err(SocketFailure::Problem(format!(
                "the producer sent {} descriptors for {} asked",
                fds.len(),
                group.len()
            )));
        }
        out.extend(fds);
    }
    Ok(out)
}

fn receive_reply(stream: &UnixStream) -> std::result::Result<(u32, Vec<OwnedFd>), Errno> {
    let mut reply = [0u8; 8];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut reply)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if got.bytes != reply.len() {
        return Err(Errno::PROTO);
    }
    let status = u32::from_le_bytes(reply[..4].try_into().expect("4 bytes"));
    Ok((status, fds))
}

/// The descriptors this process exported for shares, by number, with the file each named then
/// (device and inode), and the socket serving them.
struct Exported {
    fds: Mutex<HashMap<RawFd, (u64, u64)>>,
    listening: OnceLock<bool>,
}

fn exported() -> &'static Exported {
    static EXPORTED: OnceLock<Exported> = OnceLock::new();
    EXPORTED.get_or_init(|| Exported {
        fds: Mutex::new(HashMap::new()),
        listening: OnceLock::new(),
    })
}

fn identity(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    let stat = rustix::fs::fstat(fd).ok()?;
    Some((stat.st_dev, stat.st_ino))
}

/// Records `fds` (this process's, open) as exported for a share, so that this process's
/// descriptor socket may hand them out to consumers that cannot use `pidfd_getfd`, and starts that
/// socket on first use. [`IpcProducer`](crate::IpcProducer) calls it for every share of chunks; call
/// it when sharing a [`ChunkHandle`] built another way. The descriptors stay owned by their
/// exporter (the allocator), which keeps them open while their chunks are mapped.
pub fn offer(fds: &[RawFd]) {
    let exported = exported();
    {
        let mut table = exported.fds.lock();
        for &fd in fds {
            // SAFETY: the allocator keeps each exported descriptor open while its chunk is mapped,
            // which outlasts this call (the block under the share is allocated).
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            if let Some(id) = identity(borrowed) {
                table.insert(fd, id);
            }
        }
    }
    exported.listening.get_or_init(start_server);
}

fn start_server() -> bool {
    let name = socket_name(std::process::id());
    let listener = SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|addr| UnixListener::bind_addr(&addr));
    let listener = match listener {
        Ok(listener) => listener,
        Err(err) => {
            tracing::warn!(target: "tensormem_ipc", %err, socket = %name,
                "no descriptor socket for expandable-segment shares: consumers need pidfd_getfd");
            return false;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("tensormem-ipc-fds".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => serve(stream),
                    Err(err) => {
                        tracing::warn!(target: "tensormem_ipc", %err, "descriptor socket: accept failed");
                    }
                }
            }
        });
    match spawned {
        Ok(_) => {
            tracing::debug!(target: "tensormem_ipc", socket = %name, "serving chunk descriptors");
            true
        }
        Err(err) => {
            tracing::warn!(target: "tensormem_ipc", %err, "could not start the descriptor socket's thread");
            false
        }
    }
}

/// Answers one consumer's requests until it hangs up or misbehaves.
fn serve(mut stream: UnixStream) {
    let allowed = rustix::net::sockopt::socket_peercred(&stream).is_ok_and(|cred| {
        let me = rustix::process::geteuid();
        cred.uid == me || cred.uid.is_root()
    });
    let _ = stream.set_read_timeout(Some(SERVER_TIMEOUT));
    let _ = stream.set_write_timeout(Some(SERVER_TIMEOUT));
    loop {
        let mut head = [0u8; 8];
        if stream.read_exact(&mut head).is_err() || &head[..4] != REQUEST_MAGIC {
            return;
        }
        let count = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        if count == 0 || count > FDS_PER_MESSAGE {
            return;
        }
        let mut body = vec![0u8; 4 * count];
        if stream.read_exact(&mut body).is_err() {
            return;
        }
        let wanted: Vec<RawFd> = body
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let fds = if allowed {
            checked(&wanted)
        } else {
            Err(Errno::PERM)
        };
        let (status, fds) = match fds {
            Ok(fds) => (0u32, fds),
            Err(e) => (e.raw_os_error() as u32, Vec::new()),
        };
        if send_reply(&stream, status, &fds).is_err() {
            return;
        }
    }
}

/// Each wanted descriptor, if it is one this process exported and still names the same file.
fn checked(wanted: &[RawFd]) -> std::result::Result<Vec<RawFd>, Errno> {
    let table = exported().fds.lock();
    wanted
        .iter()
        .map(|&fd| {
            let expected = table.get(&fd).ok_or(Errno::BADF)?;
            // SAFETY: only fstat-ed. Descriptors are numbers to the kernel: one closed meanwhile
            // makes fstat fail (EBADF), one reused for another file fails the identity check.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            (identity(borrowed) == Some(*expected))
                .then_some(fd)
                .ok_or(Errno::BADF)
        })
        .collect()
}

fn send_reply(stream: &UnixStream, status: u32, fds: &[RawFd]) -> std::result::Result<(), Errno> {
    let mut reply = [0u8; 8];
    reply[..4].copy_from_slice(&status.to_le_bytes());
    reply[4..].copy_from_slice(&(fds.len() as u32).to_le_bytes());
    // SAFETY: the descriptors were checked just before (exported by this process, naming the file
    // they named then) and are only passed to sendmsg, which fails with EBADF for one closed
    // meanwhile; the allocator keeps them open while the shared block is allocated.
    let borrowed: Vec<BorrowedFd<'_>> = fds
        .iter()
        .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
        .collect();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !borrowed.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
        return Err(Errno::NOBUFS);
    }
    let sent = rustix::net::sendmsg(
        stream.as_fd(),
        &[IoSlice::new(&reply)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent == reply.len() {
        Ok(())
    } else {
        Err(Errno::PROTO)
    }
}

/// Whether `fd` of this process is open (for tests of the exporter's descriptor lifetimes).
#[cfg(test)]
fn is_open(fd: RawFd) -> bool {
    // SAFETY: only asks the kernel about the number; nothing is read or closed through it.
    rustix::io::fcntl_getfd(unsafe { BorrowedFd::borrow_raw(fd) }).is_ok()
}

#[cfg(test)]
mod tests;
