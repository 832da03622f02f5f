//! The crate's error type: every failure names the object it concerns and says what to do.

use std::fmt;
use std::io;

use rustix::io::Errno;

use crate::wire::{WireFormat, ACCEPT_MAGIC, FD_MAGIC};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while creating, opening, passing or accessing a shared region.
///
/// `object` fields describe the object concerned: a shared memory name (`shm "/tensormem_1_2_3"`),
/// a path (`file "/tmp/x"`), a file descriptor (`fd 7`) or an anonymous region. OS failures keep
/// their error code in `source` (see [`std::io::Error::raw_os_error`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shared memory name broke the naming rules.
    #[error(
        "invalid shared memory name {name:?}: {problem}; a name is one leading '/' followed by \
         1 to 255 bytes without '/' or NUL (like \"/tensormem_123_456_0\"); \
         use NameGenerator to make valid, unique names"
    )]
    InvalidName {
        /// The rejected name (lossy if it was not UTF-8).
        name: String,
        /// Which rule it broke.
        problem: NameProblem,
    },

    /// A name prefix for [`NameGenerator`](crate::NameGenerator) was rejected.
    #[error(
        "invalid name prefix {prefix:?}: use 1 to {max} ASCII letters, digits, '-', '.' or '_' \
         (PyTorch uses \"torch\", the default is \"tensormem\")",
        max = MAX_PREFIX_LEN
    )]
    InvalidPrefix {
        /// The rejected prefix.
        prefix: String,
    },

    /// A region size was zero or too large to map.
    #[error("invalid size {len} for {object}: {problem}")]
    InvalidSize {
        /// The object being created or mapped.
        object: String,
        /// The requested size in bytes.
        len: u64,
        /// Why the size cannot be used.
        problem: SizeProblem,
    },

    /// Exclusive creation found an object of that name already there.
    #[error(
        "{object} already exists; generate a fresh name (NameGenerator::next_name) or open \
         the existing object with CreateMode::OpenExisting"
    )]
    AlreadyExists {
        /// The object that exists.
        object: String,
    },

    /// Opening without creating found no object of that name.
    #[error(
        "{object} does not exist; check the name, and that its creator is alive and has not \
         unlinked it yet (a refcounted region disappears when its last user closes it)"
    )]
    NotFound {
        /// The missing object.
        object: String,
    },

    /// The object belongs to another user and the caller did not opt in to opening it.
    #[error(
        "{object} is owned by uid {owner}, but this process runs as uid {ours}; refusing to map \
         memory another user controls. If you trust that user, opt in with \
         allow_foreign_owner(true)"
    )]
    ForeignOwner {
        /// The foreign object.
        object: String,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        ours: u32,
    },

    /// The file descriptor or path does not refer to a regular file or shared memory object.
    #[error(
        "{object} is {} {kind}, not a regular file or shared memory object; only fds of shared \
         regions (memfd, shm_open, regular files) can be mapped",
        kind.article()
    )]
    WrongKind {
        /// The object.
        object: String,
        /// What it actually is.
        kind: ObjectKind,
    },

    /// The object is shorter than the size claimed for it: mapping it would SIGBUS on access.
    #[error(
        "{object} holds {actual} bytes but {needed} were expected; it was truncated after \
         sharing or the claimed size is wrong. Not mapping it (reading past its end would \
         raise SIGBUS); ask the producer to share it again"
    )]
    TooSmall {
        /// The object.
        object: String,
        /// Its size according to `fstat`.
        actual: u64,
        /// The size that was claimed or requested.
        needed: u64,
    },

    /// A file descriptor was closed or otherwise unusable.
    #[error(
        "{object} is not an open file descriptor ({source}); pass an fd that is open for the \
         whole call"
    )]
    InvalidFd {
        /// The descriptor.
        object: String,
        /// The OS error (usually `EBADF`).
        source: io::Error,
    },

    /// The OS refused access to the object.
    #[error(
        "permission denied for {object} during {op} ({source}); check its mode and owner, \
         or map it read-only"
    )]
    PermissionDenied {
        /// The object.
        object: String,
        /// The system call that failed.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },

    /// Any other system call failure.
    #[error("{op} failed for {object}: {source}")]
    Os {
        /// The object.
        object: String,
        /// The system call that failed.
        op: &'static str,
        /// The OS error, with its code.
        source: io::Error,
    },

    /// A refcounted region was opened while its last user was tearing it down.
    #[error(
        "{object} is being destroyed (its refcount was {refcount} when this process tried to \
         join); the region is gone or not yet initialised; ask its owner to share a fresh one \
         or retry"
    )]
    RefcountGone {
        /// The region.
        object: String,
        /// The refcount this process found before adding itself.
        refcount: i32,
    },

    /// A message did not follow its wire format: a region message on a socket
    /// ([`transfer`](crate::transfer)), a shared-memory [`channel`](crate::channel)'s setup,
    /// frames or ring, or a [pool](crate::pool) connection's messages and records.
    #[error(
        "bad {wire} message: {problem}; both ends must use tensormem-shm's {wire} protocol \
         (same major version), and a peer that breaks it is broken or hostile"
    )]
    Protocol {
        /// Which protocol.
        wire: WireFormat,
        /// What was wrong.
        problem: String,
    },

    /// The peer speaks another of this crate's wire formats than the one this end expects: the two
    /// ends of a socket were paired wrongly (for example [`transfer::send_region`](crate::transfer::send_region)
    /// on one end and a [`PoolSender`](crate::pool::PoolSender) on the other).
    #[error(
        "expected a {expected} message but the peer sent a {got} message (a pool connection \
         starts as a channel): the two ends were paired wrongly; pair send_region with \
         recv_region, Channel::create with Channel::accept, and PoolReceiver with PoolSender"
    )]
    WrongProtocol {
        /// What this end expected.
        expected: WireFormat,
        /// What the peer sent.
        got: WireFormat,
    },

    /// A region whose descriptor was given away with
    /// [`SharedRegion::take_fd`](crate::SharedRegion::take_fd) was asked to be sent.
    #[error(
        "{object} cannot be sent: its descriptor was taken with take_fd; send the region before \
         taking the descriptor, or send the descriptor you took with transfer::send_fd"
    )]
    FdTaken {
        /// The region.
        object: String,
    },

    /// A region without a kept descriptor was asked to be sent.
    #[error(
        "{object} kept no file descriptor, so it cannot be sent; map it with keep_fd(true) or \
         create it with SharedRegion::create_anonymous"
    )]
    NoFd {
        /// The region.
        object: String,
    },

    /// The peer closed its end of the connection (a region socket, or a pool connection) while this
    /// end was sending or waiting for a message.
    #[error(
        "the peer closed the connection, so nothing more can be sent or received on it; the peer \
         probably exited (or dropped its end)"
    )]
    Disconnected,

    /// The other end of a shared-memory [`channel`](crate::channel) is gone: it dropped its
    /// end, or its process exited or was killed (seen within the channel's liveness interval).
    #[error(
        "the other end of the shared-memory channel is gone (it dropped its end, exited or was \
         killed); make a new channel with a live peer"
    )]
    PeerGone,

    /// A shared-memory [`channel`](crate::channel)'s memory holds values no correct peer writes.
    #[error(
        "the shared-memory channel is corrupt: {problem}; the peer is broken or hostile, drop \
         the channel"
    )]
    ChannelCorrupt {
        /// What was found.
        problem: String,
    },

    /// A message longer than a [`channel`](crate::channel) carries.
    #[error("a message of {len} bytes; a channel message is at most {max} bytes")]
    MessageTooLarge {
        /// Bytes given.
        len: usize,
        /// The most a message holds.
        max: usize,
    },

    /// The buffer given to receive a [`channel`](crate::channel) message is shorter than the
    /// message, which stays queued.
    #[error(
        "the next message has {needed} bytes, the buffer only {len}; receive it into a buffer \
         of at least {needed} bytes (it stays queued)"
    )]
    BufferTooSmall {
        /// Bytes of the message.
        needed: usize,
        /// Bytes of the buffer.
        len: usize,
    },

    /// A [`PoolSender`](crate::pool::PoolSender) has as many leases open as its connection
    /// carries.
    #[error(
        "{outstanding} leases are open on this pool connection, the most it carries; have the \
         consumer drop leases (and read them with wait_release) before sending more"
    )]
    TooManyLeases {
        /// Leases open.
        outstanding: usize,
    },

    /// A byte range lies outside the mapped region.
    #[error("range {offset}..{offset}+{len} is outside the region of {region_len} bytes; keep offsets below len()")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The region's length.
        region_len: usize,
    },

    /// An atomic access was not aligned to its size.
    #[error(
        "offset {offset} is not a multiple of {align}, the alignment a {align}-byte atomic needs"
    )]
    Misaligned {
        /// The offset asked for.
        offset: usize,
        /// The alignment needed.
        align: usize,
    },

    /// Another process truncated the object under the mapping: the bytes asked for are gone.
    #[error(
        "bytes {offset}..{offset}+{len} of the region are gone: another process truncated the \
         shared object under this mapping; share objects that can shrink (named, file-backed) \
         only with processes you trust, or use sealed anonymous regions"
    )]
    Truncated {
        /// First byte that could not be copied.
        offset: usize,
        /// Bytes not copied.
        len: usize,
    },

    /// A write was attempted through a read-only mapping.
    #[error("the region is mapped read-only; map it with Access::ReadWrite to write to it")]
    ReadOnly,

    /// The shared-memory manager daemon could not be found, started or reached, or refused.
    #[cfg(feature = "manager")]
    #[cfg_attr(docsrs, doc(cfg(feature = "manager")))]
    #[error(transparent)]
    Manager(#[from] crate::manager::ManagerError),
}

