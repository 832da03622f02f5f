//! The client side of PyTorch's `torch_shm_manager` protocol (`torch/lib/libshm`), spoken for
//! names that a PyTorch process shared with `_share_filename_cpu_()`.
//!
//! # The protocol
//!
//! The manager handle in PyTorch's `(manager_handle, name, size)` tuple is the path of a Unix
//! stream socket (`<tmp>/torch-shm-dir-XXXXXX/manager.sock`) on which a `torch_shm_manager`
//! listens. A client connects once per handle and keeps the connection for its life; the
//! manager counts connected clients. Each message is one fixed-size `AllocInfo` record, in the
//! host's layout:
//!
//! ```text
//! offset 0    4     5                      65   68
//!        | pid | free | filename (NUL-ended) | pad |
//!        | i32 | u8   | 60 bytes             |     |
//! ```
//!
//! - registering a name (`free = 0`): the manager adds it to its set and answers the two bytes
//!   `OK`;
//! - deregistering (`free = 1`, sent after the client closed its mapping): no answer; the
//!   manager forgets the name if the object no longer exists.
//!
//! The manager never unlinks names one by one: when it has had no client for two seconds it
//! unlinks every registered name that still exists, and exits. So holding a connection is what
//! keeps PyTorch's names alive; a client that dies just drops its connection.
//!
//! Names must be shorter than 60 bytes (PyTorch refuses longer ones the same way).
//!
//! The handle comes from the peer, so its socket is not trusted to answer: connecting gives up
//! after [`CONNECT_TIMEOUT`] (a socket whose listener never accepts, or whose backlog is full),
//! and happens outside the lock of the process's connection map, so one stuck manager does
//! not hold up opens through other managers (or tensormem's own).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use tensormem_shm::ShmName;

use crate::error::{Error, Result};

/// Bytes of the name field, NUL included.
const FILENAME_LEN: usize = 60;
/// Size of one record: `i32` pid, `u8` free flag, the name, padding to 4-byte alignment.
const RECORD_LEN: usize = 68;
/// How long to wait for the manager's `OK` (PyTorch polls for one second per read).
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to a manager may take: a live `torch_shm_manager` accepts at once.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection to a `torch_shm_manager`, shared by every storage registered through it.
#[derive(Debug)]
pub(crate) struct TorchManager {
    socket: Mutex<UnixStream>,
    path: PathBuf,
}

/// Connections of this process, by manager handle (PyTorch keeps the same map).
static CONNECTIONS: Mutex<Option<HashMap<Vec<u8>, Arc<TorchManager>>>> = Mutex::new(None);

impl TorchManager {
    /// The connection for `handle`, made on first use (connecting outside the map's lock,
    /// with a timeout: see the module docs).
    pub(crate) fn for_handle(handle: &[u8]) -> Result<Arc<TorchManager>> {
        Self::for_handle_within(handle, CONNECT_TIMEOUT)
    }

    /// [`for_handle`](Self::for_handle) with a connect timeout of `timeout`.
    pub(crate) fn for_handle_within(handle: &[u8], timeout: Duration) -> Result<Arc<TorchManager>> {
        if let Some(manager) = with_connections(|map| map.get(handle).cloned()) {
            return Ok(manager);
        }
        let path = PathBuf::from(
            std::str::from_utf8(handle)
                .map_err(|_| torch_error(Path::new("?"), "the manager handle is not UTF-8"))?,
        );
        let socket = connect(&path, timeout)?;
        socket
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| torch_error(&path, &e.to_string()))?;
        socket
            .set_write_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| torch_error(&path, &e.to_string()))?;
        // Another thread may have connected meanwhile: keep the first connection (the manager
        // counts this one as a client only until it is dropped).
        Ok(with_connections(|map| {
            Arc::clone(map.entry(handle.to_vec()).or_insert_with(|| {
                tracing::debug!(socket = %path.display(), "connected to torch_shm_manager");
                Arc::new(TorchManager {
                    socket: Mutex::new(socket),
                    path,
                })
            }))
        }))
    }

    /// Registers `name` and waits for `OK`.
    pub(crate) fn register(&self, name: &ShmName) -> Result<()> {
        let record = encode(name, false).map_err(|p| torch_error(&self.path, &p))?;
        let mut socket = self.socket.lock().unwrap_or_else(PoisonError::into_inner);
        socket
            .write_all(&record)
            .map_err(|e| torch_error(&self.path, &format!("cannot register: {e}")))?;
        let mut reply = [0u8; 2];
        socket
            .read_exact(&mut reply)
            .map_err(|e| torch_error(&self.path, &format!("no answer to a registration: {e}")))?;
        if &reply != b"OK" {
            return Err(torch_error(
                &self.path,
                &format!("answered {reply:?} instead of \"OK\""),
            ));
        }
        Ok(())
    }

    /// Tells the manager this process closed `name` (no answer is sent).
    pub(crate) fn deregister(&self, name: &ShmName) -> Result<()> {
        let record = encode(name, true).map_err(|p| torch_error(&self.path, &p))?;
        let mut socket = self.socket.lock().unwrap_or_else(PoisonError::into_inner);
        socket
            .write_all(&record)
            .map_err(|e| torch_error(&self.path, &format!("cannot deregister: {e}")))
    }
}

