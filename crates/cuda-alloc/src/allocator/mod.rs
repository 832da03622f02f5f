//! [`CachingAllocator`]: the caching allocator over a [`Device`].
//!
//! The policy follows PyTorch's `DeviceCachingAllocator` decision for decision; the state is split
//! by stream (see `shard.rs`) so that calls on different streams take different locks. The
//! methods are spread over submodules by concern:
//!
//! | module | what |
//! | --- | --- |
//! | `alloc` | the allocation path: best fit, splitting, new segments, the out-of-memory sequence |
//! | `free` | freeing, merging, `record_stream` events and their processing |
//! | `release` | returning memory to the device: cached blocks, garbage collection, `empty_cache` |
//! | `grow` | expandable segments: finding room, mapping and unmapping chunks |
//! | `private` | private pools (CUDA graphs) |
//! | `inspect` | statistics, snapshots, pointer lookups, the invariant walk |

mod alloc;
mod backup;
mod checkpoint;
mod export;
mod fast;
mod free;
mod grow;
mod hint;
mod inspect;
mod invariants;
pub(crate) mod policy;
mod private;
mod release;
mod shard;
mod sleep;
mod teardown;
mod uncached;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::config::AllocatorConfig;
use crate::device::{Device, DeviceAddress, StreamId};
use crate::error::{Error, Result};
use crate::events::EventQueues;
use crate::oom::{FreeMemoryCallback, OomObserver};
use crate::pool_id::MempoolId;
use crate::settings::Settings;
use crate::snapshot::{TraceAction, TraceEntry};
use crate::stack::{RecordContext, Stack};
use crate::stats::peaks::{Kind, PeakBook};
use crate::trace::{Record, TraceRecorder};
use shard::{Shard, ShardGuard, ShardState, StreamTable};

pub use backup::{AlwaysPinned, HostBackup, BACKUP_PIECE_BYTES};
pub use checkpoint::{CheckpointDelta, PoolCheckpoint};
pub use export::ShareableSegment;
pub use invariants::InvariantViolation;
pub(crate) use private::PrivatePool;
pub use sleep::{SleepReport, WakeReport};

/// An out-of-memory observer as kept (cloned out of the list before being called).
pub(crate) type SharedObserver = Arc<dyn Fn(&crate::oom::OomEvent) + Send + Sync>;

/// A fresh allocator identity (1, 2, ...; 0 is never handed out).
fn next_allocator_id() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    loop {
        let id = NEXT.fetch_add(1, Relaxed);
        if id != 0 {
            return id;
        }
    }
}

/// The environment variable that switches the fast path off in every allocator made afterwards:
/// `TENSORMEM_FAST_PATH=0` (see [`CachingAllocator::set_fast_path_enabled`]). For comparing a
/// program's or a replay's results with the plain path's, without changing its code.
pub const FAST_PATH_ENV: &str = "TENSORMEM_FAST_PATH";

/// Whether the environment leaves the fast path on (anything but `TENSORMEM_FAST_PATH=0`).
fn fast_path_by_env() -> bool {
    std::env::var_os(FAST_PATH_ENV).is_none_or(|value| value != "0")
}

/// How many distinct streams an allocator serves unless told otherwise.
pub const DEFAULT_STREAM_CAPACITY: usize = 1024;

/// Memory handed out by [`CachingAllocator::allocate`]: the pointer, and what the allocator needs to
/// take it back without looking it up.
///
/// Every `allocate` needs a `free`: give it back with [`CachingAllocator::free`] (which consumes it,
/// so it cannot be freed twice), or give it up with [`Allocation::into_ptr`] to manage the memory by
/// pointer with [`CachingAllocator::raw_free`]. Dropping it keeps the memory allocated until the
/// allocator is dropped (which returns everything to the device); debug builds report the first
/// such drop (a `tracing` warning). For a handle that frees itself when dropped, on every backend,
/// use [`CachingAllocator::allocate_owned`] / [`allocate_shared`](CachingAllocator::allocate_shared)
/// ([`OwnedAllocation`](crate::OwnedAllocation)); on the CUDA backend, `CachedSlice` also hands the
/// memory to cudarc.
#[must_use = "dropping an Allocation leaks the memory; pass it to CachingAllocator::free"]
#[derive(Debug, PartialEq, Eq)]
// The field order `handed_out` writes in three 16-byte stores.
#[repr(C)]
pub struct Allocation {
    ptr: DeviceAddress,
    size: usize,
    requested: usize,
    stream: StreamId,
    /// The [`CachingAllocator::id`] of the allocator that handed it out (0 for the null allocation,
    /// which any allocator takes back).
    allocator: u32,
    shard: u32,
    block: u32,
    generation: u32,
}

