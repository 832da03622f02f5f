//! Memory pools (`torch.cuda.MemPool`, `torch.cuda.use_mem_pool`): private pools of a device's
//! caching allocator that allocations are sent to on purpose, with PyTorch's options
//! (`use_on_oom`, `no_split`, an allocator of their own). Under `backend:cudaMallocAsync` there are
//! none: making one is refused with PyTorch's error, so there is nothing to send allocations to.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::{CachingAllocator, MempoolId, PoolAllocator, PoolOptions};

use super::backend::{backend_supports, device_allocator, AsyncUnsupported};
use super::device::resolve;
use super::error::Result;

/// The next pool id's second half. PyTorch numbers the pools of `torch.cuda.MemPool` `(0, 1)`,
/// `(0, 2)`, ... in each process; these start at 2^63 so that a process that also runs PyTorch on
/// tensormem (whose allocators are these) never sees one id twice.
static NEXT_ID: AtomicU64 = AtomicU64::new(1 << 63);

/// A memory pool of one device (`torch.cuda.MemPool`): a private pool of the device's caching
/// allocator, made with one user (this value) and given up when it is dropped. Allocations go to it
/// while a [`use_mem_pool`] guard of it is alive, on the thread that holds the guard.
///
/// Its blocks serve only allocations sent to it, except with
/// [`use_on_oom`](PoolOptions::use_on_oom): then allocations outside any pool use its free blocks
/// as a last resort before out-of-memory. With [`no_split`](PoolOptions::no_split) its blocks are
/// never split; with [`allocator`](PoolOptions::allocator) its segments come from that allocator
/// rather than the driver (PyTorch's `MemPool(allocator=CUDAPluggableAllocator(...))`).
///
/// Dropping it does what PyTorch's destructor does: it turns `use_on_oom` off, gives the pool up,
/// and returns its cached blocks to the device (or to its own allocator). Blocks still allocated
/// stay valid, and go back when freed and the cache is next emptied.
pub struct MemPool {
    id: MempoolId,
    device: u32,
    allocator: &'static CachingAllocator<CudaBackend>,
}

impl MemPool {
    /// A pool with PyTorch's defaults (`torch.cuda.MemPool()`) on `device`, or on the current
    /// device.
    ///
    /// # Errors
    ///
    /// As [`with_options`](Self::with_options).
    pub fn new(device: Option<u32>) -> Result<Self> {
        Self::with_options(PoolOptions::default(), device)
    }

    /// A pool with `options` (`torch.cuda.MemPool(allocator, use_on_oom, no_split)`) on `device`,
    /// or on the current device.
    ///
    /// # Errors
    ///
    /// [`Error::AsyncUnsupported`](super::Error::AsyncUnsupported) under `backend:cudaMallocAsync`
    /// (PyTorch: "cudaMallocAsync does not yet support createOrIncrefPool"); as
    /// [`device_allocator`](super::device_allocator); [`Error::Alloc`](super::Error::Alloc) if the
    /// allocator refuses the pool.
    pub fn with_options(options: PoolOptions, device: Option<u32>) -> Result<Self> {
        backend_supports(AsyncUnsupported::CreateOrIncrefPool)?;
        let device = resolve(device)?;
        let allocator =
            device_allocator(Some(device))?.native(AsyncUnsupported::CreateOrIncrefPool)?;
        let id = MempoolId(0, NEXT_ID.fetch_add(1, Relaxed));
        allocator.create_pool(id, options)?;
        Ok(MemPool {
            id,
            device,
            allocator,
        })
    }

    /// The pool's id (`MemPool.id`).
    #[must_use]
    pub fn id(&self) -> MempoolId {
        self.id
    }

    /// The device the pool is on.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// How many users hold the pool (`MemPool.use_count()`): 1 for this value, plus one per
    /// [`use_mem_pool`] guard alive.
    #[must_use]
    pub fn use_count(&self) -> i64 {
        self.allocator.pool_use_count(self.id)
    }

    /// The pool's own allocator, if it has one (`MemPool.allocator`).
    #[must_use]
    pub fn allocator(&self) -> Option<Arc<dyn PoolAllocator>> {
        self.options().allocator
    }

    /// The pool's options.
    #[must_use]
    pub fn options(&self) -> PoolOptions {
        self.allocator.pool_options(self.id).unwrap_or_default()
    }
}

impl std::fmt::Debug for MemPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("id", &self.id)
            .field("device", &self.device)
            .field("options", &self.options())
            .finish()
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        let a = self.allocator;
        let result = a
            .set_use_on_oom(self.id, false)
            .and_then(|()| a.release_pool(self.id))
            .and_then(|()| a.empty_pool_cache(self.id));
        if let Err(e) = result {
            tracing::warn!(pool = %self.id, device = self.device, error = %e,
                "giving up a memory pool failed; its cached memory stays until empty_cache");
        }
    }
}

/// Sends the calling thread's allocations on the pool's device to `pool` until the guard is dropped
/// (`torch.cuda.use_mem_pool(pool)`). The guard holds a user of the pool.
///
/// # Errors
///
/// [`Error::Alloc`](super::Error::Alloc) with [`Pool`](tensormem_cuda_alloc::Error::Pool) if
/// allocations are already being sent to the pool (one guard per pool at a time).
pub fn use_mem_pool(pool: &MemPool) -> Result<MemPoolGuard<'_>> {
    let thread = thread::current().id();
    pool.allocator
        .begin_allocate_to_pool(pool.id, move |_| thread::current().id() == thread)?;
    Ok(MemPoolGuard { pool })
}

/// Allocations of the thread that made it go to its pool while it lives (see [`use_mem_pool`]).
#[derive(Debug)]
pub struct MemPoolGuard<'a> {
    pool: &'a MemPool,
}

impl Drop for MemPoolGuard<'_> {
    fn drop(&mut self) {
        let a = self.pool.allocator;
        let id = self.pool.id;
        if let Err(e) = a.end_allocate_to_pool(id).and_then(|()| a.release_pool(id)) {
            tracing::warn!(pool = %id, error = %e, "leaving a memory pool failed");
        }
    }
}
