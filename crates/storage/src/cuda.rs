//! CUDA storages (feature `cuda`): memory from a caching allocator, memory received from another
//! process through CUDA IPC (`tensormem-ipc`), PyTorch's `_share_cuda_` / `_new_shared_cuda` /
//! `_release_ipc_counter_cuda`, and the copies between host and device.
//!
//! A [`CudaContext`] bundles, for one device, what every CUDA storage on it needs: the caching
//! allocator, a stream on which its storages' memory is allocated and copied, the IPC producer
//! (ref-counter files, limbo) and the IPC consumer (opened-handle cache). Pass it to
//! [`Storage::new_cuda`] and [`Storage::new_shared_cuda`].
//!
//! The allocator, producer and consumer are the process's (`tensormem_ipc::registry::cuda()`), as in
//! PyTorch: the device API (`tensormem::cuda`: `memory_stats`, `empty_cache`, snapshots) and the
//! PyTorch plugin use the same allocator, so they see the storages' memory, and every context of the
//! process shares one set of ref-counter files, one limbo and one event budget. Contexts differ only
//! in their stream; [`ipc_collect`] frees what consumers released, for every context.
//!
//! Ordering: every storage of a context is allocated, filled and copied on the context's stream,
//! so its operations are ordered with each other. A copy between two contexts first waits for the
//! source context's stream. Host <-> device copies complete before they return (the host side
//! is pageable memory, as PyTorch's `copy_` of a non-pinned tensor); device -> device copies with
//! `non_blocking` are only queued: call [`CudaContext::synchronize`] before reading the
//! destination from another stream or the host by other means.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::cuda::{BackendStream, CudaBackend};
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
pub use tensormem_ipc::ipc_collect;
use tensormem_ipc::{
    BatchHandle, IpcConsumer, IpcHandle, IpcProducer, ReceivedBatch, ReceivedMemory,
    SharedAllocation,
};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::owner::{Owner, StorageKind};
use crate::storage::Storage;

/// Everything CUDA storages of one device need (see the [module docs](self)).
pub struct CudaContext {
    device: u32,
    allocator: Arc<CachingAllocator<CudaBackend>>,
    stream: BackendStream,
    producer: IpcProducer<CudaBackend, CudaIpcDriver>,
    consumer: IpcConsumer<CudaIpcDriver>,
}

/// Wraps a CUDA layer's error (allocator, driver or IPC) in [`Error`], keeping it as the source.
macro_rules! cuda {
    ($op:expr, $result:expr) => {
        $result.map_err(|e| crate::error::CudaSource::during(e, $op))
    };
}

impl CudaContext {
    /// A context for `device`, with a stream of its own, on the process's caching allocator of the
    /// device (the one `tensormem::cuda` uses, made on first use) and the process's IPC producer and
    /// consumer.
    ///
    /// # Errors
    ///
    /// [`Error::Ipc`] when there is no driver or no such device, or the allocator configuration in
    /// the environment is malformed (the process registry's error, the driver's or configuration's
    /// error inside); [`Error::Alloc`] when the stream cannot be made.
    pub fn new(device: u32) -> Result<Arc<CudaContext>> {
        let process = cuda!("CudaContext::new", tensormem_ipc::registry::cuda())?;
        let allocator = cuda!("CudaContext::new", process.allocator(device))?;
        Self::with_allocator(Arc::clone(allocator))
    }