impl Allocation {
    /// The "no block" marker of zero-sized allocations.
    const EMPTY: u32 = u32::MAX;
    /// The shard marker of allocations made while caching was off (`uncached.rs`), which belong to
    /// no shard; their block field holds the handle's serial number.
    const UNCACHED: u32 = u32::MAX - 1;

    /// A handle to block `block` (of generation `generation`) of shard `shard`, handed out by
    /// allocator `allocator`.
    ///
    /// On x86-64 the handle is written as three 16-byte stores, the width at which callers copy it
    /// (a `Result<Allocation>` or an `Allocation` moved into a variable, a vector, a call). Written
    /// field by field (eight stores of 4 or 8 bytes), every such 16-byte load right after the return
    /// spanned several pending stores, which the store buffer cannot forward: the load waits for
    /// the stores to reach the cache (docs/allocator-internals.md, "Wide handle stores"). The type
    /// keeps its natural 8-byte alignment: a 16-byte alignment, measured paired against it, did not
    /// pay.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the handle's fields, each a plain value
    pub(crate) fn handed_out(
        ptr: u64,
        size: u64,
        requested: u64,
        stream: StreamId,
        allocator: u32,
        shard: u32,
        block: u32,
        generation: u32,
    ) -> Self {
        #[cfg(all(target_arch = "x86_64", not(tensormem_ab_no_sse2_handles)))]
        {
            use std::arch::x86_64::{__m128i, _mm_set_epi32, _mm_set_epi64x, _mm_storeu_si128};
            let mut out = std::mem::MaybeUninit::<Allocation>::uninit();
            let at = out.as_mut_ptr().cast::<__m128i>();
            // SAFETY: SSE2 is part of the x86-64 baseline, so the intrinsics are available. `Allocation`
            // is `repr(C)`: four 8-byte fields (`DeviceAddress`, `usize` twice, `StreamId`, each one
            // `u64` on x86-64) then four `u32`, 48 bytes with no padding, so the three unaligned
            // 16-byte stores at offsets 0, 16 and 32 write exactly its bytes, in field order (little
            // endian: the first lane is the lower address). Every field is a plain integer, valid for
            // any bits, and all 48 bytes are written before `assume_init`.
            unsafe {
                _mm_storeu_si128(at, _mm_set_epi64x(size as i64, ptr as i64));
                _mm_storeu_si128(at.add(1), _mm_set_epi64x(stream.0 as i64, requested as i64));
                _mm_storeu_si128(
                    at.add(2),
                    _mm_set_epi32(
                        generation as i32,
                        block as i32,
                        shard as i32,
                        allocator as i32,
                    ),
                );
                out.assume_init()
            }
        }
        #[cfg(any(not(target_arch = "x86_64"), tensormem_ab_no_sse2_handles))]
        Allocation {
            ptr: DeviceAddress(ptr),
            size: size as usize,
            requested: requested as usize,
            stream,
            allocator,
            shard,
            block,
            generation,
        }
    }

    fn empty(stream: StreamId) -> Self {
        Allocation {
            ptr: DeviceAddress(0),
            allocator: 0,
            size: 0,
            requested: 0,
            stream,
            shard: Self::EMPTY,
            block: Self::EMPTY,
            generation: 0,
        }
    }

    /// The device address (null for a zero-sized allocation).
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        self.ptr
    }

    /// The size of the block handed out (the request rounded up; exactly the request while caching
    /// is off).
    #[must_use]
    pub fn size(&self) -> usize {
        self.size
    }

    /// The size asked for.
    #[must_use]
    pub fn requested_size(&self) -> usize {
        self.requested
    }

    /// The stream the memory was allocated on.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The [`id`](CachingAllocator::id) of the allocator that handed it out (0 for a zero-sized
    /// allocation, which belongs to no allocator).
    #[must_use]
    pub fn allocator_id(&self) -> u32 {
        self.allocator
    }

    /// Gives up the handle and returns the pointer; free it later with
    /// [`CachingAllocator::raw_free`].
    #[must_use]
    pub fn into_ptr(self) -> DeviceAddress {
        std::mem::ManuallyDrop::new(self).ptr
    }
}

