//! [`CudaOwner`]: the owner of a CUDA storage's bytes (memory of this process's caching allocator,
//! or memory received from another process), and [`CudaContext`], what every CUDA storage of one
//! device is used through. The operations on CUDA storages are `crate::cuda`'s (see its module
//! docs).
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::cuda::{BackendStream, CudaBackend};
use tensormem_cuda_alloc::{AsyncAllocator, CachingAllocator, DeviceAddress, DeviceMemory};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{IpcConsumer, IpcProducer, ReceivedBatch, ReceivedMemory, SharedAllocation};
use tensormem_runtime::DeviceAllocator;

use super::kind::StorageKind;
use crate::device::Device;
use crate::error::{cuda, Result};

/// Everything CUDA storages of one device need (see the [module docs](crate::cuda)).
pub struct CudaContext {
    pub(crate) device: u32,
    pub(crate) allocator: ContextAllocator,
    pub(crate) stream: BackendStream,
    pub(crate) producer: IpcProducer<CudaBackend, CudaIpcDriver>,
    pub(crate) consumer: IpcConsumer<CudaIpcDriver>,
}

/// The allocator a context's storages come from.
pub(crate) enum ContextAllocator {
    /// A caching allocator (the process's under `backend:native`, or one of the caller's).
    Caching(Arc<CachingAllocator<CudaBackend>>),
    /// The device's async allocator (the process's under `backend:cudaMallocAsync`).
    Async(&'static AsyncAllocator),
}

impl ContextAllocator {
    pub(crate) fn device(&self) -> &CudaBackend {
        match self {
            ContextAllocator::Caching(allocator) => allocator.device(),
            ContextAllocator::Async(allocator) => allocator.device(),
        }
    }
}

impl CudaContext {
    /// A context for `device`, with a stream of its own, on the allocator the process serves the
    /// device with (the process runtime's, `tensormem-runtime`: the one the device API and the
    /// PyTorch plugin use, made on first use; the caching allocator, or under
    /// `backend:cudaMallocAsync` the device's async allocator, whose memory cannot be shared with
    /// another process) and the process's IPC producer and consumer.
    ///
    /// # Errors
    ///
    /// [`Error::Runtime`](crate::Error::Runtime) for an ordinal past the device count or in a child
    /// forked after CUDA was initialised; [`Error::Alloc`](crate::Error::Alloc) when there is no
    /// driver or device, the allocator configuration in the environment is malformed, or the
    /// stream cannot be made; [`Error::Ipc`](crate::Error::Ipc) when the IPC driver cannot be
    /// loaded.
    pub fn new(device: u32) -> Result<Arc<CudaContext>> {
        let op = "CudaContext::new";
        match cuda!(op, tensormem_runtime::allocator(device))? {
            DeviceAllocator::Native(_) => {
                let allocator = cuda!(op, tensormem_runtime::caching_allocator(device))?;
                Self::with_allocator(Arc::clone(allocator))
            }
            DeviceAllocator::Async(allocator) => {
                Self::made(device, ContextAllocator::Async(allocator))
            }
        }
    }

    /// A context over another allocator than the process's (a private one, for tests or
    /// isolation); sharing still goes through the process's IPC producer and consumer.
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`](crate::Error::Alloc) when the stream cannot be made;
    /// [`Error::Ipc`](crate::Error::Ipc) when the IPC driver cannot.
    pub fn with_allocator(
        allocator: Arc<CachingAllocator<CudaBackend>>,
    ) -> Result<Arc<CudaContext>> {
        let device = allocator.device().ordinal();
        Self::made(device, ContextAllocator::Caching(allocator))
    }

    fn made(device: u32, allocator: ContextAllocator) -> Result<Arc<CudaContext>> {
        let op = "CudaContext::new";
        let stream = cuda!(op, BackendStream::new(allocator.device()))?;
        Ok(Arc::new(CudaContext {
            device,
            stream,
            producer: cuda!(op, tensormem_runtime::producer())?.clone(),
            consumer: cuda!(op, tensormem_runtime::consumer())?.clone(),
            allocator,
        }))
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The allocator the context's storages come from.
    pub fn allocator(&self) -> &dyn DeviceMemory<Device = CudaBackend> {
        match &self.allocator {
            ContextAllocator::Caching(allocator) => &**allocator,
            ContextAllocator::Async(allocator) => *allocator,
        }
    }

    /// The caching allocator the context's storages come from, unless the process runs
    /// `backend:cudaMallocAsync`.
    pub fn caching_allocator(&self) -> Option<&Arc<CachingAllocator<CudaBackend>>> {
        match &self.allocator {
            ContextAllocator::Caching(allocator) => Some(allocator),
            ContextAllocator::Async(_) => None,
        }
    }

    /// The stream the context's storages are allocated and copied on.
    pub fn stream(&self) -> &BackendStream {
        &self.stream
    }

    /// The IPC producer: the process's, shared by every context
    /// ([`ipc_collect`](crate::cuda::ipc_collect) frees what consumers released, as
    /// `torch.cuda.ipc_collect()`).
    pub fn producer(&self) -> &IpcProducer<CudaBackend, CudaIpcDriver> {
        &self.producer
    }

    /// Waits for everything queued on the context's stream.
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`](crate::Error::Alloc) when the driver reports a failure (its `CUresult`
    /// inside).
    pub fn synchronize(&self) -> Result<()> {
        cuda!("synchronize", self.stream.synchronize())
    }
}

impl fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaContext")
            .field("device", &self.device)
            .field("stream", &self.stream.id())
            .finish_non_exhaustive()
    }
}

