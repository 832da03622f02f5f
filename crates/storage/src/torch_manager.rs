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

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tensormem_shm::ShmName;

use crate::error::{Error, Result};

/// Bytes of the name field, NUL included.
const FILENAME_LEN: usize = 60;
/// Size of one record: `i32` pid, `u8` free flag, the name, padding to 4-byte alignment.
const RECORD_LEN: usize = 68;
/// How long to wait for the manager's `OK` (PyTorch polls for one second per read).
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection to a `torch_shm_manager`, shared by every storage registered through it.
#[derive(Debug)]
pub(crate) struct TorchManager {
    socket: Mutex<UnixStream>,
    path: PathBuf,
}

/// Connections of this process, by manager handle (PyTorch keeps the same map).
static CONNECTIONS: Mutex<Option<HashMap<Vec<u8>, Arc<TorchManager>>>> = Mutex::new(None);

impl TorchManager {
    /// The connection for `handle`, made on first use.
    pub(crate) fn for_handle(handle: &[u8]) -> Result<Arc<TorchManager>> {
        let mut connections = CONNECTIONS.lock().unwrap_or_else(PoisonError::into_inner);
        let map = connections.get_or_insert_with(HashMap::new);
        if let Some(manager) = map.get(handle) {
            return Ok(Arc::clone(manager));
        }
        let path = PathBuf::from(
            std::str::from_utf8(handle)
                .map_err(|_| torch_error(Path::new("?"), "the manager handle is not UTF-8"))?,
        );
        let socket = UnixStream::connect(&path).map_err(|e| {
            torch_error(
                &path,
                &format!(
                    "cannot connect ({e}); the PyTorch process that shared this name (and its \
                     torch_shm_manager) must still be running"
                ),
            )
        })?;
        socket
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| torch_error(&path, &e.to_string()))?;
        let manager = Arc::new(TorchManager {
            socket: Mutex::new(socket),
            path,
        });
        map.insert(handle.to_vec(), Arc::clone(&manager));
        tracing::debug!(socket = %manager.path.display(), "connected to torch_shm_manager");
        Ok(manager)
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
