//! [`CachedSlice`]: a typed device buffer from the caching allocator that cudarc's copies, launches
//! and kernels take as they take a `CudaSlice`, and that goes back to the cache when dropped.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaStream as CudarcStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs,
    PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};

use crate::allocator::{Allocation, CachingAllocator};
use crate::backend::cuda::{driver_error, CudaBackend};
use crate::device::{Device, StreamId};
use crate::error::{Error, Result};

/// `len` values of `T` in device memory from a [`CachingAllocator`] on a CUDA device, owned: dropping
/// it frees the memory back to the allocator's cache, stream-ordered (the next allocation on the same
/// stream may reuse it at once: its work is queued after the work already queued there).
///
/// It implements cudarc's [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`], so
/// `stream.memcpy_htod(&host, &mut slice)`, `stream.clone_dtoh(&slice)`, `memset_zeros` and
/// `memcpy_dtod` take it, and `LaunchArgs::arg(&slice)` / `arg(&mut slice)` pass its pointer to a
/// kernel.
///
/// # Streams
///
/// The memory belongs to the stream it was allocated on ([`DeviceSlice::stream`]). Used on another
/// stream, the allocator must hold the memory back from reuse until that work is done (PyTorch's
/// `record_stream`):
///
/// - cudarc's copies on another stream do it themselves: when the stream is registered with the
///   backend (see [`CudaBackend::register_stream`]) the use is recorded; otherwise the copy call waits
///   for the stream before returning.
/// - kernels launched on another stream do not (cudarc does not tell which stream a launch uses): call
///   [`record_stream`](Self::record_stream) for that stream before dropping the slice.
pub struct CachedSlice<T> {
    allocator: Arc<CachingAllocator<CudaBackend>>,
    /// `None` only while dropping.
    allocation: Option<Allocation>,
    /// The device address, as kernels take it (0 for an empty slice).
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudarcStream>,
    _values: PhantomData<T>,
}

impl<T> std::fmt::Debug for CachedSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field(
                "stream",
                &format_args!("{:#x}", self.stream.cu_stream() as u64),
            )
            .finish()
    }
}

// SAFETY: the slice owns device memory, reachable only through driver calls, from any thread; the
// allocator and the cudarc stream are `Send + Sync`. `T` is never held on the host.
unsafe impl<T> Send for CachedSlice<T> {}
// SAFETY: as above; `&CachedSlice` only hands out the address for reads (`DevicePtr`).
unsafe impl<T> Sync for CachedSlice<T> {}

impl CachingAllocator<CudaBackend> {
    /// `len` zeroed values of `T` on `stream` (a cudarc stream of this device, registered with the
    /// backend on first use), zeroed by a fill queued on `stream`.
    ///
    /// # Errors
    ///
    /// As [`allocate`](Self::allocate); [`Error::TooLarge`] when `len` values of `T` overflow;
    /// [`Error::Device`] when the stream belongs to another device or the fill fails.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        self: &Arc<Self>,
        len: usize,
        stream: &Arc<CudarcStream>,
    ) -> Result<CachedSlice<T>> {
        // SAFETY: the memory is zeroed below, before the slice is handed out, and every `T` that is
        // `ValidAsZeroBits` may be all zero bits.
        let mut slice = unsafe { self.alloc_uninit::<T>(len, stream)? };
        stream
            .memset_zeros(&mut slice)
            .map_err(|e| driver_error("cuMemsetD8Async", e.0))?;
        Ok(slice)
    }

    /// `len` values of `T` on `stream`, left as the memory was (often the previous user's values).
    ///
    /// # Safety
    ///
    /// The values must be written before they are read as `T` (a kernel or a copy).
    ///
    /// # Errors
    ///
    /// As [`alloc_zeros`](Self::alloc_zeros).
    pub unsafe fn alloc_uninit<T: DeviceRepr>(
        self: &Arc<Self>,
        len: usize,
        stream: &Arc<CudarcStream>,
    ) -> Result<CachedSlice<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(Error::TooLarge { bytes: usize::MAX })?;
        let id = self.device().register_stream(stream)?;
        let allocation = self.allocate(bytes, id)?;
        Ok(CachedSlice {
            allocator: Arc::clone(self),
            ptr: allocation.ptr().addr(),
            allocation: Some(allocation),
            len,
            stream: Arc::clone(stream),
            _values: PhantomData,
        })
    }
}

impl<T> CachedSlice<T> {
    /// The allocation behind the slice (size, stream, pointer).
    pub fn allocation(&self) -> &Allocation {
        self.allocation.as_ref().expect("live until dropped")
    }

    /// The allocator the memory goes back to.
    #[must_use]
    pub fn allocator(&self) -> &Arc<CachingAllocator<CudaBackend>> {
        &self.allocator
    }

    /// Marks the memory as used by work queued on `stream` so far and later (PyTorch's
    /// `record_stream`): once the slice is dropped, the memory is reused only after that work has
    /// completed. Needed for kernels launched on a stream other than the slice's own.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when `stream` belongs to another device.
    pub fn record_stream(&self, stream: &Arc<CudarcStream>) -> Result<()> {
        let id = self.allocator.device().register_stream(stream)?;
        self.allocator.record_stream(self.allocation(), id)
    }

    /// How a use on `stream` is made safe: nothing on the slice's own stream; a recorded stream use
    /// on a stream the backend knows; otherwise the caller waits for `stream` once the use is queued.
    fn use_on<'a>(&'a self, stream: &'a CudarcStream) -> SyncOnDrop<'a> {
        if stream.cu_stream() == self.stream.cu_stream() {
            return SyncOnDrop::Sync(None);
        }
        let id = StreamId(stream.cu_stream() as u64);
        let device = self.allocator.device();
        let known = stream.context().cu_ctx() == self.stream.context().cu_ctx()
            && device.check_stream(id).is_ok();
        if known && self.allocator.record_stream(self.allocation(), id).is_ok() {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::sync_stream(stream)
        }
    }
}

impl<T> Drop for CachedSlice<T> {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            if let Err(error) = self.allocator.free(allocation) {
                tracing::warn!(%error, "freeing a CachedSlice failed");
                if let Error::Device(error) = error {
                    self.allocator.device().record_error(error);
                }
            }
        }
    }
}

impl<T> DeviceSlice<T> for CachedSlice<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudarcStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CachedSlice<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudarcStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream))
    }
}

impl<T> DevicePtrMut<T> for CachedSlice<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudarcStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream))
    }
}

// SAFETY: the argument pushed is a reference to the slice's device address, which lives as long as
// the borrow of the slice ('b, outliving the launch builder 'a); the kernel receives the address as
// a `T*` into memory the slice owns for at least that long.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CachedSlice<T>> for LaunchArgs<'a> {
    #[inline]
    fn arg(&mut self, arg: &'b CachedSlice<T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as above; the mutable borrow keeps other host code from using the slice meanwhile.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CachedSlice<T>> for LaunchArgs<'a> {
    #[inline]
    fn arg(&mut self, arg: &'b mut CachedSlice<T>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}
