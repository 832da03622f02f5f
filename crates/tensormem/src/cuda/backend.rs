//! Which allocator serves the device API: the process's backend, decided once.
//!
//! PyTorch reads `backend:native|cudaMallocAsync` from its allocator configuration when CUDA is
//! loaded and never changes it afterwards: every `torch.cuda` memory function then goes to the
//! caching allocator or to `CudaMallocAsyncAllocator`, and what the latter cannot do is refused with
//! its own errors. The device API does the same: the first call that needs an allocator reads the
//! configuration ([`AllocatorConfig::read_env`]: `TENSORMEM_ALLOC_CONF`, else PyTorch's variables as
//! PyTorch reads them, the backend from `PYTORCH_CUDA_ALLOC_CONF` or else `PYTORCH_ALLOC_CONF`), and
//! its `backend` serves the process from
//! then on: each device's [`DeviceAllocator`] is the caching allocator or the device's
//! [`AsyncAllocator`], and [`AsyncUnsupported`] names what the async backend refuses.

use std::fmt;
use std::sync::OnceLock;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend, ConfigResult};
use tensormem_cuda_alloc::{AsyncAllocator, CachingAllocator};

use super::error::{Error, Result};

/// The process's backend and the configuration it was read from.
#[derive(Debug)]
pub(crate) struct Choice {
    /// The configuration the environment holds (either backend).
    pub(crate) config: AllocatorConfig,
}

impl Choice {
    /// The backend that serves the process.
    pub(crate) fn backend(&self) -> Backend {
        self.config.backend
    }
}

/// Reads the choice from an environment given as a lookup function (the decision, without
/// remembering it).
pub(crate) fn decide<F>(lookup: F) -> ConfigResult<Choice>
where
    F: FnMut(&'static str) -> Option<std::ffi::OsString>,
{
    Ok(Choice {
        config: AllocatorConfig::read_env_from(lookup)?,
    })
}

/// The process's choice, read from the environment by the first call that needs it and kept for the
/// life of the process. A malformed configuration is an error each time (nothing is chosen then).
pub(crate) fn choice() -> Result<&'static Choice> {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    if let Some(choice) = CHOICE.get() {
        return Ok(choice);
    }
    let decided = decide(std::env::var_os)?;
    let choice = CHOICE.get_or_init(|| decided);
    tracing::debug!(backend = %choice.backend(), "the device API's allocator backend");
    Ok(choice)
}

/// The name of the allocator backend that serves device memory in this process
/// (`torch.cuda.get_allocator_backend()`): [`Backend::Native`] (`"native"`, tensormem's caching
/// allocator) or [`Backend::CudaMallocAsync`] (`"cudaMallocAsync"`, [`AsyncAllocator`]), as the
/// allocator configuration in the environment asks; [`Backend::name`] is PyTorch's spelling. Read
/// once, by the first call of the device API that needs an allocator (or this one), as PyTorch reads
/// it once; it cannot change afterwards ([`set_allocator_settings`](super::set_allocator_settings)
/// refuses another backend). Needs no driver.
///
/// # Errors
///
/// [`Error::Alloc`] with the configuration error when the variable holds a malformed configuration.
pub fn get_allocator_backend() -> Result<Backend> {
    Ok(choice()?.backend())
}

/// `Ok` when the process's backend supports `what`; [`Error::AsyncUnsupported`] when the process
/// runs `backend:cudaMallocAsync`, which refuses it. Reads no device: a refusal needs no driver.
///
/// # Errors
///
/// As said; the configuration's error when it is malformed.
pub fn backend_supports(what: AsyncUnsupported) -> Result<()> {
    match choice()?.backend() {
        Backend::Native => Ok(()),
        Backend::CudaMallocAsync => Err(Error::AsyncUnsupported(what)),
    }
}

/// `Ok` when `config` (a run-time configuration string) keeps the process's backend, which it may
/// name again or leave out; [`Error::BackendChanged`] when it names the other one (PyTorch: the
/// backend parsed at run time must be the one parsed at load time).
pub(crate) fn check_unchanged(running: Backend, config: &str) -> Result<AllocatorConfig> {
    let mut probe = AllocatorConfig {
        backend: running,
        ..AllocatorConfig::default()
    };
    probe.apply(config)?;
    if probe.backend == running {
        Ok(probe)
    } else {
        Err(Error::BackendChanged {
            asked: probe.backend,
            running,
        })
    }
}

