//! The plugin's error type, and the thread's last error that C callers read back.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};

use crate::status::{TM_ERROR, TM_OK, TM_OUT_OF_MEMORY, TM_UNSUPPORTED};

/// Why a call of the plugin failed. C callers see it as the string [`tensormem_last_error`] returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device index that cannot be a CUDA device ordinal.
    #[error(
        "device {device} is not a CUDA device ordinal: pass the index of a visible device (0, 1, ...)"
    )]
    InvalidDevice {
        /// The index given.
        device: c_int,
    },
    /// A stream handle that belongs to another device's context than the one named with it.
    #[error(
        "stream {stream:#x} does not belong to device {device}: PyTorch passes each device's own \
         streams; make the stream on the device the memory is for"
    )]
    ForeignStream {
        /// The handle value.
        stream: u64,
        /// The device named with it.
        device: u32,
    },
    /// A pointer that no device's allocator handed out (or that was already freed).
    #[error(
        "pointer {ptr:#x} was not handed out by tensormem's allocator on any device this process \
         used (or it was freed already)"
    )]
    UnknownPointer {
        /// The pointer.
        ptr: u64,
    },
    /// A null pointer where one was required.
    #[error("{what} is a null pointer")]
    NullArgument {
        /// The argument.
        what: &'static str,
    },
    /// A method name the library does not know (`tensormem_backend_supports`).
    #[error(
        "{method} is not a method of PyTorch's CUDAAllocator that a backend refuses; pass the name \
         as PyTorch spells it (getExpandableSegmentSizes, isHistoryEnabled, ...)"
    )]
    UnknownMethod {
        /// The name given.
        method: String,
    },
    /// A path argument that is not UTF-8.
    #[error("the path is not valid UTF-8")]
    InvalidPath,
    /// An allocator settings string (`torch._C._accelerator_setAllocatorSettings`,
    /// `torch.cuda.memory._set_allocator_settings`) that is not UTF-8.
    #[error(
        "the allocator settings string given to torch._C._accelerator_setAllocatorSettings (or \
         torch.cuda.memory._set_allocator_settings) is not valid UTF-8; pass a config string in \
         PYTORCH_CUDA_ALLOC_CONF's grammar, such as 'expandable_segments:True'"
    )]
    SettingsNotUtf8,
    /// The device API refused (no driver, a bad device, out of memory with PyTorch's message, ...).
    #[error(transparent)]
    Cuda(#[from] tensormem::cuda::Error),
    /// The caching allocator refused.
    #[error(transparent)]
    Alloc(#[from] tensormem_cuda_alloc::Error),
    /// A driver call made by the plugin itself failed.
    #[error(transparent)]
    Device(#[from] tensormem_cuda_alloc::DeviceError),
    /// The C++ layer and this library disagree on a struct's layout (they come from different builds).
    #[error(
        "{what} is {got} bytes for the caller but {expected} bytes in libtensormem_torch.so: the C++ \
         layer was built against another version of the library; rebuild it (tensormem_torch.install() \
         rebuilds it when the library changes)"
    )]
    LayoutMismatch {
        /// The struct.
        what: &'static str,
        /// Its size here.
        expected: usize,
        /// Its size for the caller.
        got: usize,
    },
    /// An index past the end of a snapshot's list.
    #[error("index {index} is past the end of the snapshot's list")]
    IndexOutOfRange {
        /// The index.
        index: u64,
    },
    /// A CUDA IPC share, open or close that cannot be done; the message says why and what to do.
    #[error("{0}")]
    IpcHandle(String),
    /// A CUDA IPC handle that is not one PyTorch or tensormem writes, or one of a kind not supported.
    #[error(transparent)]
    Ipc(#[from] tensormem::ipc::Error),
    /// An element type name that weights are not published or installed in.
    #[error(
        "tensor {tensor:?} has element type {name:?}, which weights are not published or installed \
         in: pass PyTorch's name of one of float32, float16, bfloat16, float64, float8_e4m3fn, \
         float8_e5m2, int64, int32, int16, int8, uint8 or bool (str(tensor.dtype) without \
         \"torch.\"), or convert the tensor to one"
    )]
    UnknownDType {
        /// The name given.
        name: String,
        /// The tensor it was given for.
        tensor: String,
    },
    /// A weights handle (a publisher, a subscription, an NCCL weight sync) that is not live: never
    /// handed out, released, dropped or closed already, or one of another kind.
    #[error(
        "{handle:#x} is not a live {kind} handle: pass the handle {made_by} gave, before it is \
         released, dropped or closed"
    )]
    UnknownWeightsHandle {
        /// The handle's value.
        handle: u64,
        /// What kind of handle was expected.
        kind: &'static str,
        /// The functions that hand out that kind.
        made_by: &'static str,
    },
    /// A plan id that tensormem_weights_prepare did not give for this subscription.
    #[error(
        "plan {plan} was not prepared on this subscription ({plans} plans were): pass the id \
         tensormem_weights_prepare wrote for it"
    )]
    UnknownPlan {
        /// The id given.
        plan: u64,
        /// How many plans the subscription has.
        plans: usize,
    },
    /// A weights argument that cannot be what the caller meant; the message says which and why.
    #[error("{0}")]
    InvalidWeightsArgument(String),
    /// The NCCL weight sync refused (a layout that differs between ranks, a bucket size below the
    /// minimum, ...) or NCCL failed; the message names it.
    #[error(transparent)]
    Nccl(#[from] tensormem_nccl::Error),
    /// NCCL's library could not be loaded under the names it is looked for by.
    #[error(
        "NCCL could not be loaded: none of the names cudarc looks for (libnccl.so, libnccl.so.12 and \
         others) is on the loader's path. PyTorch's wheels ship NCCL as \
         site-packages/nvidia/nccl/lib/libnccl.so.2, a name not among them: make a link named \
         libnccl.so to it in a directory of LD_LIBRARY_PATH, set before the process starts \
         (tensormem_torch.nccl_weights.nccl_library_dir() makes one and returns its directory)"
    )]
    NcclNotFound,
    /// Code under the plugin panicked; the panic was stopped at the C boundary.
    #[error("{call} panicked: {message}; this is a bug in tensormem, please report it")]
    Panicked {
        /// The exported function.
        call: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl Error {
    /// Whether this is an out-of-memory error (PyTorch raises `torch.OutOfMemoryError` for these).
    #[must_use]
    pub fn is_out_of_memory(&self) -> bool {
        use tensormem_cuda_alloc::{DeviceError, Error as AllocError};
        let alloc = match self {
            Error::Alloc(e) => e,
            Error::Cuda(tensormem::cuda::Error::Alloc(e)) => e,
            Error::Device(DeviceError::OutOfMemory { .. })
            | Error::Nccl(tensormem_nccl::Error::Device(DeviceError::OutOfMemory { .. })) => {
                return true
            }
            _ => return false,
        };
        matches!(
            alloc,
            AllocError::OutOfMemory(_)
                | AllocError::TooLarge { .. }
                | AllocError::Device(DeviceError::OutOfMemory { .. })
        )
    }

    /// The out-of-memory report of the caching allocator this error carries, if it is one.
    fn out_of_memory_report(&self) -> Option<&tensormem_cuda_alloc::oom::OutOfMemory> {
        use tensormem_cuda_alloc::Error as AllocError;
        match self {
            Error::Alloc(AllocError::OutOfMemory(oom))
            | Error::Cuda(tensormem::cuda::Error::Alloc(AllocError::OutOfMemory(oom))) => Some(oom),
            _ => None,
        }
    }

    /// The message a PyTorch program reads for this error: for an out-of-memory error, PyTorch
    /// 2.11's own message word for word
    /// ([`Reporter::PyTorch`](tensormem_cuda_alloc::oom::Reporter::PyTorch): "... is allocated by
    /// PyTorch, ...", `PYTORCH_CUDA_ALLOC_CONF` and PyTorch's notes, where a Rust program reads
    /// tensormem's names); any other error as `Display` words it.
    #[must_use]
    pub fn message_for_pytorch(&self) -> String {
        match self.out_of_memory_report() {
            Some(oom) => oom.message_for_pytorch().into_owned(),
            None => self.to_string(),
        }
    }

    /// Whether this is a refusal PyTorch's allocator makes for the process's backend
    /// ([`tensormem::cuda::AsyncUnsupported`]): its message's first line is PyTorch's, word for word.
    #[must_use]
    pub fn is_backend_refusal(&self) -> bool {
        matches!(
            self,
            Error::Cuda(tensormem::cuda::Error::AsyncUnsupported(_))
        )
    }

    /// The status code C callers see for it: [`TM_OUT_OF_MEMORY`], [`TM_UNSUPPORTED`] or [`TM_ERROR`].
    #[must_use]
    pub fn code(&self) -> c_int {
        if self.is_out_of_memory() {
            TM_OUT_OF_MEMORY
        } else if self.is_backend_refusal() {
            TM_UNSUPPORTED
        } else {
            TM_ERROR
        }
    }
}

/// `Result` with the plugin's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The last error met on a thread: its message as a C string, and its [`Error::code`].
struct LastError {
    message: CString,
    code: c_int,
}

thread_local! {
    /// The last error met on this thread.
    static LAST_ERROR: RefCell<Option<LastError>> = const { RefCell::new(None) };
}

/// Keeps `error` as this thread's last error, in the words a PyTorch program reads
/// ([`Error::message_for_pytorch`]).
pub(crate) fn set_last_error(error: &Error) {
    let text = error.message_for_pytorch().replace('\0', " ");
    let last = LastError {
        message: CString::new(text).unwrap_or_default(),
        code: error.code(),
    };
    // `try_with`: during thread teardown the slot may be gone; the error is then only logged.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = Some(last));
}

/// The calling thread's last error message, if any.
pub(crate) fn last_error_string() -> Option<String> {
    LAST_ERROR
        .try_with(|slot| {
            slot.borrow()
                .as_ref()
                .map(|last| last.message.to_string_lossy().into_owned())
        })
        .ok()
        .flatten()
}

/// The message of the last error met by a plugin call on the calling thread, or null if none was.
///
/// The string stays valid until the next failing plugin call on the same thread; copy it (Python's
/// `ctypes.c_char_p` result type does). Successful calls leave it as it was.
#[no_mangle]
pub extern "C" fn tensormem_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| {
            slot.borrow()
                .as_ref()
                .map_or(std::ptr::null(), |last| last.message.as_ptr())
        })
        .unwrap_or(std::ptr::null())
}