/// The debug-build check that every handle is freed or given up (see [`Allocation`]): the first
/// handle dropped unfreed in the process is reported (a `tracing` warning; the memory is not lost, it
/// returns to the device when the allocator is dropped).
#[cfg(debug_assertions)]
impl Drop for Allocation {
    fn drop(&mut self) {
        static REPORTED: AtomicBool = AtomicBool::new(false);
        if self.shard != Self::EMPTY && !REPORTED.swap(true, Relaxed) {
            tracing::warn!(
                ptr = %self.ptr,
                size = self.size,
                "an Allocation was dropped without being freed: its memory stays allocated until the \
                 allocator is dropped; pass it to CachingAllocator::free, or give up the handle with \
                 Allocation::into_ptr (reported once, in debug builds)"
            );
        }
    }
}

/// Device-wide counters that change only on rare paths.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Bytes reserved from the device (PyTorch's `total_allocated_memory`).
    pub(crate) reserved: AtomicU64,
    /// The part of `reserved` whose device allocation is under way without its shard's lock
    /// (`release_lock_on_cudamalloc`): counted already, in no shard yet. Changed only under that
    /// lock, so a walk holding every lock sees it agree with `reserved`.
    pub(crate) reserving: AtomicU64,
    /// Whether a memory fraction is set, and the resulting limit.
    pub(crate) set_fraction: AtomicBool,
    pub(crate) allowed: AtomicU64,
    pub(crate) num_alloc_retries: AtomicI64,
    pub(crate) num_ooms: AtomicI64,
    pub(crate) num_sync_all_streams: AtomicI64,
    pub(crate) num_device_alloc: AtomicI64,
    pub(crate) num_device_free: AtomicI64,
}

/// Which pool a request goes to, decided before the stream's lock is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolChoice {
    Default,
    Private(MempoolId),
}

/// Where a device range lives: the shard that owns the segment or reservation starting there.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Route {
    pub(crate) end: u64,
    pub(crate) shard: u32,
}

/// A capture underway: allocations on streams the filter accepts go to the private pool.
pub(crate) struct Capture {
    pub(crate) pool: MempoolId,
    pub(crate) filter: Box<dyn Fn(StreamId) -> bool + Send + Sync>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// A caching allocator for one device with PyTorch's semantics. See the [crate documentation](crate).
///
/// `Send + Sync`: every method takes `&self` and may be called from any thread.
pub struct CachingAllocator<D: Device> {
    /// This allocator's identity, stamped on every [`Allocation`] it hands out.
    pub(crate) id: u32,
    pub(crate) device: D,
    pub(crate) settings: Settings,
    pub(crate) streams: StreamTable<D>,
    pub(crate) book: PeakBook,
    pub(crate) trace: TraceRecorder,
    /// Outstanding events; taken after a shard lock, never before one.
    pub(crate) events: Mutex<EventQueues<D::Event>>,
    /// Allocations made while caching was off (`uncached.rs`); a leaf lock.
    pub(crate) uncached: Mutex<uncached::UncachedBook<D::Event>>,
    /// Entries in `events` (checked without its lock on every allocation).
    pub(crate) pending: CachePadded<AtomicUsize>,
    /// Number of captures underway (checked without a lock on every allocation).
    pub(crate) captures_active: CachePadded<AtomicUsize>,
    pub(crate) captures: RwLock<Vec<Capture>>,
    pub(crate) private: Mutex<BTreeMap<MempoolId, PrivatePool>>,
    /// Private pools asleep or on their way to sleep or to wake (see `sleep`).
    pub(crate) asleep: sleep::SleepBook,
    pub(crate) counters: CachePadded<Counters>,
    pub(crate) routes: RwLock<BTreeMap<u64, Route>>,
    /// Whether shards index their allocated blocks by pointer (turned on by the first pointer-based
    /// call; see `enable_pointer_index`).
    pub(crate) pointer_index: AtomicBool,
    pub(crate) callbacks: RwLock<Vec<Arc<dyn FreeMemoryCallback>>>,
    pub(crate) observers: RwLock<Vec<SharedObserver>>,
    /// Serialises device-wide passes (release, garbage collection, snapshots); taken before any shard
    /// lock.
    pub(crate) maintenance: Mutex<()>,
    small_clock: Arc<AtomicU64>,
    large_clock: Arc<AtomicU64>,
    max_split_size_at_start: i64,
    /// Whether new shards start with the fast path on (see
    /// [`set_fast_path_enabled`](Self::set_fast_path_enabled)); changed under `maintenance`.
    fast_path: AtomicBool,
    /// Frees that took the express lane (`fast/express.rs`), for the tests that check it is taken.
    #[cfg(test)]
    pub(crate) express_frees: std::sync::atomic::AtomicU64,
}

impl<D: Device> std::fmt::Debug for CachingAllocator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.device.index())
            .field("streams", &self.streams.iter().count())
            .field("reserved", &self.counters.reserved.load(Relaxed))
            .finish_non_exhaustive()
    }
}

