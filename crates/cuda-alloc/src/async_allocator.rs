//! `backend:cudaMallocAsync`: [`AsyncAllocator`], device memory from the driver's stream-ordered allocator.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::backend::cuda::driver::check;
use crate::backend::cuda::{registry, BackendEvent, BackendStream, CudaBackend};
use crate::device::{Device, DeviceAddress, DeviceError, MemInfo, StreamId};
use crate::error::{Error, Result};
use crate::oom::{OutOfMemory, Source as OomSource};
use crate::size::format_size;
use crate::stats::MemoryStats;

/// PyTorch refuses requests of one exabyte or more before trying.
const ONE_EXABYTE: usize = 1 << 60;

/// PyTorch warns once per process for these.
static WARNED_SAME_STREAM: AtomicBool = AtomicBool::new(false);
static WARNED_UNCAPTURED_FREE: AtomicBool = AtomicBool::new(false);
static WARNED_ACCUMULATED: AtomicBool = AtomicBool::new(false);

/// What the allocator keeps per live pointer (PyTorch's `PtrUsage`).
#[derive(Debug)]
struct PtrUsage {
    /// The size asked for.
    size: usize,
    /// The stream it was allocated on.
    stream: StreamId,
    /// Streams added by `record_stream` (never the allocation stream), without duplicates.
    recorded: Vec<StreamId>,
    /// Allocated while a capture was underway.
    captured: bool,
}

/// The allocator's state, behind one mutex (PyTorch's `general_mutex`).
#[derive(Debug, Default)]
struct State {
    /// Live pointers.
    ptrs: HashMap<u64, PtrUsage>,
    /// Pointers allocated outside a capture and freed during one: freed once no capture is underway.
    deferred: Vec<u64>,
    /// Between `begin_capture` and `end_capture`.
    capture_underway: bool,
    /// Streams a free was queued on during the capture, joined into the capture stream at its end.
    capture_free_streams: Vec<StreamId>,
    /// Bytes handed out and not freed (PyTorch's `pytorch_used_bytes`).
    used: u64,
    /// The most `used` may reach (`set_memory_fraction`; PyTorch's `pytorch_memory_limits`).
    limit: u64,
}

/// The driver's figures for one memory pool (`CU_MEMPOOL_ATTR_*_MEM_*`, or `CU_GRAPH_MEM_ATTR_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Bytes the pool holds from the device now (`RESERVED_MEM_CURRENT`).
    pub reserved_current: u64,
    /// The highest `reserved_current` since the last peak reset (`RESERVED_MEM_HIGH`).
    pub reserved_high: u64,
    /// Bytes of the pool handed out now (`USED_MEM_CURRENT`).
    pub used_current: u64,
    /// The highest `used_current` since the last peak reset (`USED_MEM_HIGH`).
    pub used_high: u64,
}

/// The pools behind [`AsyncAllocator::memory_stats`], as the driver reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AsyncPoolStats {
    /// The device's default memory pool, which serves every allocation made outside a graph capture
    /// (and anything else in the process that allocates from it: the CUDA runtime's `cudaMallocAsync`,
    /// cudarc's `alloc`). PyTorch 2.11's statistics are this pool's.
    pub default_pool: PoolUsage,
    /// The device's graph-memory pool (`cuDeviceGetGraphMemAttribute`), which backs allocations made
    /// inside captured graphs once the graphs are instantiated. Newer PyTorch releases add it to
    /// `reserved_bytes` and `allocated_bytes`; zero where the driver does not report it.
    pub graph_pool: PoolUsage,
}