impl WireFormat {
    /// The error for a message of this format that starts with `got` instead of this format's
    /// magic: [`Error::WrongProtocol`] when `got` is another of the crate's formats (the ends were
    /// paired wrongly), [`Error::Protocol`] naming the bytes otherwise.
    pub(crate) fn bad_magic(self, got: &[u8]) -> Error {
        // Every first four bytes a peer of each format may send first: a channel's acceptor
        // sends its accept frame (a pool's producer the pool's magic) before anything else.
        let known = [
            (Self::Region, Self::Region.magic()),
            (Self::Channel, Self::Channel.magic()),
            (Self::Channel, ACCEPT_MAGIC),
            (Self::Channel, FD_MAGIC),
            (Self::Pool, Self::Pool.magic()),
        ];
        if let Some(&(other, _)) = known
            .iter()
            .find(|(w, magic)| *w != self && got.get(..4) == Some(&magic[..]))
        {
            return Error::WrongProtocol {
                expected: self,
                got: other,
            };
        }
        let got = got.get(..4).unwrap_or(got);
        Error::Protocol {
            wire: self,
            problem: format!(
                "the message starts with \"{}\", not \"{}\"",
                got.escape_ascii(),
                self.magic().escape_ascii()
            ),
        }
    }
}

/// Most bytes allowed in a [`NameGenerator`](crate::NameGenerator) prefix, leaving room for pid,
/// random part and counter.
pub const MAX_PREFIX_LEN: usize = 128;

