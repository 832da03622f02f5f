//! The per-device allocators: statistics, snapshots, history, limits, settings, and raw allocation
//! (`torch.cuda.memory`).
//!
//! Each device gets one allocator on first use, of the process's backend
//! ([`get_allocator_backend`](super::get_allocator_backend)): under `backend:native` a
//! [`CachingAllocator`] configured from `TENSORMEM_ALLOC_CONF` (else PyTorch's variables) and then
//! by every [`set_allocator_settings`] call made so far; under `backend:cudaMallocAsync` an
//! [`AsyncAllocator`](tensormem_cuda_alloc::AsyncAllocator), which serves these functions as
//! PyTorch's `CudaMallocAsyncAllocator` does and refuses the rest with PyTorch's errors
//! ([`Error::AsyncUnsupported`]).

use std::collections::BTreeMap;
use std::path::Path;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::oom::OomEvent;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::stats::MemoryStats;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, MempoolId, RecordContext};

use tensormem_runtime::DeviceMemory;

use super::backend::{backend_supports, device_allocator, AsyncUnsupported};
use super::device::resolve;
use super::error::{Error, Result};
use super::stream::{current_stream, Stream};

/// The caching allocator of `device`, or of the current device, created on first use. For what the
/// functions of this module do not cover (private pools, free-memory callbacks, OOM observers,
/// base-allocation lookups for IPC).
///
/// # Errors
///
/// [`Error::AsyncUnsupported`] when the process runs `backend:cudaMallocAsync` (no caching
/// allocator serves it); [`Error::InvalidDevice`]; the errors of opening the device;
/// [`Error::Alloc`] when the configuration in the environment is malformed.
pub fn caching_allocator(device: Option<u32>) -> Result<&'static CachingAllocator<CudaBackend>> {
    backend_supports(AsyncUnsupported::CachingAllocator)?;
    Ok(device_allocator(device)?.native(AsyncUnsupported::CachingAllocator)?)
}

/// The allocator statistics of `device`, or of the current device, under the flat keys of
/// `torch.cuda.memory_stats()` (`"allocated_bytes.all.current"`, `"num_alloc_retries"`, ...). Under
/// `backend:cudaMallocAsync`, PyTorch's six figures of the device's memory pool
/// ([`AsyncAllocator::memory_stats`](tensormem_cuda_alloc::AsyncAllocator::memory_stats)), the rest 0.
///
/// # Errors
///
/// As [`device_allocator`](super::device_allocator); the driver's errors under
/// `backend:cudaMallocAsync`.
pub fn memory_stats(device: Option<u32>) -> Result<BTreeMap<String, i64>> {
    Ok(device_memory_stats(device)?.to_flat())
}

/// The allocator statistics of `device`, or of the current device, as a typed value.
///
/// # Errors
///
/// As [`memory_stats`].
pub fn device_memory_stats(device: Option<u32>) -> Result<MemoryStats> {
    Ok(device_allocator(device)?.memory_stats()?)
}

/// Bytes currently handed out on `device` (`torch.cuda.memory_allocated`).
///
/// # Errors
///
/// As [`memory_stats`].
pub fn memory_allocated(device: Option<u32>) -> Result<u64> {
    Ok(non_negative(
        device_memory_stats(device)?.allocated_bytes.all.current,
    ))
}

/// The most bytes handed out on `device` at once since the last peak reset
/// (`torch.cuda.max_memory_allocated`).
///
/// # Errors
///
/// As [`memory_stats`].
pub fn max_memory_allocated(device: Option<u32>) -> Result<u64> {
    Ok(non_negative(
        device_memory_stats(device)?.allocated_bytes.all.peak,
    ))
}

/// Bytes the allocator currently holds from `device`, handed out or cached (`torch.cuda.memory_reserved`).
///
/// # Errors
///
/// As [`memory_stats`].
pub fn memory_reserved(device: Option<u32>) -> Result<u64> {
    Ok(non_negative(
        device_memory_stats(device)?.reserved_bytes.all.current,
    ))
}

/// The most bytes held from `device` at once since the last peak reset (`torch.cuda.max_memory_reserved`).
///
/// # Errors
///
/// As [`memory_stats`].
pub fn max_memory_reserved(device: Option<u32>) -> Result<u64> {
    Ok(non_negative(
        device_memory_stats(device)?.reserved_bytes.all.peak,
    ))
}