/// `backend:cudaMallocAsync`: device memory from the CUDA driver's stream-ordered allocator, as
/// PyTorch's `CudaMallocAsyncAllocator` (`c10/cuda/CUDAMallocAsyncAllocator.cpp`) serves it.
///
/// There is no cache of ours here: every allocation is a `cuMemAllocFromPoolAsync` from the device's
/// *default memory pool* (`cuDeviceGetDefaultMemPool`) on the allocation's stream, and every free a
/// `cuMemFreeAsync`. The driver keeps freed memory in the pool (its release threshold is set to
/// `u64::MAX`, so nothing goes back to the device at synchronisation points) and decides itself which
/// free range serves the next request. What is left to the allocator is PyTorch's bookkeeping around
/// those two calls:
///
/// - **Streams.** A pointer remembers its allocation stream and the streams given to
///   [`record_stream`](AsyncAllocator::record_stream). Freed without recorded streams it goes back on
///   its allocation stream. Freed with some, a private "unifying" stream is made to wait (with events)
///   for the allocation stream and every recorded stream, and the pointer is freed on it: the pool
///   reuses the memory only after all of them have reached the free.
/// - **Statistics.** PyTorch reads the pool's attributes and fills six fields of `DeviceStats`:
///   `allocated_bytes.all` and `active_bytes.all` (both the pool's used memory, current and high) and
///   `reserved_bytes.all` (the pool's reserved memory, current and high). Everything else is zero
///   ([`AsyncAllocator::memory_stats`]).
/// - **Graph capture.** Between [`begin_capture`](AsyncAllocator::begin_capture) and
///   [`end_capture`](AsyncAllocator::end_capture) allocations are marked captured; freeing a pointer
///   allocated before the capture is deferred until the capture has ended (the driver forbids it inside
///   a capture), and every stream a free was queued on during the capture is joined back into the
///   capture stream before the capture ends.
/// - **Refused, as PyTorch refuses them:** IPC of this memory ([`AsyncAllocator::ipc_handle`]),
///   snapshots, memory history, checkpoints of private pools, expandable segments (PyTorch's
///   `cudaMallocAsync does not yet support ...` errors).
///
/// One per device; it uses the device's default memory pool, which every `AsyncAllocator` of the
/// device (and every other user of that pool in the process) shares. Pointers are raw
/// [`DeviceAddress`]es, freed with [`free`](Self::free). Pointers still live when the allocator is
/// dropped are freed then, on their streams.
///
/// ```no_run
/// use tensormem_cuda_alloc::backend::cuda::CudaBackend;
/// use tensormem_cuda_alloc::AsyncAllocator;
///
/// let alloc = AsyncAllocator::new(CudaBackend::new(0)?)?;
/// let stream = alloc.device().create_stream()?;
/// let ptr = alloc.allocate(1 << 20, stream.id())?;
/// alloc.free(ptr)?; // back to the pool, on `stream`
/// let stats = alloc.memory_stats()?.to_flat();
/// assert!(stats["reserved_bytes.all.current"] >= 1 << 20);
/// alloc.empty_cache()?; // the pool trimmed to nothing
/// # Ok::<(), tensormem_cuda_alloc::Error>(())
/// ```
#[derive(Debug)]
pub struct AsyncAllocator {
    device: CudaBackend,
    /// The device's default memory pool: owned by the driver, alive as long as the device's context
    /// (retained for the process).
    pool: sys::CUmemoryPool,
    /// The stream frees of pointers used on several streams are queued on.
    unifier: BackendStream,
    state: Mutex<State>,
}

// SAFETY: `pool` is a driver handle that may be used from any thread (the driver synchronises
// internally); it is only passed to driver calls. Everything else is `Send`, and the mutable state is
// behind a mutex.
unsafe impl Send for AsyncAllocator {}
// SAFETY: as above; no method gives out mutable access to anything but the mutex-guarded state.
unsafe impl Sync for AsyncAllocator {}