/// A shard with its lock held, and the allocator it belongs to: the receiver of the per-stream
/// policy code.
pub(crate) struct Locked<'a, D: Device> {
    pub(crate) a: &'a CachingAllocator<D>,
    pub(crate) shard: &'a Shard<D>,
    pub(crate) st: ShardGuard<'a, ShardState<D>>,
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator with PyTorch's default settings.
    pub fn new(device: D) -> Self {
        Self::with_config(device, AllocatorConfig::default())
    }

    /// An allocator with the given settings. A `backend` other than native is not implemented: the
    /// native allocator serves, with a warning, and [`config`](Self::config) says `native` (the
    /// fallible [`from_env`](Self::from_env) and [`apply_settings`](Self::apply_settings) refuse it).
    pub fn with_config(device: D, config: AllocatorConfig) -> Self {
        Self::with_stream_capacity(device, config, DEFAULT_STREAM_CAPACITY)
    }

    /// An allocator with settings read from the environment (`TENSORMEM_ALLOC_CONF`, then PyTorch's
    /// variables; see [`AllocatorConfig::from_env`]).
    ///
    /// # Errors
    /// [`Error::Config`] when the variable holds a malformed configuration, or one asking for a backend
    /// other than the native one ([`ConfigError::UnsupportedBackend`](crate::config::ConfigError)).
    pub fn from_env(device: D) -> Result<Self> {
        let allocator = Self::with_config(device, AllocatorConfig::from_env()?);
        allocator.set_caching_disabled(crate::config::caching_disabled_by_env());
        Ok(allocator)
    }

    /// An allocator with the given settings serving at most `streams` distinct streams.
    pub fn with_stream_capacity(device: D, config: AllocatorConfig, streams: usize) -> Self {
        let fraction = config.per_process_memory_fraction;
        let allocator = CachingAllocator {
            id: next_allocator_id(),
            max_split_size_at_start: config.max_split_size as i64,
            settings: Settings::new(&config),
            device,
            streams: StreamTable::new(streams),
            book: PeakBook::default(),
            trace: TraceRecorder::default(),
            events: Mutex::new(EventQueues::default()),
            uncached: Mutex::new(uncached::UncachedBook::default()),
            pending: CachePadded::new(AtomicUsize::new(0)),
            captures_active: CachePadded::new(AtomicUsize::new(0)),
            captures: RwLock::new(Vec::new()),
            private: Mutex::new(BTreeMap::new()),
            asleep: sleep::SleepBook::default(),
            counters: CachePadded::new(Counters::default()),
            routes: RwLock::new(BTreeMap::new()),
            pointer_index: AtomicBool::new(false),
            callbacks: RwLock::new(Vec::new()),
            observers: RwLock::new(Vec::new()),
            maintenance: Mutex::new(()),
            small_clock: Arc::new(AtomicU64::new(0)),
            large_clock: Arc::new(AtomicU64::new(0)),
            fast_path: AtomicBool::new(fast_path_by_env()),
            #[cfg(test)]
            express_frees: std::sync::atomic::AtomicU64::new(0),
        };
        if fraction < 1.0 {
            if let Err(e) = allocator.set_memory_fraction(fraction) {
                tracing::warn!(error = %e, "per_process_memory_fraction not applied");
            }
        }
        allocator
    }

    /// This allocator's identity, unique in the process (never 0): every [`Allocation`] carries the id
    /// of the allocator that made it, and the others refuse it.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Checks that `allocation` was handed out by this allocator.
    #[inline]
    pub(crate) fn check_owner(&self, allocation: &Allocation) -> Result<()> {
        if allocation.allocator == self.id {
            Ok(())
        } else {
            Err(Error::ForeignAllocation {
                ptr: allocation.ptr,
                owner: allocation.allocator,
                this: self.id,
            })
        }
    }

    /// The device this allocator serves.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The current settings.
    #[must_use]
    pub fn config(&self) -> AllocatorConfig {
        self.settings.config()
    }

    /// Replaces the settings at run time; calls that start afterwards use them. A `backend` other than
    /// native is ignored with a warning, as in [`with_config`](Self::with_config).
    pub fn set_config(&self, config: &AllocatorConfig) {
        self.settings.set(config);
    }

    /// Applies a configuration string at run time the way `torch.cuda.memory._set_allocator_settings`
    /// does (see [`AllocatorConfig::apply`]).
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed string, or one asking for a backend other than the native one
    /// ([`ConfigError::UnsupportedBackend`](crate::config::ConfigError)); the settings are then
    /// unchanged.
    pub fn apply_settings(&self, config: &str) -> Result<()> {
        let mut next = self.settings.config();
        next.apply(config)?;
        self.set_settings(&next)
    }

    /// Replaces the settings with `config`'s (rounding, splitting, garbage collection, expandable
    /// segments and the other settings PyTorch reads at run time), as
    /// [`apply_settings`](Self::apply_settings) does with the configuration its string makes.
    /// The memory fraction is set apart ([`set_memory_fraction`](Self::set_memory_fraction)).
    ///
    /// # Errors
    /// [`Error::Config`] for a configuration asking for a backend other than the native one
    /// ([`ConfigError::UnsupportedBackend`](crate::config::ConfigError)); the settings are then
    /// unchanged.
    pub fn set_settings(&self, config: &AllocatorConfig) -> Result<()> {
        config.check_supported()?;
        self.settings.set(config);
        Ok(())
    }

    /// Turns caching off (`true`) or back on, for debugging memory errors
    /// (`PYTORCH_NO_CUDA_MEMORY_CACHING`, read by [`from_env`](Self::from_env)), as PyTorch's
    /// `forceUncachedAllocator` does: while off, every allocation is a device allocation of exactly
    /// the size asked for (`cuMemAlloc(size)`: no rounding, never split, never an expandable segment),
    /// so that tools such as compute-sanitizer see each allocation's bounds, and freeing returns it
    /// to the device (`cuMemFree`).
    ///
    /// As in PyTorch, these allocations are outside the allocator's books: they count in no statistic
    /// ([`memory_stats`](Self::memory_stats) stays as it was: all zero if caching was off from the
    /// start), make no trace entry, appear in no snapshot, and are not held to the memory fraction.
    /// Unlike PyTorch (whose `cudaFree` waits for the whole device), stream safety is kept: memory
    /// used on other streams ([`record_stream`](Self::record_stream)) goes back to the device once
    /// their work recorded before the free has completed (checked at the next uncached allocation,
    /// and waited for by [`empty_cache`](Self::empty_cache)). They can still be freed by pointer,
    /// recorded on streams and shared with other processes ([`base_allocation`](Self::base_allocation)
    /// gives the allocation itself). Requests for a private pool (a graph capture, a `MemPool`
    /// context) are served by the pool as with caching on. Blocks cached before caching was turned
    /// off stay until [`empty_cache`](Self::empty_cache); allocations made while it was off stay
    /// outside the books when it is turned back on, until freed.
    pub fn set_caching_disabled(&self, disabled: bool) {
        self.settings.set_uncached(disabled);
    }

    /// Whether caching is off (see [`set_caching_disabled`](Self::set_caching_disabled)).
    #[must_use]
    pub fn is_caching_disabled(&self) -> bool {
        self.settings.uncached()
    }

    /// Turns the fast path on (the default) or off. The fast path is a cache of the plain path's
    /// answers for hot pairs (the same size allocated and freed again and again on one stream): a
    /// free defers its merge, and the next allocation of that size takes the block back where the
    /// plain path would choose exactly it. Off, every call takes the plain path. Either way every
    /// address, error, statistic and snapshot is the same (the tests, the fuzz target and the
    /// replay tests check it by running both); off is slower, and is for that comparison and for
    /// ruling the fast path out when hunting a bug. New allocators start with it on unless the
    /// environment says otherwise ([`FAST_PATH_ENV`]).
    pub fn set_fast_path_enabled(&self, enabled: bool) {
        let (_pass, mut locks) = self.lock_all();
        self.fast_path.store(enabled, Relaxed);
        for locked in &mut locks {
            locked.st.fast.set_enabled(enabled);
        }
    }

    /// Whether the fast path is on (see [`set_fast_path_enabled`](Self::set_fast_path_enabled)).
    #[must_use]
    pub fn is_fast_path_enabled(&self) -> bool {
        self.fast_path.load(Relaxed)
    }

    /// Limits the memory this allocator reserves to `fraction` of the device's total memory
    /// (`torch.cuda.set_per_process_memory_fraction`).
    ///
    /// # Errors
    /// [`Error::InvalidFraction`] outside `[0, 1]`; [`Error::Device`] if the device's memory cannot be
    /// queried.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidFraction { fraction });
        }
        let total = self.device.mem_info()?.total;
        self.counters
            .allowed
            .store((fraction * total as f64) as u64, Relaxed);
        self.counters.set_fraction.store(true, Relaxed);
        Ok(())
    }

    /// The memory fraction in force (1.0 when none was set).
    ///
    /// # Errors
    /// [`Error::Device`] if the device's memory cannot be queried.
    pub fn memory_fraction(&self) -> Result<f64> {
        if !self.counters.set_fraction.load(Relaxed) {
            return Ok(1.0);
        }
        let total = self.device.mem_info()?.total;
        Ok(self.counters.allowed.load(Relaxed) as f64 / total as f64)
    }

    /// Registers a callback asked to free memory when no cached block fits a request (PyTorch's
    /// `FreeCudaMemoryCallbacksRegistry`; the CUDA IPC layer registers one).
    pub fn add_free_memory_callback(&self, callback: Arc<dyn FreeMemoryCallback>) {
        self.callbacks.write().push(callback);
    }

    /// Registers a function told about every out-of-memory error.
    pub fn attach_oom_observer(&self, observer: OomObserver) {
        self.observers.write().push(Arc::from(observer));
    }

    /// Turns the trace ring buffer on or off (`torch.cuda.memory._record_memory_history`); turning it
    /// off clears it. `max_entries` is at least 1.
    pub fn record_history(&self, enabled: bool, max_entries: usize) {
        self.trace
            .configure(enabled, max_entries, RecordContext::Never);
    }

    /// [`record_history`](Self::record_history) keeping call stacks as `context` says
    /// (`torch.cuda.memory._record_memory_history(context=...)`): `State`, the stack of each live
    /// allocation (snapshot blocks' `frames`); `Alloc`, also on the allocation's trace entries; `All`,
    /// also the freeing call's stack on free entries. Stacks are captured unresolved (a few
    /// microseconds per allocation) and symbolized when a snapshot or the trace is read (feature
    /// `stacks`; without it no frames are recorded).
    pub fn record_history_with_context(
        &self,
        enabled: bool,
        max_entries: usize,
        context: RecordContext,
    ) {
        self.trace.configure(enabled, max_entries, context);
    }

    /// The context level history is recorded with (`Never` while it is off).
    #[must_use]
    pub fn history_context(&self) -> RecordContext {
        self.trace.context()
    }

    /// Whether the trace ring buffer is recording.
    #[must_use]
    pub fn is_history_enabled(&self) -> bool {
        self.trace.enabled()
    }

    /// Attaches a function told about every trace entry from now on (PyTorch's
    /// `attachAllocatorTraceTracker`): allocations, frees, segment allocations and releases, mappings,
    /// out-of-memory errors, annotations; whether or not [`record_history`](Self::record_history) is on.
    /// The tracker runs with the allocator's locks held and must not call into this allocator (see
    /// [`TraceTracker`](crate::TraceTracker)).
    pub fn attach_allocator_trace_tracker(&self, tracker: crate::TraceTracker) {
        self.trace.attach(tracker);
    }

    /// Adds a user annotation to the trace (when recording, or when a tracker is attached).
    pub fn record_annotation(&self, name: impl Into<String>) {
        if self.trace.wanted() {
            self.trace.push(Record {
                action: TraceAction::UserDefined,
                addr: 0,
                size: 0,
                stream: StreamId(0),
                time_us: crate::trace::now_us(),
                user_metadata: Some(name.into().into_boxed_str()),
                stack: None,
                // An annotation concerns no pool.
                pool: None,
            });
        }
    }

    /// The trace ring buffer's entries, oldest first, as snapshots carry them.
    #[must_use]
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.trace.entries()
    }

    /// The shard of `stream`, made on first use.
    #[inline]
    pub(crate) fn shard(&self, stream: StreamId) -> Result<&Shard<D>> {
        if let Some(shard) = self.streams.get(stream) {
            return Ok(shard);
        }
        self.new_shard(stream)
    }

    /// Makes the shard of a stream seen for the first time. A new shard waits for any device-wide
    /// pass underway (`maintenance`): a pass sees every shard there is, so that device-wide figures
    /// (the reserved counter, statistics) agree with the shards it locked.
    #[cold]
    #[inline(never)]
    fn new_shard(&self, stream: StreamId) -> Result<&Shard<D>> {
        // A stream the backend does not know never gets a shard (nor, later, an event).
        self.device.check_stream(stream)?;
        let _pass = self.maintenance.lock();
        self.streams
            .get_or_insert(stream, || {
                (
                    Arc::clone(&self.small_clock),
                    Arc::clone(&self.large_clock),
                    self.fast_path.load(Relaxed),
                )
            })
            .ok_or(Error::TooManyStreams {
                stream,
                capacity: self.streams.capacity(),
            })
    }

    /// Takes `shard`'s lock, with a deferred merge carried out (see `fast`).
    #[inline]
    pub(crate) fn lock<'a>(&'a self, shard: &'a Shard<D>) -> Locked<'a, D> {
        Locked {
            a: self,
            shard,
            st: shard.lock_settled(),
        }
    }

    /// Takes `shard`'s lock leaving a deferred merge as it is: only for the allocation path, which
    /// asks `Locked::unpark` first and settles otherwise, and the invariant walk.
    #[inline]
    pub(crate) fn lock_unsettled<'a>(&'a self, shard: &'a Shard<D>) -> Locked<'a, D> {
        Locked {
            a: self,
            shard,
            st: shard.state.lock(),
        }
    }

    /// Takes the maintenance lock and every shard's lock, in stream order.
    pub(crate) fn lock_all(&self) -> (MutexGuard<'_, ()>, Vec<Locked<'_, D>>) {
        let guard = self.maintenance.lock();
        let locks = self
            .streams
            .in_stream_order()
            .into_iter()
            .map(|shard| self.lock(shard))
            .collect();
        (guard, locks)
    }

    /// [`lock_all`](Self::lock_all) leaving parked blocks as they are: for the invariant walk,
    /// which checks the fast path's state rather than settling it.
    pub(crate) fn lock_all_unsettled(&self) -> (MutexGuard<'_, ()>, Vec<Locked<'_, D>>) {
        let guard = self.maintenance.lock();
        let locks = self
            .streams
            .in_stream_order()
            .into_iter()
            .map(|shard| self.lock_unsettled(shard))
            .collect();
        (guard, locks)
    }

    /// Whether garbage collection runs (a memory fraction is set and the threshold is positive).
    #[inline]
    pub(crate) fn gc_enabled(&self) -> bool {
        self.counters.set_fraction.load(Relaxed)
            & (self.settings.garbage_collection_threshold() > 0.0)
    }

    /// Whether a call starting now may run *quiet*: no trace recording, no trace tracker (so no
    /// entry and no stack is wanted) and no graph capture. The hot paths are compiled twice, with
    /// these checks constant in the quiet copy; a call that starts quiet stays so, as if a switch
    /// flipped meanwhile had come right after it (the flags are read without a lock either way).
    #[inline(always)]
    pub(crate) fn quiet(&self) -> bool {
        !self.trace.wanted() && !self.capturing()
    }

    /// Whether any graph capture is underway.
    #[inline]
    pub(crate) fn capturing(&self) -> bool {
        self.captures_active.load(Relaxed) != 0
    }
}