/// The allocator that serves one device: the process's caching allocator of the device
/// (`backend:native`) or the device's [`AsyncAllocator`] (`backend:cudaMallocAsync`). Both live for
/// the rest of the process. [`device_allocator`] gives the one of a device.
#[derive(Clone, Copy, Debug)]
pub enum DeviceAllocator {
    /// tensormem's caching allocator (`backend:native`).
    Native(&'static CachingAllocator<CudaBackend>),
    /// The driver's stream-ordered allocator (`backend:cudaMallocAsync`).
    Async(&'static AsyncAllocator),
}

impl DeviceAllocator {
    /// Runs `native` or `on_async` on the allocator, whichever it is: the one place the device API's
    /// functions (and the PyTorch plugin) branch on the backend.
    ///
    /// # Errors
    ///
    /// The closure's.
    #[inline]
    pub fn serve<T, E>(
        self,
        native: impl FnOnce(&'static CachingAllocator<CudaBackend>) -> Result<T, E>,
        on_async: impl FnOnce(&'static AsyncAllocator) -> Result<T, E>,
    ) -> Result<T, E> {
        match self {
            DeviceAllocator::Native(allocator) => native(allocator),
            DeviceAllocator::Async(allocator) => on_async(allocator),
        }
    }

    /// The caching allocator, for what only it can do.
    ///
    /// # Errors
    ///
    /// [`Error::AsyncUnsupported`] with `what` under `backend:cudaMallocAsync`.
    #[inline]
    pub fn native(self, what: AsyncUnsupported) -> Result<&'static CachingAllocator<CudaBackend>> {
        match self {
            DeviceAllocator::Native(allocator) => Ok(allocator),
            DeviceAllocator::Async(_) => Err(Error::AsyncUnsupported(what)),
        }
    }

    /// The backend this allocator serves.
    #[must_use]
    pub fn backend(self) -> Backend {
        match self {
            DeviceAllocator::Native(_) => Backend::Native,
            DeviceAllocator::Async(_) => Backend::CudaMallocAsync,
        }
    }

    /// The device.
    #[must_use]
    pub fn device(self) -> &'static CudaBackend {
        match self {
            DeviceAllocator::Native(allocator) => allocator.device(),
            DeviceAllocator::Async(allocator) => allocator.device(),
        }
    }
}

/// The allocator serving `device`, or the current device, as the process's backend says (see
/// [`get_allocator_backend`]); made on the device's first use.
///
/// # Errors
///
/// [`Error::InvalidDevice`]; the errors of opening the device (the driver's, a malformed
/// configuration, a device without memory pools under `backend:cudaMallocAsync`).
pub fn device_allocator(device: Option<u32>) -> Result<DeviceAllocator> {
    Ok(super::registry::device(super::device::resolve(device)?)?.allocator())
}

/// What PyTorch's `backend:cudaMallocAsync` refuses (`c10/cuda/CUDAMallocAsyncAllocator.cpp` and the
/// defaults of `CUDAAllocator` it does not override), and what of tensormem needs the caching
/// allocator. [`Error::AsyncUnsupported`] carries it; its message is PyTorch's line, word for word,
/// then a line on what to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncUnsupported {
    /// Snapshots (`torch.cuda.memory_snapshot`, `memory._dump_snapshot`; PyTorch's `snapshot`).
    Snapshot,
    /// Memory history (`torch.cuda.memory._record_memory_history`; `recordHistory`,
    /// `isHistoryEnabled`).
    RecordHistory,
    /// Out-of-memory observers (`attachOutOfMemoryObserver`).
    AttachOutOfMemoryObserver,
    /// Trace trackers (`attachAllocatorTraceTracker`).
    AttachAllocatorTraceTracker,
    /// Private pools: `torch.cuda.MemPool()` (`createOrIncrefPool`).
    CreateOrIncrefPool,
    /// A pool's users (`getPoolUseCount`).
    GetPoolUseCount,
    /// `MemPool(use_on_oom=True)` (`setUseOnOOM`).
    SetUseOnOom,
    /// `MemPool(no_split=True)` (`setNoSplit`).
    SetNoSplit,
    /// CUDA graph trees' check of a pool's live allocations (`checkPoolLiveAllocations`).
    CheckPoolLiveAllocations,
    /// CUDA graph trees' checkpoints (`getCheckpointState`).
    GetCheckpointState,
    /// CUDA graph trees' restores (`setCheckpointPoolState`).
    SetCheckpointPoolState,
    /// Sharing memory with another process (`shareIpcHandle`).
    ShareIpcHandle,
    /// Opening memory another process shared (`getIpcDevPtr`).
    GetIpcDevPtr,
    /// Expandable segments' sizes (`getExpandableSegmentSizes`).
    GetExpandableSegmentSizes,
    /// tensormem's own: what only the caching allocator does (`caching_allocator`, sleeping and
    /// waking private pools).
    CachingAllocator,
}

impl AsyncUnsupported {
    /// Every refusal, for tests and for [`from_method`](Self::from_method).
    pub const ALL: [AsyncUnsupported; 15] = [
        Self::Snapshot,
        Self::RecordHistory,
        Self::AttachOutOfMemoryObserver,
        Self::AttachAllocatorTraceTracker,
        Self::CreateOrIncrefPool,
        Self::GetPoolUseCount,
        Self::SetUseOnOom,
        Self::SetNoSplit,
        Self::CheckPoolLiveAllocations,
        Self::GetCheckpointState,
        Self::SetCheckpointPoolState,
        Self::ShareIpcHandle,
        Self::GetIpcDevPtr,
        Self::GetExpandableSegmentSizes,
        Self::CachingAllocator,
    ];

