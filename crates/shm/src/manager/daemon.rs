//! The daemon's side: one process per runtime directory that holds the names of its clients and
//! unlinks the names of clients that died.
//!
//! Lifecycle:
//!
//! 1. Take `flock(LOCK_EX | LOCK_NB)` on `manager.lock`. If another process holds it, wait until
//!    that process answers on the socket (it is starting) and report
//!    [`Startup::AlreadyRunning`]; racing starts thus leave exactly one daemon.
//! 2. Remove a stale socket (the lock proves nobody serves it), bind, `chmod 0600`, report
//!    [`Startup::Listening`].
//! 3. Accept connections; each gets a thread that reads requests until the connection closes.
//!    The kernel closes a dead client's socket, `kill -9` included, so end of stream is the
//!    death notice: the client's holds are dropped and names nobody else holds are unlinked.
//! 4. When no client has been connected for the quiet period, remove the socket first (new
//!    clients then start a fresh daemon), stop listening, and return; the lock goes with the
//!    process.

use std::fs;
use std::io::{self, BufReader, BufWriter, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};

use crate::name::ShmName;

use super::config::{check_socket_path, prepare_dir, ManagerConfig};
use super::error::{ManagerError, ManagerResult};
use super::protocol::{Reply, Request, PROTOCOL_VERSION};
use super::registry::{ClientId, Registry, Released};

/// How long a starting daemon waits for the lock holder to answer before giving up.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// What [`serve`] found when it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Startup {
    /// This process is the daemon and listens now.
    Listening {
        /// Its process id.
        pid: u32,
    },
    /// Another daemon already serves this directory; `serve` returns without serving.
    AlreadyRunning,
}

/// State shared by the accept loop and the client threads.
#[derive(Debug)]
struct Shared {
    registry: Registry,
    /// Connections accepted and not yet closed.
    clients: usize,
    /// When `clients` last dropped to zero (or the daemon started).
    quiet_since: Instant,
    next_client: ClientId,
}

type SharedState = Arc<Mutex<Shared>>;

fn lock(shared: &SharedState) -> MutexGuard<'_, Shared> {
    // A client thread that panicked leaves consistent state behind (every mutation is a single
    // call on the registry), so a poisoned lock is still usable.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs the daemon for `config`'s directory until it has had no clients for the quiet period.
///
/// `on_startup` is called once, as soon as it is known whether this process serves (after
/// the socket listens) or another daemon does; the launcher protocol uses it.
///
/// This is the daemon loop itself, public for programs that host the manager in a process they
/// supervise (a job launcher that outlives its workers, say), on a thread of their choice:
/// clients of the same directory reach it as they would a started daemon. The names it tracks
/// are only as safe as the hosting process: if that process is killed, they stay until
/// `tensormem shm gc`. Events go to whatever `tracing` subscriber the host installed.
///
/// # Errors
///
/// An unsafe or unusable runtime directory, a socket that cannot be bound, or a lock holder that
/// never answers.
pub fn serve(config: &ManagerConfig, on_startup: impl FnOnce(Startup)) -> ManagerResult<()> {
    prepare_dir(config.dir())?;
    let socket_path = config.socket_path();
    check_socket_path(&socket_path)?;
    let Some(lock_fd) = acquire_lock(config)? else {
        tracing::debug!(socket = %socket_path.display(), "shm manager already running");
        on_startup(Startup::AlreadyRunning);
        return Ok(());
    };
    match fs::remove_file(&socket_path) {
        Ok(()) => tracing::info!(socket = %socket_path.display(), "removed stale socket"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(ManagerError::io(
                format!("cannot remove stale socket {}", socket_path.display()),
                e,
            ))
        }
    }
    let bind_error =
        |e: io::Error| ManagerError::io(format!("cannot listen on {}", socket_path.display()), e);
    let listener = UnixListener::bind(&socket_path).map_err(bind_error)?;
    fs::set_permissions(&socket_path, fs::Permissions::from_mode(0o600)).map_err(bind_error)?;
    let quiet = config.quiet_period();
    // accept() wakes up at least this often to check the quiet period (SO_RCVTIMEO applies
    // to accept on Unix sockets).
    let tick = (quiet / 4).clamp(Duration::from_millis(10), Duration::from_millis(250));
    sockopt::set_socket_timeout(&listener, Timeout::Recv, Some(tick))
        .map_err(|e| bind_error(e.into()))?;

    let pid = rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .unsigned_abs();
    tracing::info!(
        pid,
        socket = %socket_path.display(),
        quiet_ms = quiet.as_millis() as u64,
        "shm manager started"
    );
    on_startup(Startup::Listening { pid });

    let shared: SharedState = Arc::new(Mutex::new(Shared {
        registry: Registry::default(),
        clients: 0,
        quiet_since: Instant::now(),
        next_client: 0,
    }));
    loop {
        match listener.accept() {
            Ok((stream, _)) => admit(stream, &shared, pid),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                // Out of fds or memory, or a connection aborted before accept: transient.
                tracing::warn!(error = %e, "accept failed");
                thread::sleep(tick);
            }
        }
        let state = lock(&shared);
        if state.clients == 0 && state.quiet_since.elapsed() >= quiet {
            // Under the lock no client thread can be mid-request (there are none), and the
            // accept loop is this thread, so nobody is admitted from here on.
            debug_assert_eq!(state.registry.name_count(), 0);
            break;
        }
    }
    // Socket first: from now on clients get ENOENT and start a fresh daemon, which waits for
    // our lock. Connections still in the backlog are reset when the listener closes; their
    // clients retry.
    if let Err(e) = fs::remove_file(&socket_path) {
        tracing::warn!(socket = %socket_path.display(), error = %e, "cannot remove socket");
    }
    drop(listener);
    tracing::info!(pid, "shm manager exiting: no clients for the quiet period");
    drop(lock_fd);
    Ok(())
}