fn non_negative(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// Resets the peaks of `device`'s statistics to their current values (`torch.cuda.reset_peak_memory_stats`;
/// under `backend:cudaMallocAsync` the pool's high-water marks).
///
/// # Errors
///
/// As [`memory_stats`].
pub fn reset_peak_memory_stats(device: Option<u32>) -> Result<()> {
    Ok(device_allocator(device)?.reset_peak_stats()?)
}

/// Resets the accumulated counts of `device`'s statistics (`allocated`, `freed`, `num_*`) to zero
/// (`torch.cuda.reset_accumulated_memory_stats`). Under `backend:cudaMallocAsync` it has no effect
/// (PyTorch warns once).
///
/// # Errors
///
/// As [`device_allocator`](super::device_allocator).
pub fn reset_accumulated_memory_stats(device: Option<u32>) -> Result<()> {
    Ok(device_allocator(device)?.reset_accumulated_stats()?)
}

/// A snapshot of every device's allocator opened so far (`torch.cuda.memory._snapshot()`): all their
/// segments, one trace per device ordinal (empty where history is off or the device unused), and the
/// settings of the current device's allocator. While the pinned host allocators record their
/// history ([`record_memory_history_in`]), their blocks and events too, as `host_segments`
/// and `host_traces`.
///
/// # Errors
///
/// [`Error::AsyncUnsupported`] under `backend:cudaMallocAsync` (PyTorch: "Calling snapshot with
/// backend:cudaMallocAsync is not meaningful"); the errors of initialising CUDA.
pub fn memory_snapshot() -> Result<Snapshot> {
    memory_snapshot_with(None, true)
}

/// [`memory_snapshot`] as PyTorch's `snapshot(mempool_id, include_traces)`
/// (`torch.cuda.memory_snapshot(mempool_id, include_traces)`, `MemPool.snapshot(include_traces)`):
/// only the segments of `pool` when it is given and not `(0, 0)`; without `include_traces`, no
/// traces (`device_traces` an empty list, no `host_traces`), which is much faster when history
/// holds many entries.
///
/// # Errors
///
/// As [`memory_snapshot`].
pub fn memory_snapshot_with(pool: Option<MempoolId>, include_traces: bool) -> Result<Snapshot> {
    backend_supports(AsyncUnsupported::Snapshot)?;
    let count = super::device_count()?;
    let current = super::current_device()?;
    let mut merged = Snapshot {
        device_traces: if include_traces {
            vec![Vec::new(); count as usize]
        } else {
            Vec::new()
        },
        ..Snapshot::default()
    };
    let mut host = Snapshot::default();
    for (state, allocator) in tensormem_runtime::opened()? {
        let ordinal = state.ordinal();
        let snapshot = allocator
            .native(AsyncUnsupported::Snapshot)?
            .snapshot_with(pool, include_traces);
        merged.segments.extend(snapshot.segments);
        if let Some(trace) = snapshot.device_traces.into_iter().next() {
            merged.device_traces[ordinal as usize] = trace;
        }
        if ordinal == current || merged.allocator_settings.is_none() {
            merged.allocator_settings = snapshot.allocator_settings;
        }
        if let Some(allocator) = state.host_if_made().filter(|h| h.history_enabled()) {
            let mut one = Snapshot::default();
            allocator.add_to_snapshot(&mut one, include_traces);
            let segments = host.host_segments.get_or_insert_with(Vec::new);
            segments.extend(one.host_segments.unwrap_or_default());
            if let Some(trace) = one.host_traces {
                host.host_traces.get_or_insert_with(Vec::new).extend(trace);
            }
        }
    }
    if let Some(trace) = &mut host.host_traces {
        trace.sort_by_key(|e| e.time_us);
    }
    merged.host_segments = host.host_segments;
    merged.host_traces = host.host_traces;
    Ok(merged)
}

/// Writes [`memory_snapshot`] as the pickle `torch.cuda.memory._dump_snapshot` writes, which PyTorch's
/// `python -m torch.cuda._memory_viz` and <https://pytorch.org/memory_viz> read.
///
/// # Errors
///
/// As [`memory_snapshot`]; [`Error::Snapshot`] when the file cannot be written.
pub fn dump_snapshot(path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    memory_snapshot()?
        .write_pickle_file(path)
        .map_err(|source| Error::Snapshot {
            path: path.to_path_buf(),
            source,
        })
}

/// Starts or stops recording allocator events into a ring buffer of `max_entries` per device, for all
/// devices including those not used yet (`torch.cuda.memory._record_memory_history`). Stopping clears
/// the recorded events.
///
/// # Errors
///
/// [`Error::AsyncUnsupported`] under `backend:cudaMallocAsync` (PyTorch: "cudaMallocAsync does not
/// yet support recordHistory"), starting or stopping; the errors of initialising CUDA.
pub fn record_memory_history(enabled: bool, max_entries: usize) -> Result<()> {
    record_memory_history_in(
        enabled,
        max_entries,
        RecordContext::Never,
        HistoryScope::default(),
    )
}

/// [`record_memory_history`] keeping call stacks as `context` says
/// (`torch.cuda.memory._record_memory_history(context=...)`): [`RecordContext::State`] the stack of
/// each live allocation (snapshot blocks' `frames`, shown by `_memory_viz`), [`RecordContext::Alloc`]
/// also on allocation trace entries, [`RecordContext::All`] also the freeing call's stack. Stacks are
/// Rust call stacks, captured unresolved and symbolized when a snapshot is taken (file and line need
/// debug information in the binary).
///
/// # Errors
///
/// As [`record_memory_history`].
pub fn record_memory_history_with_context(
    enabled: bool,
    max_entries: usize,
    context: RecordContext,
) -> Result<()> {
    record_memory_history_in(enabled, max_entries, context, HistoryScope::default())
}

/// Which allocators [`record_memory_history_in`] records: PyTorch's `record_cuda` and
/// `record_pinned_host_memory` arguments of `torch.cuda.memory._record_memory_history`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryScope {
    /// The device allocators (`record_cuda`, on by default).
    pub cuda: bool,
    /// The pinned host allocators (`record_pinned_host_memory`, off by default): snapshots then
    /// carry `host_segments` and `host_traces`.
    pub pinned_host_memory: bool,
}