    /// The method of PyTorch's `CUDAAllocator` that refuses it (tensormem's function for
    /// [`CachingAllocator`](Self::CachingAllocator)).
    #[must_use]
    pub const fn method(self) -> &'static str {
        match self {
            Self::Snapshot => "snapshot",
            Self::RecordHistory => "recordHistory",
            Self::AttachOutOfMemoryObserver => "attachOutOfMemoryObserver",
            Self::AttachAllocatorTraceTracker => "attachAllocatorTraceTracker",
            Self::CreateOrIncrefPool => "createOrIncrefPool",
            Self::GetPoolUseCount => "getPoolUseCount",
            Self::SetUseOnOom => "setUseOnOOM",
            Self::SetNoSplit => "setNoSplit",
            Self::CheckPoolLiveAllocations => "checkPoolLiveAllocations",
            Self::GetCheckpointState => "getCheckpointState",
            Self::SetCheckpointPoolState => "setCheckpointPoolState",
            Self::ShareIpcHandle => "shareIpcHandle",
            Self::GetIpcDevPtr => "getIpcDevPtr",
            Self::GetExpandableSegmentSizes => "getExpandableSegmentSizes",
            Self::CachingAllocator => "caching_allocator",
        }
    }

    /// The refusal of PyTorch's method `method` (as [`method`](Self::method) spells it;
    /// `isHistoryEnabled` is [`RecordHistory`](Self::RecordHistory), as in PyTorch).
    #[must_use]
    pub fn from_method(method: &str) -> Option<Self> {
        if method == "isHistoryEnabled" {
            return Some(Self::RecordHistory);
        }
        Self::ALL.into_iter().find(|what| what.method() == method)
    }

    /// PyTorch's message for it, word for word (tensormem's own for
    /// [`CachingAllocator`](Self::CachingAllocator)).
    #[must_use]
    pub fn pytorch_message(self) -> String {
        match self {
            Self::Snapshot => "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For \
                               backend:native, snapshot returns a detailed summary of all blocks \
                               tracked by the allocator, but the cudaMallocAsync backend does not \
                               track individual blocks.)"
                .to_owned(),
            Self::GetExpandableSegmentSizes => {
                "CUDAMallocAsyncAllocator does not yet support getExpandableSegmentSizes.".to_owned()
            }
            Self::CachingAllocator => "the native caching allocator does not serve this process \
                                       (backend:cudaMallocAsync does): caching_allocator, sleeping and \
                                       waking private pools need it"
                .to_owned(),
            other => format!(
                "cudaMallocAsync does not yet support {}. If you need it, please file an issue \
                 describing your use case.",
                other.method()
            ),
        }
    }
}

impl fmt::Display for AsyncUnsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\n(tensormem serves this process with backend:cudaMallocAsync because its allocator \
             configuration asks for it; to use this, start the process without backend:cudaMallocAsync \
             in TENSORMEM_ALLOC_CONF, or else in PYTORCH_CUDA_ALLOC_CONF, or else in \
             PYTORCH_ALLOC_CONF: the first of them that is set)",
            self.pytorch_message()
        )
    }
}

#[cfg(test)]
mod tests;