impl AsyncAllocator {
    /// Takes device `device`'s default memory pool and sets it up as PyTorch does on a device's first
    /// use: release threshold `u64::MAX` (freed memory stays in the pool across synchronisations) and
    /// the three reuse policies (`REUSE_FOLLOW_EVENT_DEPENDENCIES`, `REUSE_ALLOW_OPPORTUNISTIC`,
    /// `REUSE_ALLOW_INTERNAL_DEPENDENCIES`) on. Also makes the unifying stream.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] with the driver's error, for instance on a device without memory pools
    /// (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` = 0, where `cuDeviceGetDefaultMemPool` fails).
    #[doc(alias = "cuDeviceGetDefaultMemPool")]
    pub fn new(device: CudaBackend) -> Result<Self> {
        device.make_current()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the device handle comes from `cuDeviceGet` after `cuInit` (the backend exists);
        // `pool` is a valid out-parameter.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, device.context().device())
        })?;
        let mut threshold = u64::MAX;
        // SAFETY: `pool` is the device's default pool; the release threshold is a `cuuint64_t`.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            )
        })?;
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        ] {
            let mut enable: i32 = 1;
            // SAFETY: `pool` is live; the reuse policies are `int` attributes.
            check("cuMemPoolSetAttribute", unsafe {
                sys::cuMemPoolSetAttribute(pool, attr, (&mut enable as *mut i32).cast::<c_void>())
            })?;
        }
        let unifier = BackendStream::new(&device)?;
        Ok(Self {
            device,
            pool,
            unifier,
            state: Mutex::new(State {
                limit: u64::MAX,
                ..State::default()
            }),
        })
    }

    /// The device.
    #[inline]
    #[must_use]
    pub fn device(&self) -> &CudaBackend {
        &self.device
    }

    /// The device's default memory pool, for driver calls this type does not wrap. It stays the
    /// driver's.
    #[inline]
    #[must_use]
    pub fn as_raw_pool(&self) -> sys::CUmemoryPool {
        self.pool
    }

    /// `size` bytes from the pool, ordered on `stream` (`cuMemAllocFromPoolAsync`; PyTorch's
    /// `raw_alloc_with_stream`): usable by work queued on `stream` from now on. A size of 0 gives the
    /// null address without a driver call, as in PyTorch. During a capture
    /// ([`begin_capture`](Self::begin_capture)) the allocation is captured into the graph.
    ///
    /// # Errors
    ///
    /// [`Error::TooLarge`] for one exabyte or more; [`Error::OutOfMemory`] with PyTorch's message for
    /// this backend when the driver has no memory or the memory fraction would be exceeded;
    /// [`DeviceError::UnknownStream`] (in [`Error::Device`]) for a stream the backend does not know;
    /// other driver errors.
    #[doc(alias = "cuMemAllocFromPoolAsync")]
    pub fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddress> {
        if size >= ONE_EXABYTE {
            return Err(Error::TooLarge { bytes: size });
        }
        if size == 0 {
            return Ok(DeviceAddress(0));
        }
        registry::check_and_pin(self.device.ordinal(), stream)?;
        self.device.make_current()?;
        let mut state = self.state.lock();
        if !state.capture_underway && !state.deferred.is_empty() {
            let deferred = std::mem::take(&mut state.deferred);
            for ptr in deferred {
                self.free_impl(&mut state, ptr)?;
            }
        }
        let over_limit = state.used.saturating_add(size as u64) > state.limit;
        let mut raw: sys::CUdeviceptr = 0;
        let result = if over_limit {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
        } else {
            // SAFETY: the device's context is current; `pool` is its default pool; `stream` is a
            // default stream or a live stream of this device (checked and pinned above); `raw` is a
            // valid out-parameter.
            unsafe {
                sys::cuMemAllocFromPoolAsync(&mut raw, size, self.pool, stream.0 as sys::CUstream)
            }
        };
        if result == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(self.out_of_memory(&state, size));
        }
        check("cuMemAllocFromPoolAsync", result)?;
        let captured = state.capture_underway;
        if state.ptrs.contains_key(&raw) {
            return Err(Error::Device(DeviceError::Driver {
                call: "cuMemAllocFromPoolAsync",
                code: sys::CUresult::CUDA_ERROR_ILLEGAL_STATE as i32,
                message: format!("returned {raw:#x}, which is already live in this allocator"),
            }));
        }
        state.ptrs.insert(
            raw,
            PtrUsage {
                size,
                stream,
                recorded: Vec::new(),
                captured,
            },
        );
        state.used += size as u64;
        Ok(DeviceAddress(raw))
    }

    /// PyTorch's out-of-memory error of this backend.
    #[cold]
    fn out_of_memory(&self, state: &State, size: usize) -> Error {
        let info = self.device.mem_info().unwrap_or_default();
        let limit = (state.limit != u64::MAX).then_some(state.limit);
        let message = format!(
            "Allocation on device {} would exceed allowed memory. (out of memory)\nCurrently allocated     \
             : {}\nRequested               : {}\nDevice limit            : {}\nFree (according to CUDA): \
             {}\nPyTorch limit (set by user-supplied memory fraction)\n                        : {}",
            self.device.ordinal(),
            format_size(state.used),
            format_size(size as u64),
            format_size(info.total),
            format_size(info.free),
            format_size(state.limit),
        );
        Error::OutOfMemory(Box::new(OutOfMemory {
            device: self.device.ordinal(),
            alloc_size: size as u64,
            device_total: info.total,
            device_free: info.free,
            allowed: limit,
            allocated: state.used,
            reserved: 0,
            private_pools: 0,
            processes: Vec::new(),
            source: OomSource::AsyncBackend,
            message,
        }))
    }

    /// Frees `ptr` (`cuMemFreeAsync`; PyTorch's `raw_delete`): on its allocation stream when no other
    /// stream was recorded, else on the unifying stream after it has waited for the allocation stream
    /// and every recorded stream. The null address is a no-op.
    ///
    /// During a capture, a pointer allocated outside it is not freed now (the driver forbids it) but once
    /// no capture is underway (at the next allocation), with PyTorch's warning; outside a capture, a
    /// pointer allocated inside one is freed with PyTorch's warning.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidPointer`] for a pointer this allocator did not hand out or already freed
    /// (nothing is done); driver errors.
    #[doc(alias = "cuMemFreeAsync")]
    pub fn free(&self, ptr: DeviceAddress) -> Result<()> {
        if ptr.0 == 0 {
            return Ok(());
        }
        let mut state = self.state.lock();
        let Some(usage) = state.ptrs.get(&ptr.0) else {
            return Err(Error::InvalidPointer { ptr });
        };
        if state.capture_underway {
            if !usage.captured {
                if !WARNED_UNCAPTURED_FREE.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %ptr,
                        "free was called on an uncaptured allocation during graph capture. This may be \
                         benign, but if the allocation is used by the capture, freeing it is an error, \
                         and may cause illegal memory accesses or memory corruption during graph replay"
                    );
                }
                state.deferred.push(ptr.0);
                return Ok(());
            }
        } else if usage.captured {
            tracing::warn!(
                %ptr,
                "attempting uncaptured free of a captured allocation. This is technically allowed, but \
                 may indicate you are losing the last user-visible handle through which the allocation \
                 can be accessed, so you'll have no way to view the data after future replays of the \
                 owning graph"
            );
        }
        self.free_impl(&mut state, ptr.0)
    }

    /// Queues the free of a live pointer and forgets it (PyTorch's `free_impl`). The pointer is
    /// forgotten even when a driver call fails, so that it is not freed twice.
    fn free_impl(&self, state: &mut State, ptr: u64) -> Result<()> {
        let Some(usage) = state.ptrs.remove(&ptr) else {
            return Err(Error::InvalidPointer {
                ptr: DeviceAddress(ptr),
            });
        };
        state.used = state.used.saturating_sub(usage.size as u64);
        self.device.make_current()?;
        let free_stream = if usage.recorded.is_empty() {
            usage.stream
        } else {
            let unifier = self.unifier.id();
            self.sync_streams(usage.stream, unifier)?;
            for &recorded in &usage.recorded {
                self.sync_streams(recorded, unifier)?;
            }
            unifier
        };
        // SAFETY: `ptr` came from `cuMemAllocFromPoolAsync` here and is freed once (it was just removed
        // from the live set); the device's context is current; `free_stream` is the allocation stream
        // (pinned when it was checked) or the unifying stream, which `self` keeps alive. Work queued on
        // the streams that use the memory is ordered before the free by the waits above.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, free_stream.0 as sys::CUstream)
        })?;
        if state.capture_underway && !state.capture_free_streams.contains(&free_stream) {
            state.capture_free_streams.push(free_stream);
        }
        Ok(())
    }

    /// Makes later work on `dependent` wait for the work queued so far on `dependency`, with a
    /// throw-away event (PyTorch's `sync_raw`). The device's context is current.
    fn sync_streams(&self, dependency: StreamId, dependent: StreamId) -> Result<()> {
        let event = BackendEvent::create_in_current_context(false)?;
        // SAFETY: `dependency` is a default stream of the current context (this device's) or a live
        // stream of this device pinned in the registry; the event was made in the same context.
        unsafe { event.record_raw(dependency.0 as sys::CUstream)? };
        // SAFETY: `dependent` is likewise live and of this device; the event is live (its destruction
        // is deferred by the driver until the wait no longer needs it).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(dependent.0 as sys::CUstream, event.as_raw(), 0)
        })?;
        Ok(())
    }

    /// Marks `ptr` as used by work on `stream` too (PyTorch's `recordStream`): its free will wait for
    /// the work queued on `stream` up to the free. Recording the allocation stream has no effect (with
    /// PyTorch's warning, once); recording a stream twice is the same as once; the null address is a
    /// no-op.
    ///
    /// Unlike PyTorch, `stream` must be a stream of this allocator's device.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidPointer`] for a pointer that is not live here; [`DeviceError::UnknownStream`]
    /// (in [`Error::Device`]) for a stream the backend does not know on this device.
    pub fn record_stream(&self, ptr: DeviceAddress, stream: StreamId) -> Result<()> {
        if ptr.0 == 0 {
            return Ok(());
        }
        registry::check_and_pin(self.device.ordinal(), stream)?;
        let mut state = self.state.lock();
        let Some(usage) = state.ptrs.get_mut(&ptr.0) else {
            return Err(Error::InvalidPointer { ptr });
        };
        if usage.stream == stream {
            if !WARNED_SAME_STREAM.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "called record_stream on an allocation whose original creation stream matches the \
                     recorded stream. This is unnecessary and has no effect"
                );
            }
        } else if !usage.recorded.contains(&stream) {
            usage.recorded.push(stream);
        }
        Ok(())
    }

    /// The size `ptr` was allocated with, if it is live here (PyTorch's `getBaseAllocation`: every
    /// pointer is its own base).
    #[must_use]
    pub fn allocation_size(&self, ptr: DeviceAddress) -> Option<usize> {
        self.state.lock().ptrs.get(&ptr.0).map(|u| u.size)
    }

    /// The number of live pointers.
    #[must_use]
    pub fn live_allocations(&self) -> usize {
        self.state.lock().ptrs.len()
    }

    /// Bytes handed out by this allocator and not freed (PyTorch's `pytorch_used_bytes`, which the
    /// memory fraction limits); unlike the pool's used memory, it leaves out other users of the pool.
    #[must_use]
    pub fn used_bytes(&self) -> u64 {
        self.state.lock().used
    }

    /// The driver's figures for the default pool and the graph-memory pool.
    ///
    /// # Errors
    ///
    /// Driver errors (a driver that does not report the graph-memory pool gives zeros there).
    #[doc(alias = "cuMemPoolGetAttribute")]
    #[doc(alias = "cuDeviceGetGraphMemAttribute")]
    pub fn pool_stats(&self) -> Result<AsyncPoolStats> {
        use sys::CUgraphMem_attribute as G;
        use sys::CUmemPool_attribute as P;
        self.device.make_current()?;
        let default_pool = PoolUsage {
            reserved_current: self.pool_attribute(P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.pool_attribute(P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: self.pool_attribute(P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.pool_attribute(P::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        };
        let graph_pool = PoolUsage {
            reserved_current: self.graph_attribute(G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.graph_attribute(G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
            used_current: self.graph_attribute(G::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            used_high: self.graph_attribute(G::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
        };
        Ok(AsyncPoolStats {
            default_pool,
            graph_pool,
        })
    }

    fn pool_attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: `pool` is live; the reserved/used attributes are `cuuint64_t`, which `value` holds.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(self.pool, attr, (&mut value as *mut u64).cast::<c_void>())
        })?;
        Ok(value)
    }

    fn graph_attribute(&self, attr: sys::CUgraphMem_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the device handle is valid; the four graph-memory attributes are `cuuint64_t`.
        let result = unsafe {
            sys::cuDeviceGetGraphMemAttribute(
                self.device.context().device(),
                attr,
                (&mut value as *mut u64).cast::<c_void>(),
            )
        };
        if result == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
            return Ok(0);
        }
        check("cuDeviceGetGraphMemAttribute", result)?;
        Ok(value)
    }

    /// `torch.cuda.memory_stats()` under `backend:cudaMallocAsync` (PyTorch 2.11's `getDeviceStats`):
    /// `allocated_bytes.all` and `active_bytes.all` are the default pool's used memory (current, and
    /// its high-water mark as peak), `reserved_bytes.all` its reserved memory; every other field is 0
    /// (`allocated`/`freed` included, and `max_split_size`). The pool is shared: other users of the
    /// device's default pool in the process count too, as in PyTorch. Memory of captured graphs is in
    /// the graph-memory pool ([`pool_stats`](Self::pool_stats)), which PyTorch 2.11 leaves out.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        Ok(Self::stats_from(&self.pool_stats()?.default_pool))
    }

    /// PyTorch's `DeviceStats` from a pool's figures (see [`memory_stats`](Self::memory_stats)).
    #[must_use]
    pub fn stats_from(pool: &PoolUsage) -> MemoryStats {
        MemoryStats::from_pool_usage(
            (pool.used_current, pool.used_high),
            (pool.reserved_current, pool.reserved_high),
        )
    }

    /// Resets the high-water marks to the current values (PyTorch's `resetPeakStats`: the pool's
    /// `RESERVED_MEM_HIGH` and `USED_MEM_HIGH` set to 0, which the driver takes as "to current"), and
    /// the graph-memory pool's as newer PyTorch does.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn reset_peak_stats(&self) -> Result<()> {
        use sys::CUgraphMem_attribute as G;
        use sys::CUmemPool_attribute as P;
        self.device.make_current()?;
        for attr in [
            P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            P::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: `pool` is live; the high-water attributes are `cuuint64_t` and accept 0.
            check("cuMemPoolSetAttribute", unsafe {
                sys::cuMemPoolSetAttribute(
                    self.pool,
                    attr,
                    (&mut zero as *mut u64).cast::<c_void>(),
                )
            })?;
        }
        for attr in [
            G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
            G::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the device handle is valid; the attribute is `cuuint64_t` and accepts 0.
            let result = unsafe {
                sys::cuDeviceSetGraphMemAttribute(
                    self.device.context().device(),
                    attr,
                    (&mut zero as *mut u64).cast::<c_void>(),
                )
            };
            if result != sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
                check("cuDeviceSetGraphMemAttribute", result)?;
            }
        }
        Ok(())
    }

    /// Has no effect (PyTorch warns once: "For backend:cudaMallocAsync, resetAccumulatedStats has no
    /// effect."): this backend keeps no accumulated statistics.
    pub fn reset_accumulated_stats(&self) {
        if !WARNED_ACCUMULATED.swap(true, Ordering::Relaxed) {
            tracing::warn!("for backend:cudaMallocAsync, reset_accumulated_stats has no effect");
        }
    }

    /// Returns the pool's unused memory to the device (PyTorch's `emptyCache`): waits for all work on
    /// the device (`cuCtxSynchronize`), so that pending frees have happened, then trims the pool to 0
    /// bytes kept (`cuMemPoolTrimTo`). Memory still allocated stays.
    ///
    /// # Errors
    ///
    /// Driver errors (including errors of earlier asynchronous work, which the synchronisation reports).
    #[doc(alias = "cuMemPoolTrimTo")]
    pub fn empty_cache(&self) -> Result<()> {
        let _state = self.state.lock();
        self.device.synchronize()?;
        // SAFETY: `pool` is live; trimming keeps every allocated range and releases only unused memory.
        check("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(self.pool, 0)
        })?;
        Ok(())
    }

    /// The device's free and total memory (`cuMemGetInfo`; `torch.cuda.mem_get_info`).
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn mem_info(&self) -> Result<MemInfo> {
        Ok(self.device.mem_info()?)
    }

    /// Limits the bytes this allocator hands out to `fraction` of the device's total memory (PyTorch's
    /// `setMemoryFraction` for this backend: a hard limit on its own used bytes, checked before each
    /// allocation; the pool itself is not limited).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidFraction`] outside `[0, 1]`; driver errors.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidFraction { fraction });
        }
        let total = self.device.mem_info()?.total;
        self.state.lock().limit = (fraction * total as f64) as u64;
        Ok(())
    }

    /// The limit [`set_memory_fraction`](Self::set_memory_fraction) set on the bytes this allocator
    /// hands out, or `None` when none was set (PyTorch's `pytorch_memory_limits`).
    #[must_use]
    pub fn memory_limit(&self) -> Option<u64> {
        let limit = self.state.lock().limit;
        (limit != u64::MAX).then_some(limit)
    }

    /// A rough guess of the largest workspace that can be allocated now on `stream` (PyTorch's
    /// `cacheInfo` for this backend, which cuDNN uses to size its workspace): starting from the
    /// smaller of the device's free memory and what the memory fraction leaves, halves the guess until
    /// a `cuMemAllocFromPoolAsync` of it succeeds (then frees it at once, on `stream`). 0 when nothing
    /// fits.
    ///
    /// # Errors
    ///
    /// [`DeviceError::UnknownStream`] (in [`Error::Device`]) for a stream the backend does not know;
    /// driver errors other than out of memory.
    #[doc(alias = "cacheInfo")]
    pub fn cache_info(&self, stream: StreamId) -> Result<u64> {
        registry::check_and_pin(self.device.ordinal(), stream)?;
        self.device.make_current()?;
        let state = self.state.lock();
        let free = self.device.mem_info()?.free;
        let mut guess = free.min(state.limit.saturating_sub(state.used));
        while guess > 0 {
            if state.used.saturating_add(guess) <= state.limit {
                let mut raw: sys::CUdeviceptr = 0;
                // SAFETY: as in `allocate`: the device's context is current, `pool` is its default
                // pool, `stream` was checked and pinned above, `raw` is a valid out-parameter.
                let result = unsafe {
                    sys::cuMemAllocFromPoolAsync(
                        &mut raw,
                        usize::try_from(guess).unwrap_or(usize::MAX),
                        self.pool,
                        stream.0 as sys::CUstream,
                    )
                };
                if result == sys::CUresult::CUDA_SUCCESS {
                    // SAFETY: `raw` was just allocated on `stream` and nothing else knows it.
                    check("cuMemFreeAsync", unsafe {
                        sys::cuMemFreeAsync(raw, stream.0 as sys::CUstream)
                    })?;
                    return Ok(guess);
                }
                if result != sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    check("cuMemAllocFromPoolAsync", result)?;
                }
            }
            guess >>= 1;
        }
        Ok(0)
    }

    /// Starts a graph capture's bookkeeping (PyTorch's `beginAllocateToPool` for this backend, which
    /// `torch.cuda.graph` calls before capturing): allocations are marked captured, frees of uncaptured
    /// pointers are deferred, free streams are remembered. Call it before `cuStreamBeginCapture`.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] (in [`Error::Device`]) when a capture is already underway: as in
    /// PyTorch, one capture at a time.
    pub fn begin_capture(&self) -> Result<()> {
        let mut state = self.state.lock();
        if state.capture_underway {
            return Err(Error::Device(DeviceError::Unsupported {
                what: "a second graph capture while one is underway with backend:cudaMallocAsync (only \
                       one capture at a time is allowed in a process); end the first with end_capture",
            }));
        }
        state.capture_free_streams.clear();
        state.capture_underway = true;
        Ok(())
    }

    /// Ends a capture's bookkeeping (PyTorch's `endAllocateToPool`): makes `capture_stream` wait for
    /// every stream a free was queued on during the capture, so that no free is left dangling outside
    /// the graph, then clears the capture flag. Call it before `cuStreamEndCapture`, with the stream the
    /// capture began on.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] (in [`Error::Device`]) when no capture is underway;
    /// [`DeviceError::UnknownStream`] for an unknown stream; driver errors (the flag is cleared even
    /// then).
    pub fn end_capture(&self, capture_stream: StreamId) -> Result<()> {
        let mut state = self.state.lock();
        if !state.capture_underway {
            return Err(Error::Device(DeviceError::Unsupported {
                what: "ending a graph capture with backend:cudaMallocAsync when none is underway \
                       (call begin_capture first)",
            }));
        }
        let streams = std::mem::take(&mut state.capture_free_streams);
        state.capture_underway = false;
        registry::check_and_pin(self.device.ordinal(), capture_stream)?;
        self.device.make_current()?;
        for stream in streams {
            self.sync_streams(stream, capture_stream)?;
        }
        Ok(())
    }

    /// Whether a capture is underway ([`begin_capture`](Self::begin_capture) without
    /// [`end_capture`](Self::end_capture) yet).
    #[must_use]
    pub fn is_capture_underway(&self) -> bool {
        self.state.lock().capture_underway
    }

    /// Lets kernels on `peer` access memory from this device's pool (`cuMemPoolSetAccess`; PyTorch's
    /// `enablePeerAccess` for this backend: memory pools are not covered by context peer access).
    ///
    /// # Errors
    ///
    /// Driver errors (for instance when the two devices cannot access each other).
    #[doc(alias = "cuMemPoolSetAccess")]
    pub fn enable_peer_access(&self, peer: &CudaBackend) -> Result<()> {
        // SAFETY: a plain C struct; all-zero bytes is a valid value, every field is set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = peer.context().device();
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: `pool` is live; `desc` is one valid access descriptor, read during the call only.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(self.pool, &desc, 1)
        })?;
        Ok(())
    }

    /// Refused, as PyTorch refuses it: memory of this backend cannot be shared with another process
    /// (`cudaMallocAsync does not yet support shareIpcHandle`). Exporting the default pool
    /// (`cuMemPoolExportToShareableHandle`) is impossible: the default pool is not created with an
    /// exportable handle type.
    ///
    /// # Errors
    ///
    /// Always [`DeviceError::Unsupported`] (in [`Error::Device`]).
    pub fn ipc_handle(&self, ptr: DeviceAddress) -> Result<Vec<u8>> {
        let _ = ptr;
        Err(Error::Device(DeviceError::Unsupported {
            what: "sharing memory of backend:cudaMallocAsync with another process (PyTorch: \
                   cudaMallocAsync does not yet support shareIpcHandle); allocate memory to be shared \
                   with the native caching allocator",
        }))
    }
}

impl Drop for AsyncAllocator {
    fn drop(&mut self) {
        let mut state = self.state.lock();
        state.capture_underway = false;
        state.deferred.clear();
        let live: Vec<u64> = state.ptrs.keys().copied().collect();
        for ptr in live {
            if let Err(error) = self.free_impl(&mut state, ptr) {
                tracing::warn!(%error, "freeing a live cudaMallocAsync pointer on drop failed");
            }
        }
    }
}