impl Default for HistoryScope {
    fn default() -> Self {
        HistoryScope {
            cuda: true,
            pinned_host_memory: false,
        }
    }
}

/// [`record_memory_history_with_context`] for the allocators `scope` names
/// (`torch.cuda.memory._record_memory_history(.., record_pinned_host_memory=True,
/// record_cuda=False)`). An allocator the scope leaves out is turned off (and its events cleared),
/// as is every one when `enabled` is false.
///
/// # Errors
///
/// As [`record_memory_history`]; under `backend:cudaMallocAsync`, [`Error::AsyncUnsupported`]
/// when `scope.cuda` (pinned host memory alone is recorded under either backend).
pub fn record_memory_history_in(
    enabled: bool,
    max_entries: usize,
    context: RecordContext,
    scope: HistoryScope,
) -> Result<()> {
    if scope.cuda {
        backend_supports(AsyncUnsupported::RecordHistory)?;
    }
    Ok(tensormem_runtime::record_history(
        enabled,
        max_entries.max(1),
        context,
        tensormem_runtime::Recorded {
            cuda: scope.cuda,
            host: scope.pinned_host_memory,
        },
    )?)
}

/// Limits how much of `device`'s memory its allocator may hold to `fraction` of the total
/// (`torch.cuda.set_per_process_memory_fraction`): requests beyond it fail with the out-of-memory error,
/// whose message then names the allowed amount. Under `backend:cudaMallocAsync` the limit is PyTorch's
/// for that backend: on the bytes the allocator hands out (the pool itself is not limited).
///
/// # Errors
///
/// [`Error::Alloc`] with [`InvalidFraction`](tensormem_cuda_alloc::Error::InvalidFraction) outside
/// `[0, 1]`; as [`device_allocator`](super::device_allocator).
pub fn set_per_process_memory_fraction(fraction: f64, device: Option<u32>) -> Result<()> {
    Ok(device_allocator(device)?.set_memory_fraction(fraction)?)
}

/// Returns every cached, unused block of every device's allocator to the driver
/// (`torch.cuda.empty_cache`). Memory handed out stays. Under `backend:cudaMallocAsync`, as PyTorch:
/// each device is synchronized and its memory pool trimmed to nothing (`cuMemPoolTrimTo(pool, 0)`).
///
/// # Errors
///
/// The driver's errors while freeing.
pub fn empty_cache() -> Result<()> {
    for (_, allocator) in tensormem_runtime::opened()? {
        allocator.empty_cache()?;
    }
    Ok(())
}

/// Frees the device memory this process shared with other processes (CUDA storages'
/// `share_cuda`, `tensormem_ipc`'s process-wide producer) that their consumers have released since
/// it was freed here (`torch.cuda.ipc_collect`): the memory returns to its allocator's cache, and
/// slots of consumers that died holding memory are reclaimed. One call covers every device and every
/// storage context of the process. The allocators also run it before they report running out of
/// memory. Returns whether any memory was freed.
///
/// # Errors
///
/// [`Error::ForkedChild`](super::Error::ForkedChild) in a bad fork.
pub fn ipc_collect() -> Result<bool> {
    tensormem_runtime::check_not_forked()?;
    Ok(tensormem_runtime::ipc_collect())
}

