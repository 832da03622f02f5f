//! Allocations that free themselves: [`OwnedAllocation`], on every backend.
//!
//! A raw [`Allocation`] is a plain handle: every [`CachingAllocator::allocate`] needs a
//! [`CachingAllocator::free`], and a handle dropped without one keeps its memory until the
//! allocator goes. An [`OwnedAllocation`] holds the allocator beside the handle (borrowed, or an
//! [`Arc`]) and frees on drop, as cudarc's `CudaSlice` does. It is a thin wrapper: the allocation is
//! made and freed by the same calls as a raw one.
//!
//! A raw handle dropped without `free` is not lost silently: its bytes stay counted in the
//! `allocated_bytes` of [`memory_stats`](CachingAllocator::memory_stats) (check that it is back
//! to zero at the end of a test), and debug builds report the first such drop as a `tracing`
//! warning.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::{Allocation, CachingAllocator, Device, Error, Result, StreamId};

/// How an [`OwnedAllocation`] reaches its allocator.
enum Owner<'a, D: Device> {
    Borrowed(&'a CachingAllocator<D>),
    Shared(Arc<CachingAllocator<D>>),
}

impl<D: Device> Deref for Owner<'_, D> {
    type Target = CachingAllocator<D>;

    fn deref(&self) -> &CachingAllocator<D> {
        match self {
            Owner::Borrowed(allocator) => allocator,
            Owner::Shared(allocator) => allocator,
        }
    }
}

/// An allocation that goes back to its allocator when dropped, on any [`Device`] (the simulated
/// one included): made by [`CachingAllocator::allocate_owned`] (borrowing the allocator) or
/// [`CachingAllocator::allocate_shared`] (holding an `Arc` of it, so it can outlive the caller's
/// scope and move between threads).
///
/// It dereferences to the [`Allocation`] ([`ptr`](Allocation::ptr), [`size`](Allocation::size),
/// [`stream`](Allocation::stream), and [`CachingAllocator::record_stream`] with `&owned`). Dropping
/// it frees it as [`CachingAllocator::free`] does; a failure there cannot be returned from `drop`,
/// so it is handed to the device's [`Device::record_error`] (the CUDA backend reports it from its
/// `check_err`) or, for other errors, logged. Call [`free`](Self::free) to get the error instead.
///
/// ```
/// use tensormem_cuda_alloc::backend::sim::SimDevice;
/// use tensormem_cuda_alloc::{CachingAllocator, StreamId};
///
/// let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
/// {
///     let block = alloc.allocate_owned(3000, StreamId(0))?;
///     assert_eq!(block.size(), 3072);
///     println!("{:#x}", block.ptr());
/// } // freed here
/// assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 0);
/// # Ok::<(), tensormem_cuda_alloc::Error>(())
/// ```
#[must_use = "dropping an OwnedAllocation frees it at once"]
pub struct OwnedAllocation<'a, D: Device> {
    /// `Some` until [`free`](Self::free), [`into_raw`](Self::into_raw) or `drop` takes it.
    allocation: Option<Allocation>,
    allocator: Owner<'a, D>,
}

impl<'a, D: Device> OwnedAllocation<'a, D> {
    fn new(allocation: Allocation, allocator: Owner<'a, D>) -> Self {
        Self {
            allocation: Some(allocation),
            allocator,
        }
    }

    /// The allocator it goes back to.
    #[must_use]
    pub fn allocator(&self) -> &CachingAllocator<D> {
        &self.allocator
    }

    /// Frees it now (as dropping it does), returning what [`CachingAllocator::free`] returns.
    ///
    /// # Errors
    ///
    /// As [`CachingAllocator::free`].
    pub fn free(mut self) -> Result<()> {
        match self.allocation.take() {
            Some(allocation) => self.allocator.free(allocation),
            None => Ok(()),
        }
    }

    /// Gives up ownership: the raw handle, which then needs its own [`CachingAllocator::free`] on
    /// [`allocator`](Self::allocator).
    pub fn into_raw(mut self) -> Allocation {
        self.allocation
            .take()
            .expect("an OwnedAllocation holds its allocation until it is consumed")
    }
}

impl<D: Device> Deref for OwnedAllocation<'_, D> {
    type Target = Allocation;

    fn deref(&self) -> &Allocation {
        self.allocation
            .as_ref()
            .expect("an OwnedAllocation holds its allocation until it is consumed")
    }
}

impl<D: Device> AsRef<Allocation> for OwnedAllocation<'_, D> {
    fn as_ref(&self) -> &Allocation {
        self
    }
}

impl<D: Device> Drop for OwnedAllocation<'_, D> {
    fn drop(&mut self) {
        let Some(allocation) = self.allocation.take() else {
            return;
        };
        match self.allocator.free(allocation) {
            Ok(()) => {}
            Err(Error::Device(error)) => self.allocator.device().record_error(error),
            Err(error) => tracing::warn!(%error, "freeing an OwnedAllocation failed"),
        }
    }
}

impl<D: Device> fmt::Debug for OwnedAllocation<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedAllocation")
            .field("allocation", &self.allocation)
            .field("allocator", &self.allocator.id())
            .finish()
    }
}

impl<D: Device> CachingAllocator<D> {
    /// [`allocate`](Self::allocate), returning a handle that frees itself when dropped (borrowing
    /// this allocator).
    ///
    /// # Errors
    ///
    /// As [`allocate`](Self::allocate).
    pub fn allocate_owned(&self, size: usize, stream: StreamId) -> Result<OwnedAllocation<'_, D>> {
        let allocation = self.allocate(size, stream)?;
        Ok(OwnedAllocation::new(allocation, Owner::Borrowed(self)))
    }

    /// [`allocate`](Self::allocate), returning a handle that frees itself when dropped and holds an
    /// `Arc` of this allocator (it can be kept anywhere and sent to other threads).
    ///
    /// # Errors
    ///
    /// As [`allocate`](Self::allocate).
    pub fn allocate_shared(
        self: &Arc<Self>,
        size: usize,
        stream: StreamId,
    ) -> Result<OwnedAllocation<'static, D>> {
        let allocation = self.allocate(size, stream)?;
        Ok(OwnedAllocation::new(
            allocation,
            Owner::Shared(Arc::clone(self)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimDevice;
    use crate::{CachingAllocator, StreamId};

    /// A raw handle dropped without `free` stays counted as allocated (so `memory_stats` shows the
    /// leak), while an owned one gives its memory back on drop, on the simulated device too.
    #[test]
    fn owned_allocations_free_on_drop_and_raw_leaks_stay_counted() {
        let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
        drop(alloc.allocate_owned(3000, StreamId(0)).unwrap());
        assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 0);
        #[allow(unused_must_use, clippy::let_underscore_must_use)]
        {
            let _ = alloc.allocate(3000, StreamId(0)).unwrap();
        }
        assert_eq!(alloc.memory_stats().allocated_bytes.all.current, 3072);
    }
}
