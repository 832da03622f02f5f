//! What can go wrong between a client, the manager daemon and the system.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Errors of the shared-memory manager: finding and starting the daemon, talking to it, and the
/// daemon's own setup.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// The `tensormem-shm-manager` binary was found in none of the places searched.
    #[error(
        "cannot find the `tensormem-shm-manager` binary: {searched}; build it \
         (`cargo build -p tensormem-shm --bin tensormem-shm-manager`) and set TENSORMEM_SHM_MANAGER \
         to its path, or install it next to this program or in a directory of PATH"
    )]
    BinaryNotFound {
        /// What was searched and why each place failed.
        searched: String,
    },

    /// Starting the daemon process failed before it could report.
    #[error("cannot start the shm manager `{binary}`: {source}")]
    Spawn {
        /// The binary that was run.
        binary: PathBuf,
        /// The operating system's reason.
        #[source]
        source: io::Error,
    },

    /// The daemon started but reported that it could not serve.
    #[error("the shm manager `{binary}` failed to start: {message}")]
    StartFailed {
        /// The binary that was run.
        binary: PathBuf,
        /// What the daemon wrote on its way out.
        message: String,
    },

    /// No daemon answered within the connect timeout, even after starting one.
    #[error(
        "no shm manager answered on {socket} within {waited:?}; \
         check that the directory is writable and look at the daemon's log (TENSORMEM_SHM_MANAGER_LOG)"
    )]
    Unavailable {
        /// The socket that was tried.
        socket: PathBuf,
        /// How long the client kept trying.
        waited: Duration,
        /// The last error met while connecting.
        #[source]
        last: io::Error,
    },

    /// The runtime directory is unsafe to put a socket in: another user owns it or can write to it.
    #[error(
        "the shm manager directory {dir} is {problem}; remove it or point TENSORMEM_SHM_MANAGER_DIR \
         at a directory only you can access"
    )]
    InsecureDir {
        /// The directory.
        dir: PathBuf,
        /// What is wrong with it.
        problem: String,
    },

    /// The socket path does not fit in `sockaddr_un` (107 bytes on Linux).
    #[error("the shm manager socket path {path} is {len} bytes, longer than the 107 a Unix socket allows; use a shorter TENSORMEM_SHM_MANAGER_DIR")]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },

    /// The process at the other end of the socket runs as another user.
    #[error("the process at {socket} runs as uid {peer_uid}, not as this user (uid {own_uid}); refusing to talk to it")]
    ForeignPeer {
        /// The socket.
        socket: PathBuf,
        /// The peer's uid (`SO_PEERCRED`).
        peer_uid: u32,
        /// This process's uid.
        own_uid: u32,
    },

    /// The daemon speaks another protocol version (an older or newer binary is running).
    #[error(
        "the shm manager speaks protocol version {theirs}, this library speaks {ours}; \
         wait for the running daemon to exit or point TENSORMEM_SHM_MANAGER at a matching binary"
    )]
    VersionMismatch {
        /// This library's version.
        ours: u32,
        /// The daemon's version.
        theirs: u32,
    },

    /// A message on the socket could not be decoded.
    #[error("malformed shm manager message: {0}")]
    Protocol(String),

    /// The daemon refused a request.
    #[error("the shm manager refused the request for {name}: {message}")]
    Refused {
        /// The shared-memory name concerned.
        name: String,
        /// What the daemon said.
        message: String,
    },

    /// The connection to the daemon broke after it had been set up (the daemon was killed).
    #[error("lost the connection to the shm manager: {0}; regions registered so far are no longer protected against leaks")]
    Disconnected(#[source] io::Error),

    /// A system call of the daemon or the client failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The operating system's reason.
        #[source]
        source: io::Error,
    },

    /// Bad command-line arguments to the daemon binary.
    #[error("{0}")]
    Usage(String),
}

impl ManagerError {
    pub(crate) fn io(what: impl Into<String>, source: impl Into<io::Error>) -> Self {
        ManagerError::Io {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// `Result` with [`ManagerError`], inside the manager module.
pub(crate) type ManagerResult<T> = std::result::Result<T, ManagerError>;

impl ManagerError {
    /// The [`io::ErrorKind`] closest to this error, used by `From<ManagerError> for io::Error`.
    pub fn kind(&self) -> io::ErrorKind {
        use io::ErrorKind as K;
        match self {
            Self::BinaryNotFound { .. } => K::NotFound,
            Self::Spawn { source, .. } | Self::Disconnected(source) | Self::Io { source, .. } => {
                source.kind()
            }
            Self::StartFailed { .. } => K::Other,
            Self::Unavailable { .. } => K::TimedOut,
            Self::InsecureDir { .. } | Self::ForeignPeer { .. } => K::PermissionDenied,
            Self::SocketPathTooLong { .. } | Self::Usage(_) => K::InvalidInput,
            Self::VersionMismatch { .. } | Self::Protocol(_) => K::InvalidData,
            Self::Refused { .. } => K::Other,
        }
    }
}

/// The kind is [`ManagerError::kind`]; the typed error stays reachable by downcasting.
impl From<ManagerError> for io::Error {
    fn from(err: ManagerError) -> Self {
        io::Error::new(err.kind(), err)
    }
}