/// Applies a configuration string in `PYTORCH_CUDA_ALLOC_CONF` grammar to every device's allocator, now
/// and for devices used later (`torch.cuda.memory._set_allocator_settings`). The string may name the
/// process's backend again; under `backend:cudaMallocAsync` the caching allocator's keys mean
/// nothing (as in PyTorch) and the `pinned_*` keys configure the pinned host allocators made later.
///
/// # Errors
///
/// [`Error::Alloc`] with the configuration error (PyTorch's messages) for a malformed string, or
/// [`Error::BackendChanged`] for one naming the other backend (the backend is chosen once per
/// process), in which case nothing changes.
pub fn set_allocator_settings(config: &str) -> Result<()> {
    Ok(tensormem_runtime::apply_settings(config)?)
}

/// The settings `device`'s allocator runs with, or the current device's (under
/// `backend:cudaMallocAsync`, the environment's configuration and the strings applied since).
///
/// # Errors
///
/// As [`device_allocator`](super::device_allocator).
pub fn allocator_settings(device: Option<u32>) -> Result<AllocatorConfig> {
    Ok(tensormem_runtime::device_state(resolve(device)?)?.config()?)
}

/// Attaches `observer` to every device's allocator, those used so far and those used later
/// (`torch._C._cuda_attach_out_of_memory_observer`): it is called after each out-of-memory error, with
/// no allocator lock held, with the device, the size that could not be allocated, and the device's
/// total and free memory.
///
/// # Errors
///
/// [`Error::AsyncUnsupported`] under `backend:cudaMallocAsync` (PyTorch: "cudaMallocAsync does not
/// yet support attachOutOfMemoryObserver"); the errors of initialising CUDA.
pub fn attach_out_of_memory_observer(
    observer: impl Fn(&OomEvent) + Send + Sync + 'static,
) -> Result<()> {
    backend_supports(AsyncUnsupported::AttachOutOfMemoryObserver)?;
    Ok(tensormem_runtime::attach_oom_observer(
        std::sync::Arc::new(observer),
    )?)
}

/// Allocates `size` bytes with the device's allocator for use on `stream`, or on the current stream
/// of the current device (`torch.cuda.caching_allocator_alloc`; under `backend:cudaMallocAsync`, a
/// `cuMemAllocFromPoolAsync` on the stream). Free it with [`caching_allocator_delete`].
///
/// # Errors
///
/// [`Error::Alloc`] with PyTorch's out-of-memory error when the device cannot provide the memory even
/// after the cache was emptied (or, under `backend:cudaMallocAsync`, that backend's); as
/// [`device_allocator`](super::device_allocator).
pub fn caching_allocator_alloc(size: usize, stream: Option<&Stream>) -> Result<DeviceAddress> {
    let stream = match stream {
        Some(stream) => stream.clone(),
        None => current_stream(None)?,
    };
    let id = stream.id();
    Ok(device_allocator(Some(stream.device_index()))?.allocate(size, id)?)
}

/// Frees memory from [`caching_allocator_alloc`] (`torch.cuda.caching_allocator_delete`), whichever
/// device it is on. The null pointer is ignored.
///
/// # Errors
///
/// [`Error::Alloc`] with [`InvalidPointer`](tensormem_cuda_alloc::Error::InvalidPointer) when no
/// device's allocator handed out `ptr` (or it was already freed).
pub fn caching_allocator_delete(ptr: DeviceAddress) -> Result<()> {
    let current = super::current_device()?;
    let mut tried: Vec<_> = tensormem_runtime::opened()?.collect();
    // The current device first: where memory usually is.
    tried.sort_by_key(|(state, _)| state.ordinal() != current);
    let mut last = tensormem_cuda_alloc::Error::InvalidPointer { ptr };
    for (_, allocator) in tried {
        match allocator.free(ptr) {
            Ok(()) => return Ok(()),
            Err(err @ tensormem_cuda_alloc::Error::InvalidPointer { .. }) => last = err,
            Err(other) => return Err(other.into()),
        }
    }
    Err(last.into())
}

/// Marks memory from [`caching_allocator_alloc`] as used by `stream` (`Tensor.record_stream`): once it is
/// freed it is not reused before the work queued on `stream` until then has finished.
///
/// # Errors
///
/// [`Error::Alloc`] with [`InvalidPointer`](tensormem_cuda_alloc::Error::InvalidPointer) when `ptr` is
/// not live memory of `stream`'s device.
pub fn caching_allocator_record_stream(ptr: DeviceAddress, stream: &Stream) -> Result<()> {
    let id = stream.id();
    Ok(device_allocator(Some(stream.device_index()))?.record_stream(ptr, id)?)
}