/// The memory of a CUDA storage.
pub(crate) enum CudaMemory {
    /// From this process's allocator, held for sharing from the start (so sharing never has to
    /// replace the owner).
    Allocated(SharedAllocation<CudaBackend, CudaIpcDriver>),
    /// From the device's async allocator (`backend:cudaMallocAsync`): never shared.
    Async(AsyncBlock),
    /// Opened from another process's handle; dropping it releases the producer's counter.
    Received(ReceivedMemory<CudaIpcDriver>),
    /// View `index` of a batch opened from another process; the batch's one counter is released
    /// when the last storage of the batch goes.
    ReceivedView {
        batch: Arc<ReceivedBatch<CudaIpcDriver>>,
        index: usize,
    },
}

/// Memory of the async allocator, freed (on its allocation stream) when dropped.
pub(crate) struct AsyncBlock {
    pub(crate) ptr: DeviceAddress,
    pub(crate) allocator: &'static AsyncAllocator,
}

impl Drop for AsyncBlock {
    fn drop(&mut self) {
        if let Err(err) = self.allocator.free(self.ptr) {
            tracing::error!(ptr = %self.ptr, %err, "freeing a CUDA storage's memory failed");
        }
    }
}

/// Owner of a CUDA storage's bytes.
pub(crate) struct CudaOwner {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) memory: CudaMemory,
    /// Bytes of the storage (the allocation may be rounded up).
    pub(crate) nbytes: usize,
}

impl fmt::Debug for CudaOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaOwner")
            .field("device", &self.ctx.device)
            .field("ptr", &self.ptr())
            .field("nbytes", &self.nbytes)
            .field(
                "received",
                &matches!(
                    self.memory,
                    CudaMemory::Received(_) | CudaMemory::ReceivedView { .. }
                ),
            )
            .finish()
    }
}

impl CudaOwner {
    fn ptr(&self) -> DeviceAddress {
        match &self.memory {
            CudaMemory::Allocated(shared) => shared.ptr(),
            CudaMemory::Async(block) => block.ptr,
            CudaMemory::Received(received) => received.ptr(),
            CudaMemory::ReceivedView { batch, index } => batch.views()[*index].ptr(),
        }
    }

    pub(crate) fn kind(&self) -> StorageKind {
        match self.memory {
            CudaMemory::Allocated(_) | CudaMemory::Async(_) => StorageKind::Cuda,
            CudaMemory::Received(_) | CudaMemory::ReceivedView { .. } => StorageKind::CudaReceived,
        }
    }

    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.ctx.device)
    }

    /// Device -> host; the caller checked `offset + buf.len() <= nbytes`.
    pub(crate) fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        debug_assert!(offset + buf.len() <= self.nbytes);
        if buf.is_empty() {
            return Ok(());
        }
        // SAFETY: [ptr + offset, + buf.len()) lies inside this storage's memory (checked by the
        // caller against nbytes, which the allocation or the received range covers), which stays
        // mapped while `self` lives; the copy is on the stream that orders this storage's work.
        cuda!("read_at", unsafe {
            self.ctx.stream.copy_to_host(buf, self.ptr().offset(offset))
        })
    }

    /// Host -> device; the caller checked the range.
    pub(crate) fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        debug_assert!(offset + data.len() <= self.nbytes);
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `read_at`; the storage's memory is writable device memory of this
        // context's device, and the copy completes before the call returns.
        cuda!("write_at", unsafe {
            self.ctx
                .stream
                .copy_from_host(self.ptr().offset(offset), data)
        })
    }

    pub(crate) fn fill(&mut self, value: u8) -> Result<()> {
        if self.nbytes == 0 {
            return Ok(());
        }
        // SAFETY: the whole storage is device memory of this context's device that this stream
        // may write; nothing else of this process uses it until the synchronize below.
        cuda!("fill", unsafe {
            self.ctx.stream.memset_d8(self.ptr(), value, self.nbytes)
        })?;
        self.ctx.synchronize()
    }

    /// Device -> device: the whole of `src` into `self` (`len` bytes each, sizes checked by
    /// `storage_copy`, which holds both locks).
    pub(crate) fn copy_from_device(
        &mut self,
        src: &CudaOwner,
        len: usize,
        non_blocking: bool,
    ) -> Result<()> {
        if !Arc::ptr_eq(&self.ctx, &src.ctx) {
            // The source's pending work is on its own stream: let it finish first.
            src.ctx.synchronize()?;
        }
        // SAFETY: both ranges are the whole of two live storages of `len` bytes (sizes checked
        // by storage_copy) on the devices of their contexts; the destination is not used by
        // this process until the copy completes (it is ordered on its stream, and this
        // function synchronizes unless asked not to); the source is not written by this
        // process meanwhile (the caller holds its lock, and its stream was drained above).
        cuda!("storage_copy", unsafe {
            self.ctx.stream.copy_peer(
                self.ptr(),
                self.ctx.allocator.device(),
                src.ptr(),
                src.ctx.allocator.device(),
                len,
            )
        })?;
        if non_blocking {
            Ok(())
        } else {
            self.ctx.synchronize()
        }
    }
}