/// Runs `f` on the process's connection map, under its lock (never held while connecting).
fn with_connections<T>(f: impl FnOnce(&mut HashMap<Vec<u8>, Arc<TorchManager>>) -> T) -> T {
    let mut guard = CONNECTIONS.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.get_or_insert_with(HashMap::new))
}

/// `connect(2)` to the Unix socket at `path`, giving up after `timeout` (`SO_SNDTIMEO` bounds a
/// Unix socket's connect: it waits while the listener's backlog is full).
fn connect(path: &Path, timeout: Duration) -> Result<UnixStream> {
    let cannot = |e: &dyn std::fmt::Display| {
        torch_error(
            path,
            &format!(
                "cannot connect ({e}); the PyTorch process that shared this name (and its \
                 torch_shm_manager) must still be running"
            ),
        )
    };
    let address = SocketAddrUnix::new(path).map_err(|e| cannot(&e))?;
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| cannot(&e))?;
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let result = if left.is_zero() {
            Err(Errno::AGAIN)
        } else {
            // A zero timeout would mean "wait forever": at least a millisecond.
            sockopt::set_socket_timeout(
                &socket,
                Timeout::Send,
                Some(left.max(Duration::from_millis(1))),
            )
            .and_then(|()| rustix::net::connect(&socket, &address))
        };
        match result {
            Ok(()) => return Ok(UnixStream::from(socket)),
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN | Errno::TIMEDOUT | Errno::INPROGRESS) => {
                tracing::warn!(
                    socket = %path.display(),
                    timeout_ms = timeout.as_millis() as u64,
                    "torch_shm_manager socket accepted no connection in time"
                );
                return Err(torch_error(
                    path,
                    &format!(
                        "the socket accepted no connection within {timeout:?} (its listener \
                         does not accept, or its backlog is full); the PyTorch process that \
                         shared this name (and its torch_shm_manager) must be running and \
                         responsive: check it, then open the name again"
                    ),
                ));
            }
            Err(e) => return Err(cannot(&e)),
        }
    }
}

/// One `AllocInfo` record for this process.
pub(crate) fn encode(name: &ShmName, free: bool) -> std::result::Result<[u8; RECORD_LEN], String> {
    let bytes = name.as_str().as_bytes();
    if bytes.len() >= FILENAME_LEN {
        return Err(format!(
            "the name {:?} has {} bytes; torch_shm_manager takes at most {}",
            name.as_str(),
            bytes.len(),
            FILENAME_LEN - 1
        ));
    }
    let mut record = [0u8; RECORD_LEN];
    let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    record[..4].copy_from_slice(&pid.to_ne_bytes());
    record[4] = u8::from(free);
    record[5..5 + bytes.len()].copy_from_slice(bytes);
    Ok(record)
}

fn torch_error(path: &Path, problem: &str) -> Error {
    Error::TorchManager {
        socket: path.to_owned(),
        problem: problem.to_owned(),
    }
}