    /// A context over another allocator than the process's (a private one, for tests or
    /// isolation); sharing still goes through the process's IPC producer and consumer.
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`] when the stream cannot be made; [`Error::Ipc`] when the IPC driver cannot.
    pub fn with_allocator(
        allocator: Arc<CachingAllocator<CudaBackend>>,
    ) -> Result<Arc<CudaContext>> {
        let device = allocator.device().ordinal();
        let process = cuda!("CudaContext::new", tensormem_ipc::registry::cuda())?;
        let stream = cuda!("CudaContext::new", BackendStream::new(allocator.device()))?;
        Ok(Arc::new(CudaContext {
            device,
            allocator,
            stream,
            producer: process.producer().clone(),
            consumer: process.consumer().clone(),
        }))
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The allocator.
    pub fn allocator(&self) -> &Arc<CachingAllocator<CudaBackend>> {
        &self.allocator
    }

    /// The stream the context's storages are allocated and copied on.
    pub fn stream(&self) -> &BackendStream {
        &self.stream
    }

    /// The IPC producer: the process's, shared by every context ([`ipc_collect`] frees what
    /// consumers released, as `torch.cuda.ipc_collect()`).
    pub fn producer(&self) -> &IpcProducer<CudaBackend, CudaIpcDriver> {
        &self.producer
    }

    /// Waits for everything queued on the context's stream.
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`] when the driver reports a failure (its `CUresult` inside).
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
enum CudaMemory {
    /// From this process's allocator, held for sharing from the start (so sharing never has to
    /// replace the owner).
    Allocated(SharedAllocation<CudaBackend, CudaIpcDriver>),
    /// Opened from another process's handle; dropping it releases the producer's counter.
    Received(ReceivedMemory<CudaIpcDriver>),
    /// View `index` of a batch opened from another process; the batch's one counter is released
    /// when the last storage of the batch goes.
    ReceivedView {
        batch: Arc<ReceivedBatch<CudaIpcDriver>>,
        index: usize,
    },
}

/// Owner of a CUDA storage's bytes.
pub(crate) struct CudaOwner {
    ctx: Arc<CudaContext>,
    memory: CudaMemory,
    /// Bytes of the storage (the allocation may be rounded up).
    nbytes: usize,
}

impl fmt::Debug for CudaOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaOwner")
            .field("device", &self.ctx.device)
            .field("ptr", &self.ptr())
            .field("nbytes", &self.nbytes)
            .field(
                "received",
                &!matches!(self.memory, CudaMemory::Allocated(_)),
            )
            .finish()
    }
}

impl CudaOwner {
    fn ptr(&self) -> DeviceAddress {
        match &self.memory {
            CudaMemory::Allocated(shared) => shared.ptr(),
            CudaMemory::Received(received) => received.ptr(),
            CudaMemory::ReceivedView { batch, index } => batch.views()[*index].ptr(),
        }
    }