impl<D: Device> Locked<'_, D> {
    /// The statistics of handing out a block of `size` bytes for a request of `requested`.
    #[inline]
    pub(crate) fn inc_alloc(&self, small: bool, size: u64, requested: u64) {
        self.shard
            .figures
            .on_alloc(small, size, requested, &self.a.book, &self.a.streams);
    }

    /// Adds `amount` to statistic `kind` for all pools and for the pool type.
    #[inline]
    pub(crate) fn inc(&self, kind: Kind, small: bool, amount: u64) {
        self.shard
            .figures
            .increase_kind(kind, small, amount, &self.a.book, &self.a.streams);
    }

    /// Subtracts `amount` from statistic `kind` for all pools and for the pool type.
    #[inline]
    pub(crate) fn dec(&self, kind: Kind, small: bool, amount: u64) {
        self.shard
            .figures
            .decrease_kind(kind, small, amount, &self.a.book);
    }

    /// [`dec`](Self::dec) without the look at the book's list of loose shards, for a caller that
    /// covers it (see
    /// [`Figures::decrease_kind_covered`](crate::stats::peaks::Figures::decrease_kind_covered)).
    #[inline(always)]
    pub(crate) fn dec_covered(&self, kind: Kind, small: bool, amount: u64) {
        self.shard
            .figures
            .decrease_kind_covered(kind, small, amount);
    }

    /// Adds to a single figure (the oversize counts).
    #[inline]
    pub(crate) fn inc_figure(&self, figure: usize, amount: u64) {
        self.shard
            .figures
            .increase(figure, amount, &self.a.book, &self.a.streams);
    }

    /// Records a trace entry for this shard's stream about memory of pool `pool` (an index in the
    /// shard's pool table; its id is looked up only when the entry is wanted).
    #[inline]
    pub(crate) fn record(&self, action: TraceAction, addr: u64, size: u64, pool: u16) {
        self.record_with(action, addr, size, pool, None);
    }

    /// [`record_with`](Self::record_with) in a call that runs `QUIET` (see
    /// [`CachingAllocator::quiet`]): nothing there, the check folded away.
    #[inline(always)]
    pub(crate) fn note<const QUIET: bool>(
        &self,
        action: TraceAction,
        addr: u64,
        size: u64,
        pool: u16,
        stack: Option<&Stack>,
    ) {
        if !QUIET {
            self.record_with(action, addr, size, pool, stack);
        }
    }

    /// Whether a call that runs `QUIET` may take the fast path's express lane, which writes no
    /// trace entry and keeps no stack: quiet calls only. A `--cfg tensormem_ab_no_quiet_twins` build
    /// runs every call as the other twin, so there it reads the flags (without a lock, as the twins'
    /// choice does) here instead.
    #[inline(always)]
    pub(crate) fn express_open<const QUIET: bool>(&self) -> bool {
        QUIET || (cfg!(tensormem_ab_no_quiet_twins) && self.a.quiet())
    }

    /// Records a trace entry about memory of pool `pool` with its call stack (kept at context level
    /// `Alloc` and above).
    #[inline]
    pub(crate) fn record_with(
        &self,
        action: TraceAction,
        addr: u64,
        size: u64,
        pool: u16,
        stack: Option<&Stack>,
    ) {
        let pools = &self.st.pools;
        self.a
            .trace
            .record_with(action, addr, size, self.shard.stream, stack, || {
                pools
                    .get(usize::from(pool))
                    .and_then(crate::pool::Pool::trace_id)
            });
    }

    /// The pool index for a request of the given size class.
    #[inline]
    pub(crate) fn pool_index(&mut self, choice: PoolChoice, small: bool) -> u16 {
        match choice {
            PoolChoice::Default => {
                if small {
                    shard::SMALL_POOL
                } else {
                    shard::LARGE_POOL
                }
            }
            PoolChoice::Private(id) => {
                let private = &self.a.private;
                let part = self.st.private_pool_or_insert(id, small, || {
                    private.lock().get(&id).map(|p| p.part(id, small))
                });
                // The capture ended and its pool was released and emptied while this call was on
                // its way here: it behaves as if it came after the capture, from the default pools.
                part.unwrap_or(if small {
                    shard::SMALL_POOL
                } else {
                    shard::LARGE_POOL
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Allocation::handed_out` writes the handle as three 16-byte stores on x86-64: each field must
    /// land where the field-by-field construction puts it, including values whose high bits are set.
    #[test]
    fn a_handle_written_in_wide_stores_holds_every_field() {
        let wide = Allocation::handed_out(
            0x7f12_a400_1200,
            64 << 30,
            (64 << 30) - 511,
            StreamId(0xdead_beef_0000_0001),
            0x8000_0007,
            3,
            0xffff_fffe,
            0x8000_0001,
        );
        let by_field = Allocation {
            ptr: DeviceAddress(0x7f12_a400_1200),
            size: 64 << 30,
            requested: (64 << 30) - 511,
            stream: StreamId(0xdead_beef_0000_0001),
            allocator: 0x8000_0007,
            shard: 3,
            block: 0xffff_fffe,
            generation: 0x8000_0001,
        };
        assert_eq!(std::mem::size_of::<Allocation>(), 48);
        assert_eq!(wide, by_field);
        assert_eq!(wide.ptr(), DeviceAddress(0x7f12_a400_1200));
        assert_eq!(wide.size(), 64 << 30);
        assert_eq!(wide.requested_size(), (64 << 30) - 511);
        assert_eq!(wide.stream(), StreamId(0xdead_beef_0000_0001));
        // Neither names a block of a real allocator: nothing to free.
        std::mem::forget(wide);
        std::mem::forget(by_field);
    }
}