/// Takes the daemon lock, or returns `None` once another process holding it answers on the
/// socket.
fn acquire_lock(config: &ManagerConfig) -> ManagerResult<Option<OwnedFd>> {
    let lock_path = config.lock_path();
    let socket_path = config.socket_path();
    let fd = rustix::fs::open(
        &lock_path,
        OFlags::CREATE | OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| ManagerError::io(format!("cannot open lock file {}", lock_path.display()), e))?;
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(Some(fd)),
            Err(Errno::INTR) => continue,
            Err(Errno::WOULDBLOCK) => {
                // The holder is starting, serving, or exiting. Once it answers, it serves.
                if UnixStream::connect(&socket_path).is_ok() {
                    return Ok(None);
                }
                if Instant::now() >= deadline {
                    return Err(ManagerError::io(
                        format!(
                            "another process holds {} but nothing answers on {} after {LOCK_WAIT:?}; \
                             if no tensormem-shm-manager runs, remove the lock file",
                            lock_path.display(),
                            socket_path.display()
                        ),
                        io::Error::from(io::ErrorKind::TimedOut),
                    ));
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                return Err(ManagerError::io(
                    format!("cannot lock {}", lock_path.display()),
                    e,
                ))
            }
        }
    }
}

/// Checks the peer's uid and hands the connection to its own thread.
fn admit(stream: UnixStream, shared: &SharedState, daemon_pid: u32) {
    let cred = match sockopt::socket_peercred(&stream) {
        Ok(cred) => cred,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read SO_PEERCRED; dropping connection");
            return;
        }
    };
    let own = rustix::process::getuid();
    if cred.uid != own {
        tracing::warn!(
            peer_uid = cred.uid.as_raw(),
            peer_pid = cred.pid.as_raw_nonzero().get(),
            "refused a connection from another user"
        );
        return;
    }
    let peer_pid = cred.pid.as_raw_nonzero().get();
    // Accepted sockets start blocking with no timeout; make sure of it.
    if let Err(e) = stream.set_read_timeout(None) {
        tracing::warn!(error = %e, "cannot clear the read timeout; dropping connection");
        return;
    }
    let id = {
        let mut state = lock(shared);
        state.clients += 1;
        state.next_client += 1;
        state.next_client
    };
    tracing::info!(client = id, peer_pid, "client connected");
    let thread_shared = Arc::clone(shared);
    let dispatch = tracing::dispatcher::get_default(Clone::clone);
    let spawned = thread::Builder::new()
        .name(format!("shm-client-{id}"))
        .spawn(move || {
            // The accept loop's subscriber (a daemon forked from a client sets one for its own
            // threads only, leaving the client's global one alone).
            tracing::dispatcher::with_default(&dispatch, || {
                let outcome = converse(&stream, id, &thread_shared, daemon_pid);
                disconnect(id, peer_pid, &thread_shared, outcome);
            });
        });
    if let Err(e) = spawned {
        tracing::warn!(client = id, error = %e, "cannot start a client thread; dropping connection");
        let mut state = lock(shared);
        state.clients -= 1;
        state.quiet_since = Instant::now();
    }
}

/// Serves one connection until it closes; returns why it ended.
fn converse(
    stream: &UnixStream,
    id: ClientId,
    shared: &SharedState,
    daemon_pid: u32,
) -> io::Result<()> {
    let mut input = BufReader::new(stream);
    let mut output = BufWriter::new(stream);
    match Request::read_from(&mut input)? {
        None => return Ok(()),
        Some(Request::Hello { version, pid }) => {
            Reply::Welcome {
                version: PROTOCOL_VERSION,
                pid: daemon_pid,
            }
            .write_to(&mut output)?;
            output.flush()?;
            if version != PROTOCOL_VERSION {
                tracing::warn!(
                    client = id,
                    version,
                    pid,
                    "client speaks another protocol version"
                );
                return Ok(());
            }
        }
        Some(other) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected hello, got {other:?}"),
            ))
        }
    }
    while let Some(request) = Request::read_from(&mut input)? {
        let reply = handle(request, id, shared);
        reply.write_to(&mut output)?;
        output.flush()?;
    }
    Ok(())
}