/// The status code of the last error met by a plugin call on the calling thread:
/// [`TM_OUT_OF_MEMORY`] (PyTorch raises `torch.OutOfMemoryError`), [`TM_UNSUPPORTED`] (a refusal of
/// PyTorch's allocator for the process's backend, whose first line is PyTorch's message; PyTorch raises
/// it as it is), [`TM_ERROR`] for any other, or [`TM_OK`] if no call failed (since
/// [`tensormem_clear_last_error`]). For the functions that report failure by a null or negative result.
#[no_mangle]
pub extern "C" fn tensormem_last_error_code() -> c_int {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ref().map_or(TM_OK, |last| last.code))
        .unwrap_or(TM_OK)
}

/// Forgets the calling thread's last error (so that a later null from [`tensormem_last_error`] means
/// no call failed since).
#[no_mangle]
pub extern "C" fn tensormem_clear_last_error() {
    let _ = LAST_ERROR.try_with(|slot| slot.borrow_mut().take());
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensormem_cuda_alloc::backend::sim::SimDevice;
    use tensormem_cuda_alloc::{CachingAllocator, StreamId};

    /// An out-of-memory error of the caching allocator on a simulated 4 MiB device (8 MiB asked:
    /// a 20 MiB segment tried).
    fn out_of_memory() -> tensormem_cuda_alloc::Error {
        let alloc = CachingAllocator::new(SimDevice::new(4 << 20));
        alloc.allocate(8 << 20, StreamId(0)).unwrap_err()
    }

    #[test]
    fn an_out_of_memory_error_reads_as_pytorchs_message() {
        let pytorchs = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of \
             4.00 MiB of which 4.00 MiB is free. Of the allocated memory 0 bytes is allocated by \
             PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but \
             unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
             to avoid fragmentation.  See documentation for Memory Management  \
             (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
        for error in [
            Error::Alloc(out_of_memory()),
            Error::Cuda(tensormem::cuda::Error::Alloc(out_of_memory())),
        ] {
            assert!(error.is_out_of_memory());
            assert!(
                error.to_string().contains("allocated by tensormem"),
                "{error}"
            );
            assert_eq!(error.message_for_pytorch(), pytorchs);
            set_last_error(&error);
            assert_eq!(last_error_string().as_deref(), Some(pytorchs));
            assert_eq!(tensormem_last_error_code(), TM_OUT_OF_MEMORY);
        }
        tensormem_clear_last_error();
    }

    #[test]
    fn other_errors_read_as_they_display() {
        let error = Error::InvalidDevice { device: -3 };
        assert_eq!(error.message_for_pytorch(), error.to_string());
        set_last_error(&error);
        assert_eq!(last_error_string(), Some(error.to_string()));
        tensormem_clear_last_error();
    }
}
