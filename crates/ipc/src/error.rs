//! The crate's error type: what was wrong with a handle, a file or a driver call, and what to do.

use tensormem_cuda_alloc::DeviceError;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// PyTorch's message for sending memory that was itself received from another process.
pub const RECEIVED_MEMORY_MESSAGE: &str =
    "Attempted to send CUDA tensor received from another process; \
this is not currently supported. Consider cloning before sending.";

/// Everything that can go wrong while sharing or opening CUDA memory between processes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The memory to share was itself received from another process (PyTorch's message).
    #[error("{}", RECEIVED_MEMORY_MESSAGE)]
    ReceivedMemory,

    /// The handle is an empty storage's ([`IpcHandle::empty`](crate::IpcHandle::empty)): it names no
    /// memory, so there is nothing to open.
    #[error(
        "the handle is an empty (zero-byte) storage's and names no device memory, so there is \
         nothing to open on device {device}; make an empty storage of that device instead \
         (tensormem_storage::Storage::new_shared_cuda does)"
    )]
    EmptyHandle {
        /// The device in the handle.
        device: u32,
    },

    /// The descriptors of an expandable segment's chunks could not be taken from the producer
    /// (see [`chunks`](crate::chunks)): what each way tried answered, and what to do.
    #[error("cannot take the chunk descriptors of process {pid}: {problem}")]
    ChunkDescriptors {
        /// The producer's process id.
        pid: u32,
        /// What went wrong, per way tried.
        problem: String,
    },

    /// Another process than the producer listens on the producer's descriptor socket (see
    /// [`chunks`](crate::chunks#who-answers-on-the-socket)): a process that bound the name first.
    /// Nothing was asked of it or taken from it.
    #[error(
        "the descriptor socket @{socket} of process {pid} is answered by {}, uid {peer_uid}, not by \
         the producer; its descriptors were refused (nothing was asked of it or taken from it){}. \
         Another local process bound the name before the producer (or the producer runs in another \
         pid namespace): find and stop that process, let this process ptrace the producer \
         (pidfd_getfd), or share with expandable_segments:False",
        peer_description(.peer_pid),
        pidfd_note(.pidfd)
    )]
    ImpostorPeer {
        /// The producer's process id (from the handle).
        pid: u32,
        /// The socket's name in the abstract namespace.
        socket: String,
        /// The pid of the process listening there, as this process sees it (`None`: a process of
        /// another pid namespace, not visible here).
        peer_pid: Option<u32>,
        /// The user of the process listening there.
        peer_uid: u32,
        /// What `pidfd_getfd` answered first, when it was tried.
        pidfd: Option<String>,
    },

    /// The producer's descriptor socket did not take the connection, or did not answer, within
    /// the consumer's timeout (see [`chunks`](crate::chunks#who-answers-on-the-socket)). Nothing
    /// was taken from it.
    #[error(
        "the descriptor socket @{socket} of process {pid} did not {waiting_for} within {timeout:?}{}: \
         the producer is stuck, or another local process bound the name and does not accept; retry, \
         raise ConsumerConfig::chunk_fd_timeout, let this process ptrace the producer \
         (pidfd_getfd), or share with expandable_segments:False",
        pidfd_note(.pidfd)
    )]
    ChunkSocketTimedOut {
        /// The producer's process id (from the handle).
        pid: u32,
        /// The socket's name in the abstract namespace.
        socket: String,
        /// What the consumer was waiting for (the connection to be taken, an answer).
        waiting_for: &'static str,
        /// How long it waited.
        timeout: std::time::Duration,
        /// What `pidfd_getfd` answered first, when it was tried.
        pidfd: Option<String>,
    },

    /// A driver call failed (the call, the driver's code and its description).
    #[error(transparent)]
    Driver(#[from] DeviceError),

    /// The caching allocator refused a lookup (not a live allocation, expandable segment, ...).
    #[error(transparent)]
    Allocator(#[from] tensormem_cuda_alloc::Error),

    /// A ref-counter file could not be created, opened or accessed.
    #[error("ref-counter file {name}: {source}")]
    RefCounterFile {
        /// The file's shared memory name.
        name: String,
        /// What the shared memory layer reported.
        #[source]
        source: tensormem_shm::Error,
    },

    /// The handle names a shared memory object that is not a ref-counter file: it has neither
    /// tensormem's trailer nor PyTorch's name and size. Its words are not decremented.
    #[error(
        "{name} ({len} bytes) is not a ref-counter file: it has neither tensormem's trailer nor \
         PyTorch's name (/torch_<pid>_<random>_<n>) and size ({torch_len} bytes); the handle is \
         forged or corrupted and names another object, which was left untouched; share the memory \
         again"
    )]
    NotRefCounterFile {
        /// The object's shared memory name.
        name: String,
        /// Its size in bytes (header included).
        len: u64,
        /// The size of a PyTorch ref-counter file (header included).
        torch_len: u64,
    },

    /// Encoded handle bytes were malformed.
    #[error(
        "malformed IPC handle: {problem}; pass the bytes IpcHandle::encode produced, unchanged"
    )]
    MalformedHandle {
        /// What was wrong.
        problem: String,
    },

    /// Encoded batch handle bytes were malformed or hostile (truncated, counts that do not match
    /// the length, a view past its segment, overlapping views, duplicate names, ...). Nothing was
    /// opened or written.
    #[error(
        "malformed batch handle: {problem}; pass the bytes BatchHandle::encode produced, unchanged"
    )]
    MalformedBatch {
        /// What was wrong.
        problem: String,
    },

    /// The bytes are not a weights message ([`WeightsMessage::decode`](crate::weights::WeightsMessage::decode)):
    /// nothing was opened.
    #[error(
        "malformed weights message: {problem}; pass the bytes WeightsMessage::encode produced, \
         unchanged"
    )]
    MalformedWeights {
        /// What was wrong.
        problem: String,
    },

    /// The published tensors and the consumer's do not match (names, element types, shapes,
    /// strides, overlaps): nothing was written.
    #[error("cannot install the published weights: {problem}")]
    WeightsMismatch {
        /// What differs, naming the tensors.
        problem: String,
    },

    /// The version channel of a publication could not be made or joined.
    #[error("weights channel: {problem}")]
    WeightsChannel {
        /// What went wrong.
        problem: String,
    },

    /// A wait of a weights publication ran out of time; nothing was changed by it.
    #[error("timed out after {waited:?} waiting for {what}; wait again, or close the publication")]
    WeightsTimedOut {
        /// What was waited for.
        what: String,
        /// How long.
        waited: std::time::Duration,
    },

    /// The producer closed the publication, or exited: no new version will come.
    #[error(
        "the weights publication of process {pid} is closed (closed by its producer, or the \
         producer exited); drop the subscription and open a new publication"
    )]
    PublicationClosed {
        /// The producer's process id.
        pid: u32,
    },

    /// A batch could not be built from what was added to it (nothing was shared, no slot taken).
    #[error("cannot share the batch: {problem}")]
    InvalidBatch {
        /// What was wrong, and what to do.
        problem: String,
    },

    /// A handle field (in bytes) had the wrong length.
    #[error(
        "{field} is {len} bytes, but a CUDA IPC handle is {expected} bytes; pass the bytes \
         cuIpcGetMemHandle / cuIpcGetEventHandle (or PyTorch's _share_cuda_) produced"
    )]
    HandleLength {
        /// Which field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The length required.
        expected: usize,
    },

    /// The handle names a device this process does not have.
    #[error(
        "the handle names CUDA device {device}, but this process sees {count} device(s); open it in a \
         process that sees the producer's device (check CUDA_VISIBLE_DEVICES)"
    )]
    InvalidDevice {
        /// The device in the handle.
        device: i64,
        /// How many devices this process sees.
        count: u32,
    },

    /// `offset + size` lies outside the base allocation the memory handle opened.
    #[error(
        "the handle claims {size} bytes at offset {offset} of a device allocation of {base_size} bytes; \
         the handle does not describe the memory it names (corrupted or forged)"
    )]
    OutOfBounds {
        /// The offset in the base allocation.
        offset: u64,
        /// The size claimed.
        size: u64,
        /// The real size of the opened base allocation.
        base_size: u64,
    },

    /// The slot offset is past the end of the ref-counter file.
    #[error(
        "ref-counter slot {slot} is outside the file {name}, which has {slots} slots; the handle is \
         corrupted or names another file"
    )]
    SlotOutOfRange {
        /// The slot in the handle.
        slot: u64,
        /// The file.
        name: String,
        /// How many slots the file holds.
        slots: usize,
    },

    /// The slot does not hold a reference any more (released twice, reclaimed, or never set).
    #[error(
        "ref-counter slot {slot} of {name} reads {value}, so no reference is left to take over; each \
         handle may be opened once (it was already released, or its producer reclaimed it)"
    )]
    SlotNotHeld {
        /// The slot.
        slot: u64,
        /// The file.
        name: String,
        /// What it read.
        value: i64,
    },

    /// Another live process already opened this handle (each share is meant for one consumer).
    #[error(
        "ref-counter slot {slot} of {name} is already held by process {pid}; share the memory once per \
         consumer (call share again for another consumer)"
    )]
    SlotClaimed {
        /// The slot.
        slot: u64,
        /// The file.
        name: String,
        /// The process holding it.
        pid: u32,
    },

    /// The producer gave this share up before it was opened: it stayed unopened past the
    /// producer's limit after the producer freed its memory
    /// ([`ProducerConfig::expire_unopened_batches`](crate::ProducerConfig::expire_unopened_batches)).
    #[error(
        "ref-counter slot {slot} of {name} was given up by its producer: the share was not opened \
         in time after the producer freed its memory, and that memory may be in use again; open \
         shares as they arrive, or raise the producer's ProducerConfig::expire_unopened_batches \
         (expire_unopened_shares for single shares)"
    )]
    ShareExpired {
        /// The slot.
        slot: u64,
        /// The file.
        name: String,
    },

    /// A typed view does not fit the memory (size not a multiple of the element, or misaligned).
    #[error(
        "cannot view {bytes} bytes at {addr:#x} as elements of {elem_size} bytes (alignment \
         {align}); the size must be a multiple of the element size and the address aligned to it"
    )]
    BadView {
        /// The memory's size.
        bytes: u64,
        /// Its address.
        addr: u64,
        /// The element size.
        elem_size: usize,
        /// The element alignment.
        align: usize,
    },

    /// A PyTorch share tuple could not be converted.
    #[error("invalid PyTorch share tuple: {problem}")]
    InvalidTuple {
        /// What was wrong.
        problem: String,
    },
}

/// "process N" or, for a pid this process cannot see, what that means.
fn peer_description(pid: &Option<u32>) -> String {
    match *pid {
        Some(pid) => format!("process {pid}"),
        None => "a process of another pid namespace".to_owned(),
    }
}

/// What `pidfd_getfd` answered before the socket was tried, if it was.
fn pidfd_note(pidfd: &Option<String>) -> String {
    pidfd
        .as_deref()
        .map_or_else(String::new, |problem| format!(" (first, {problem})"))
}

impl Error {
    pub(crate) fn file(name: &impl ToString, source: tensormem_shm::Error) -> Self {
        Self::RefCounterFile {
            name: name.to_string(),
            source,
        }
    }

    /// The same error with the file's name filled in (for errors raised on a mapping).
    pub(crate) fn renamed(self, name: &impl ToString) -> Self {
        match self {
            Self::RefCounterFile { source, .. } => Self::file(name, source),
            other => other,
        }
    }
}