fn handle(request: Request, id: ClientId, shared: &SharedState) -> Reply {
    let refuse = |message: String| Reply::Refused { message };
    match request {
        Request::Hello { .. } => refuse("hello sent twice".to_owned()),
        Request::Register { name, must_exist } => {
            if let Err(problem) = check_name(&name) {
                return refuse(problem);
            }
            let mut state = lock(shared);
            // Checked under the lock: a concurrent last release cannot unlink the name between
            // the check and the registration.
            if must_exist && !object_exists(&name) {
                return refuse(format!(
                    "{name} does not exist (its last holder released it, or it was never created)"
                ));
            }
            state.registry.register(id, &name);
            tracing::debug!(client = id, name, "registered");
            Reply::Registered
        }
        Request::Release { name } => {
            let mut state = lock(shared);
            let unlinked = match state.registry.release(id, &name) {
                Released::LastHold => unlink(&name, id),
                Released::StillHeld | Released::NotHeld => false,
            };
            tracing::debug!(client = id, name, unlinked, "released");
            Reply::Released { unlinked }
        }
        Request::Status => {
            let state = lock(shared);
            Reply::Status {
                clients: u32::try_from(state.clients).unwrap_or(u32::MAX),
                names: u32::try_from(state.registry.name_count()).unwrap_or(u32::MAX),
            }
        }
        Request::Forget { name } => {
            let known = lock(shared).registry.forget(&name);
            tracing::debug!(client = id, name, known, "forgotten");
            Reply::Forgotten
        }
    }
}

/// Drops a closed connection's holds and unlinks what nobody holds any more.
fn disconnect(id: ClientId, peer_pid: i32, shared: &SharedState, outcome: io::Result<()>) {
    if let Err(e) = &outcome {
        // A reset is how a killed client's connection usually ends; anything else is odd.
        if e.kind() == io::ErrorKind::ConnectionReset {
            tracing::debug!(client = id, "connection reset");
        } else {
            tracing::warn!(client = id, error = %e, "dropping a client after a bad exchange");
        }
    }
    let mut state = lock(shared);
    let orphans = state.registry.disconnect(id);
    // Unlinked under the lock, for the same reason as in `handle`.
    let unlinked = orphans.iter().filter(|name| unlink(name, id)).count();
    state.clients -= 1;
    if state.clients == 0 {
        state.quiet_since = Instant::now();
    }
    tracing::info!(
        client = id,
        peer_pid,
        unlinked,
        remaining_clients = state.clients,
        "client disconnected"
    );
}

/// `shm_unlink`s a name nobody holds; returns whether it was removed.
fn unlink(name: &str, client: ClientId) -> bool {
    // Names were validated by `check_name` before they were held.
    let Ok(shm) = ShmName::new(name) else {
        return false;
    };
    match rustix::fs::unlink(shm.path()) {
        Ok(()) => {
            tracing::info!(name, last_holder = client, "unlinked");
            true
        }
        Err(Errno::NOENT) => {
            tracing::debug!(name, "already unlinked");
            false
        }
        Err(e) => {
            tracing::warn!(name, error = %e, "cannot unlink");
            false
        }
    }
}

/// Whether `name` is a shared memory object: a regular file in `/dev/shm`, looked at with
/// `lstat` (never opened: opening a FIFO someone planted there would block the daemon while it
/// holds its state lock). Symlinks, FIFOs and other kinds are not objects.
fn object_exists(name: &str) -> bool {
    let Ok(shm) = ShmName::new(name) else {
        return false;
    };
    rustix::fs::statat(
        rustix::fs::CWD,
        shm.path(),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .is_ok_and(|stat| rustix::fs::FileType::from_raw_mode(stat.st_mode).is_file())
}

/// The POSIX shared-memory name rules, checked before the daemon holds (and later unlinks) a
/// name.
fn check_name(name: &str) -> Result<(), String> {
    ShmName::new(name).map(drop).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_planted_in_dev_shm_is_not_an_object_and_does_not_block() {
        let name = format!("/tmtest_fifo_{}", std::process::id());
        let path = ShmName::new(name.clone()).unwrap().path();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &path,
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let probe = name.clone();
        thread::spawn(move || tx.send(object_exists(&probe)).unwrap());
        let exists = rx.recv_timeout(Duration::from_secs(5));
        let _ = fs::remove_file(&path);
        assert_eq!(
            exists,
            Ok(false),
            "object_exists blocked or took a FIFO for an object"
        );
        assert!(!object_exists("/tmtest_no_such_object_at_all"));
    }

    #[test]
    fn names_are_checked_before_the_daemon_holds_them() {
        check_name("/tensormem_1_ab_0").unwrap();
        for bad in ["", "/", "x", "/a/b", "//", "/..", "/a\0b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&format!("/{}", "n".repeat(256))).is_err());
        check_name(&format!("/{}", "n".repeat(255))).unwrap();
    }
}