    pub(crate) fn kind(&self) -> StorageKind {
        match self.memory {
            CudaMemory::Allocated(_) => StorageKind::Cuda,
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
}

impl Storage {
    /// A storage of `nbytes` uninitialised bytes of CUDA memory from `ctx`'s caching allocator,
    /// on `ctx`'s stream (PyTorch: `torch.UntypedStorage(n, device="cuda")`).
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`] when the allocator fails (out of memory: PyTorch's message and figures).
    pub fn new_cuda(ctx: &Arc<CudaContext>, nbytes: usize) -> Result<Storage> {
        let allocation = cuda!("new_cuda", ctx.allocator.allocate(nbytes, ctx.stream.id()))?;
        let shared = ctx.producer.adopt(&ctx.allocator, allocation);
        Ok(Storage::with_owner(
            nbytes,
            Owner::Cuda(CudaOwner {
                ctx: Arc::clone(ctx),
                memory: CudaMemory::Allocated(shared),
                nbytes,
            }),
        ))
    }

    /// Shares a CUDA storage with another process (PyTorch: `_share_cuda_`): an IPC handle with a
    /// ref-counter slot and, when needed, an interprocess event ([`IpcHandle::to_torch`] gives
    /// PyTorch's 8-tuple). The handle carries the storage's size in bytes exactly and its offset in
    /// the allocator's segment. The memory stays allocated until every consumer released it.
    ///
    /// An empty storage has no memory: its handle is [`IpcHandle::empty`] (PyTorch's `(device,
    /// None, 0, 0, None, 0, None, None)`), which [`Storage::new_shared_cuda`] turns into an empty
    /// storage of the device.
    ///
    /// # Errors
    ///
    /// [`Error::ReceivedCuda`] for a storage this process received (PyTorch refuses too: clone it
    /// first); [`Error::WrongDevice`] for host storages; [`Error::Ipc`] from the IPC layer
    /// (driver failures, ref-counter files that cannot be made).
    pub fn share_cuda(&self) -> Result<IpcHandle> {
        let mut owner = self.owner_mut();
        let device = owner.device();
        match &mut *owner {
            Owner::Cuda(cuda) => {
                let stream = cuda.ctx.stream.id();
                match &mut cuda.memory {
                    CudaMemory::Allocated(shared) => cuda!("share_cuda", shared.share(stream)),
                    CudaMemory::Received(_) | CudaMemory::ReceivedView { .. } => {
                        Err(Error::ReceivedCuda)
                    }
                }
            }
            _ => Err(Error::WrongDevice {
                op: "share_cuda",
                expected: "CUDA",
                actual: device,
            }),
        }
    }

    /// Opens CUDA memory shared by another process (PyTorch: `_new_shared_cuda`), on `ctx`'s
    /// stream (which waits for the producer's event). Every field of the handle is checked before
    /// anything is mapped (device, ref-counter slot, range inside the base allocation). The storage
    /// has the handle's size in bytes.
    ///
    /// An empty storage's handle ([`IpcHandle::is_empty`]) gives a new empty storage of the
    /// device, as PyTorch rebuilds one (`rebuild_cuda_tensor`); it is not a received storage, so it
    /// may be shared on.
    ///
    /// # Errors
    ///
    /// [`Error::WrongDevice`] when `ctx` is for another device than the handle's; [`Error::Ipc`]
    /// from the IPC layer (the producer ended, slot released or claimed, range out of bounds).
    pub fn new_shared_cuda(ctx: &Arc<CudaContext>, handle: &IpcHandle) -> Result<Storage> {
        if handle.device != ctx.device {
            return Err(Error::WrongDevice {
                op: "new_shared_cuda (the context's device must be the handle's)",
                expected: "CUDA",
                actual: Device::Cuda(ctx.device),
            });
        }
        if handle.is_empty() {
            return Storage::new_cuda(ctx, 0);
        }
        let nbytes = usize::try_from(handle.size).map_err(|_| Error::InvalidSize {
            op: "new_shared_cuda",
            size: handle.size,
            problem: "larger than the address space",
        })?;
        let received = cuda!(
            "new_shared_cuda",
            ctx.consumer.open(handle, ctx.stream.id())
        )?;
        Ok(Storage::with_owner(
            nbytes,
            Owner::Cuda(CudaOwner {
                ctx: Arc::clone(ctx),
                memory: CudaMemory::Received(received),
                nbytes,
            }),
        ))
    }
}

/// One tensor of a batch: `len` bytes at `offset` of a CUDA storage, under a name (a state dict's
/// key). See [`share_cuda_batch`].
#[derive(Debug, Clone, Copy)]
pub struct BatchEntry<'a> {
    /// The name the consumer finds it by; distinct within a batch.
    pub name: &'a str,
    /// The storage it lies in (several entries may name one storage).
    pub storage: &'a Storage,
    /// Where it starts in the storage.
    pub offset: usize,
    /// Its length in bytes.
    pub len: usize,
}

impl<'a> BatchEntry<'a> {
    /// The whole of `storage`, named `name`.
    pub fn whole(name: &'a str, storage: &'a Storage) -> Self {
        Self {
            name,
            storage,
            offset: 0,
            len: storage.nbytes(),
        }
    }
}

/// Shares many CUDA storages (or ranges of them) with another process as one message
/// (`tensormem_ipc::batch`): one ref-counter slot for the whole message, one memory handle per
/// segment of the allocator, at most one event. [`new_shared_cuda_batch`] opens it. PyTorch peers
/// do not read batches: share with them storage by storage ([`Storage::share_cuda`]).
///
/// The event, when one is needed, is recorded on the stream of the first entry's context; the
/// streams of other contexts among the entries are synchronized first. Every storage stays
/// allocated until the consumer dropped every storage it rebuilt from the batch (or died).
///
/// ```no_run
/// use tensormem_storage::{new_shared_cuda_batch, share_cuda_batch, BatchEntry, CudaContext, Storage};
///
/// let ctx = CudaContext::new(0)?;
/// let weight = Storage::new_cuda(&ctx, 4096 * 4096 * 2)?;
/// let bias = Storage::new_cuda(&ctx, 4096 * 2)?;
/// let batch = share_cuda_batch(&[
///     BatchEntry::whole("layer.weight", &weight),
///     BatchEntry::whole("layer.bias", &bias),
/// ])?;
/// let bytes = batch.encode(); // to the other process
///
/// // In the consumer process:
/// let state: Vec<(String, Storage)> =
///     new_shared_cuda_batch(&ctx, &tensormem_storage::BatchHandle::decode(&bytes).unwrap())?;
/// # Ok::<(), tensormem_storage::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::WrongDevice`] for host storages; [`Error::ReceivedCuda`] for storages this process
/// received; [`Error::EmptyBatch`] for no entries; [`Error::Ipc`] from the IPC layer: storages of
/// several devices, a range past its storage, duplicate names, overlapping ranges (other than exact
/// aliases), driver failures. Nothing is shared then.
pub fn share_cuda_batch(entries: &[BatchEntry<'_>]) -> Result<BatchHandle> {
    let Some(first) = entries.first() else {
        return Err(Error::EmptyBatch);
    };
    // The event goes on the first entry's context's stream (a CUDA storage keeps its context).
    let ctx = match &*first.storage.owner() {
        Owner::Cuda(cuda) => Arc::clone(&cuda.ctx),
        other => {
            return Err(Error::WrongDevice {
                op: "share_cuda_batch",
                expected: "CUDA",
                actual: other.device(),
            })
        }
    };
    // Each storage once, locked in address order (no deadlock with another batch of the same
    // storages in another order).
    let mut storages: Vec<&Storage> = entries.iter().map(|e| e.storage).collect();
    storages.sort_by_key(|s| s.lock_order());
    storages.dedup_by_key(|s| s.lock_order());
    let mut guards: Vec<_> = storages.iter().map(|s| s.owner_mut()).collect();
    let mut contexts: Vec<Arc<CudaContext>> = Vec::new();
    let mut allocations = Vec::with_capacity(guards.len());
    for guard in guards.iter_mut() {
        let device = guard.device();
        match &mut **guard {
            Owner::Cuda(cuda) => {
                if !contexts.iter().any(|c| Arc::ptr_eq(c, &cuda.ctx)) {
                    contexts.push(Arc::clone(&cuda.ctx));
                }
                match &mut cuda.memory {
                    CudaMemory::Allocated(shared) => allocations.push(shared),
                    _ => return Err(Error::ReceivedCuda),
                }
            }
            _ => {
                return Err(Error::WrongDevice {
                    op: "share_cuda_batch",
                    expected: "CUDA",
                    actual: device,
                })
            }
        }
    }
    for other in &contexts {
        if !Arc::ptr_eq(other, &ctx) {
            other.synchronize()?;
        }
    }
    let mut batch = ctx.producer.batch();
    let mut index = Vec::with_capacity(allocations.len());
    for shared in allocations {
        index.push(cuda!("share_cuda_batch", batch.allocation(shared))?);
    }
    for entry in entries {
        let at = storages
            .binary_search_by_key(&entry.storage.lock_order(), |s| s.lock_order())
            .expect("every entry's storage is among the storages");
        cuda!(
            "share_cuda_batch",
            batch.view(index[at], entry.name, entry.offset as u64, entry.len as u64)
        )?;
    }
    cuda!("share_cuda_batch", batch.share(ctx.stream.id()))
}

/// Opens a batch another process shared with [`share_cuda_batch`], on `ctx`'s stream (which waits
/// for the producer's event): one storage per view, in the producer's order, with its name. Every
/// field of the batch was checked when it was decoded, and each segment's size is checked against
/// the real mapping; segments are opened once per process and kept open for the next batch (a
/// warm handoff opens nothing). The storages are received ones (they cannot be shared on); the
/// batch's one reference goes back to the producer when the last of them is dropped.
///
/// # Errors
///
/// [`Error::WrongDevice`] when `ctx` is for another device than the batch's; [`Error::Ipc`] from
/// the IPC layer (the producer ended, the batch was released or opened already, a segment larger
/// than its mapping).
pub fn new_shared_cuda_batch(
    ctx: &Arc<CudaContext>,
    batch: &BatchHandle,
) -> Result<Vec<(String, Storage)>> {
    if batch.device() != ctx.device {
        return Err(Error::WrongDevice {
            op: "new_shared_cuda_batch (the context's device must be the batch's)",
            expected: "CUDA",
            actual: Device::Cuda(ctx.device),
        });
    }
    let received = Arc::new(cuda!(
        "new_shared_cuda_batch",
        ctx.consumer.open_batch(batch, ctx.stream.id())
    )?);
    let mut out = Vec::with_capacity(received.len());
    for (index, view) in received.views().iter().enumerate() {
        let nbytes = usize::try_from(view.len()).map_err(|_| Error::InvalidSize {
            op: "new_shared_cuda_batch",
            size: view.len(),
            problem: "larger than the address space",
        })?;
        let storage = Storage::with_owner(
            nbytes,
            Owner::Cuda(CudaOwner {
                ctx: Arc::clone(ctx),
                memory: CudaMemory::ReceivedView {
                    batch: Arc::clone(&received),
                    index,
                },
                nbytes,
            }),
        );
        out.push((view.name().to_owned(), storage));
    }
    Ok(out)
}

/// Gives back the reference a batch carries without opening it (as [`release_ipc_counter`] for one
/// handle): only the batch's slot is decremented.
///
/// # Errors
///
/// As [`release_ipc_counter`].
pub fn release_ipc_counter_batch(ctx: &Arc<CudaContext>, batch: &BatchHandle) -> Result<()> {
    cuda!(
        "release_ipc_counter_batch",
        ctx.consumer.release_batch(batch)
    )
}

/// Releases the reference a CUDA handle carries without keeping its memory (PyTorch:
/// `_release_ipc_counter_cuda`, used when the receiver already holds the storage): only the
/// handle's ref-counter slot is decremented, as PyTorch does; no memory handle is opened, no event
/// waited on, no stream synchronized. An empty storage's handle holds no reference.
///
/// # Errors
///
/// [`Error::Ipc`] from the IPC layer: the ref-counter file is gone (the producer ended), the slot
/// was released already, or a consumer opened this handle (it releases the slot itself).
pub fn release_ipc_counter(ctx: &Arc<CudaContext>, handle: &IpcHandle) -> Result<()> {
    cuda!("release_ipc_counter", ctx.consumer.release(handle))
}

/// Copies between two owners of which at least one is CUDA memory (called by `storage_copy`,
/// which checked the sizes and holds both locks).
pub(crate) fn copy_with_device(
    dst: &mut Owner,
    src: &Owner,
    len: usize,
    non_blocking: bool,
) -> Result<()> {
    match (dst, src) {
        (Owner::Cuda(d), Owner::Cuda(s)) => {
            if !Arc::ptr_eq(&d.ctx, &s.ctx) {
                // The source's pending work is on its own stream: let it finish first.
                s.ctx.synchronize()?;
            }
            // SAFETY: both ranges are the whole of two live storages of `len` bytes (sizes checked
            // by storage_copy) on the devices of their contexts; the destination is not used by
            // this process until the copy completes (it is ordered on its stream, and this
            // function synchronizes unless asked not to); the source is not written by this
            // process meanwhile (the caller holds its lock, and its stream was drained above).
            cuda!("storage_copy", unsafe {
                d.ctx.stream.copy_peer(
                    d.ptr(),
                    d.ctx.allocator.device(),
                    s.ptr(),
                    s.ctx.allocator.device(),
                    len,
                )
            })?;
            if non_blocking {
                Ok(())
            } else {
                d.ctx.synchronize()
            }
        }
        (Owner::Cuda(d), host) => match host.private_bytes() {
            Some(bytes) => d.write_at(0, &bytes[..len]),
            None => {
                let mut staging = vec![0u8; len];
                host.read_at(0, &mut staging)?;
                d.write_at(0, &staging)
            }
        },
        (host, Owner::Cuda(s)) => match host.private_bytes_mut() {
            Some(bytes) => s.read_at(0, &mut bytes[..len]),
            None => {
                let mut staging = vec![0u8; len];
                s.read_at(0, &mut staging)?;
                host.write_at(0, &staging)
            }
        },
        (dst, src) => crate::copy::copy_owner(dst, src, len),
    }
}