/// Which naming rule a shared memory name broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameProblem {
    /// The name does not start with '/'.
    NoLeadingSlash,
    /// Nothing follows the leading '/'.
    Empty,
    /// A '/' appears after the first byte.
    InnerSlash,
    /// The name contains a NUL byte.
    Nul,
    /// More than 255 bytes follow the leading '/'.
    TooLong,
    /// The name is "/." or "/..".
    DotName,
    /// The name is not valid UTF-8.
    NotUtf8,
}

impl fmt::Display for NameProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoLeadingSlash => "it must start with '/'",
            Self::Empty => "nothing follows the leading '/'",
            Self::InnerSlash => "it contains a '/' after the leading one",
            Self::Nul => "it contains a NUL byte",
            Self::TooLong => "more than 255 bytes follow the leading '/'",
            Self::DotName => "\".\" and \"..\" are directory entries, not names",
            Self::NotUtf8 => "it is not valid UTF-8",
        })
    }
}

/// Why a size cannot be used for a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SizeProblem {
    /// Zero bytes cannot be mapped.
    Zero,
    /// Larger than a mapping can be on this platform (`isize::MAX` bytes).
    TooLarge,
    /// Creating a region requires its size: call `len(...)`.
    Missing,
    /// A channel's slot count (`len`) is not a power of two from 1 to
    /// [`MAX_SLOTS`](crate::channel::MAX_SLOTS).
    SlotCount,
}

