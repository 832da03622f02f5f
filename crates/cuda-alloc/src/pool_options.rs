//! Options of private pools made as memory pools (PyTorch's `torch.cuda.MemPool(allocator,
//! use_on_oom, no_split)`): a pool used as a last resort before out-of-memory, a pool whose blocks
//! are never split, and a pool whose segments come from the user's own allocation functions.

use std::fmt;
use std::sync::Arc;

use crate::device::{DeviceAddress, DeviceResult};

/// Where a private pool's segments come from when they do not come from the device (PyTorch's
/// `MemPool(allocator=...)`, a `CUDAPluggableAllocator`'s alloc and free functions: what sleep modes
/// such as vLLM's are built on).
///
/// The pool calls [`malloc`](Self::malloc) wherever it would ask the device for a new segment, and
/// [`free`](Self::free) wherever it would return one (`empty_cache`, releasing cached blocks on
/// out-of-memory, dropping the allocator). The segments count in the statistics as device
/// allocations do (PyTorch's `segment`, `reserved_bytes`, `num_device_alloc` and `num_device_free`),
/// and against the memory fraction. Such a pool never uses expandable segments, as in PyTorch.
pub trait PoolAllocator: Send + Sync {
    /// Allocates a segment of `size` bytes. No room is [`DeviceError::OutOfMemory`]
    /// (PyTorch's `raw_alloc` returning null): the allocator then goes on down its out-of-memory
    /// path as it does when the device has no room.
    ///
    /// [`DeviceError::OutOfMemory`]: crate::DeviceError::OutOfMemory
    ///
    /// # Errors
    /// Out of memory as above; any other error fails the allocation with it.
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress>;

    /// Returns a segment (PyTorch's `raw_delete`).
    ///
    /// # Safety
    /// The caller guarantees that `ptr` and `size` are a segment this allocator's
    /// [`malloc`](Self::malloc) returned and that was not freed since, and that no queued work uses
    /// it any more.
    ///
    /// # Errors
    /// The failure to report; the segment is forgotten by the pool all the same.
    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()>;
}

/// A [`PoolAllocator`] made of two closures.
pub struct FnPoolAllocator<M, F> {
    malloc: M,
    free: F,
}

impl<M, F> FnPoolAllocator<M, F>
where
    M: Fn(usize) -> DeviceResult<DeviceAddress> + Send + Sync + 'static,
    F: Fn(DeviceAddress, usize) -> DeviceResult<()> + Send + Sync + 'static,
{
    /// The allocator that allocates with `malloc(size)` and frees with `free(ptr, size)`; `free` is
    /// called only with a segment `malloc` returned, once, when no queued work uses it any more.
    pub fn new(malloc: M, free: F) -> Self {
        FnPoolAllocator { malloc, free }
    }

    /// The same, ready to hand to [`PoolOptions::allocator`].
    pub fn shared(malloc: M, free: F) -> Arc<dyn PoolAllocator> {
        Arc::new(Self::new(malloc, free))
    }
}

impl<M, F> PoolAllocator for FnPoolAllocator<M, F>
where
    M: Fn(usize) -> DeviceResult<DeviceAddress> + Send + Sync,
    F: Fn(DeviceAddress, usize) -> DeviceResult<()> + Send + Sync,
{
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        (self.malloc)(size)
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        (self.free)(ptr, size)
    }
}

impl<M, F> fmt::Debug for FnPoolAllocator<M, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnPoolAllocator")
    }
}

/// The options of a memory pool, as `torch.cuda.MemPool` takes them.
#[derive(Clone, Default)]
pub struct PoolOptions {
    /// A pool that allocations outside any pool may use as a last resort before out-of-memory
    /// (PyTorch's `use_on_oom`): when a request for the default pools finds no cached block and the
    /// device has no room for a new segment, a free block of such a pool serves it, before any
    /// cached block is released. Blocks handed out so stay the pool's.
    pub use_on_oom: bool,
    /// A pool whose blocks are never split (PyTorch's `no_split`): every allocation gets a whole
    /// segment (or a whole free block), however much larger than the request.
    pub no_split: bool,
    /// Where the pool's segments come from; the device when `None`.
    pub allocator: Option<Arc<dyn PoolAllocator>>,
}

impl fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolOptions")
            .field("use_on_oom", &self.use_on_oom)
            .field("no_split", &self.no_split)
            .field("allocator", &self.allocator.as_ref().map(|_| "own"))
            .finish()
    }
}