impl fmt::Display for SizeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Zero => "a region needs at least one byte",
            Self::TooLarge => "it exceeds the largest mapping possible (isize::MAX bytes)",
            Self::Missing => "creating a region needs its size; set it with len(...)",
            Self::SlotCount => "a channel's slot count must be a power of two from 1 to 65536",
        })
    }
}

/// What kind of filesystem object a descriptor or path refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ObjectKind {
    /// A regular file, memfd or POSIX shared memory object: the only kind that can be mapped.
    Regular,
    /// A directory.
    Directory,
    /// A socket.
    Socket,
    /// A pipe or FIFO.
    Fifo,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A symbolic link.
    Symlink,
    /// Something else.
    Unknown,
}

impl ObjectKind {
    /// The indefinite article that goes before the kind's name (`an object of unknown type`).
    fn article(self) -> &'static str {
        match self {
            Self::Unknown => "an",
            _ => "a",
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Regular => "regular file",
            Self::Directory => "directory",
            Self::Socket => "socket",
            Self::Fifo => "pipe (FIFO)",
            Self::CharDevice => "character device",
            Self::BlockDevice => "block device",
            Self::Symlink => "symbolic link",
            Self::Unknown => "object of unknown type",
        })
    }
}

impl Error {
    /// Turns an OS error from `op` on `object` into the most specific variant.
    pub(crate) fn from_errno(errno: Errno, op: &'static str, object: impl Into<String>) -> Self {
        let object = object.into();
        let source = io::Error::from(errno);
        match errno {
            Errno::EXIST => Self::AlreadyExists { object },
            Errno::NOENT => Self::NotFound { object },
            Errno::BADF => Self::InvalidFd { object, source },
            Errno::ACCESS | Errno::PERM => Self::PermissionDenied { object, op, source },
            _ => Self::Os { object, op, source },
        }
    }

    /// A closure for `map_err` that calls [`Error::from_errno`].
    pub(crate) fn os<'a>(op: &'static str, object: &'a str) -> impl FnOnce(Errno) -> Self + 'a {
        move |errno| Self::from_errno(errno, op, object)
    }
}

impl Error {
    /// The [`io::ErrorKind`] closest to this error, used by `From<Error> for io::Error`.
    pub fn kind(&self) -> io::ErrorKind {
        use io::ErrorKind as K;
        match self {
            Self::InvalidName { .. }
            | Self::InvalidPrefix { .. }
            | Self::InvalidSize { .. }
            | Self::OutOfBounds { .. }
            | Self::Misaligned { .. }
            | Self::NoFd { .. }
            | Self::FdTaken { .. }
            | Self::MessageTooLarge { .. }
            | Self::BufferTooSmall { .. } => K::InvalidInput,
            Self::TooManyLeases { .. } => K::WouldBlock,
            Self::AlreadyExists { .. } => K::AlreadyExists,
            Self::NotFound { .. } | Self::RefcountGone { .. } => K::NotFound,
            Self::ForeignOwner { .. } | Self::ReadOnly => K::PermissionDenied,
            Self::WrongKind { .. }
            | Self::TooSmall { .. }
            | Self::Protocol { .. }
            | Self::WrongProtocol { .. }
            | Self::Truncated { .. }
            | Self::ChannelCorrupt { .. } => K::InvalidData,
            Self::Disconnected => K::UnexpectedEof,
            Self::PeerGone => K::BrokenPipe,
            Self::InvalidFd { source, .. }
            | Self::PermissionDenied { source, .. }
            | Self::Os { source, .. } => source.kind(),
            #[cfg(feature = "manager")]
            Self::Manager(e) => e.kind(),
        }
    }
}

/// For callers whose functions return `io::Result`: the kind is [`Error::kind`], and the typed
/// error stays reachable through `io::Error::get_ref` / `into_inner` (downcast to [`Error`]).
impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        io::Error::new(err.kind(), err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_kind_messages_take_the_right_article() {
        let message = |kind| {
            Error::WrongKind {
                object: "fd 3".into(),
                kind,
            }
            .to_string()
        };
        assert!(message(ObjectKind::Unknown).starts_with("fd 3 is an object of unknown type,"));
        assert!(message(ObjectKind::Socket).starts_with("fd 3 is a socket,"));
    }
}
