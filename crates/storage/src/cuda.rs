//! CUDA storages (feature `cuda`): memory from a caching allocator, memory received from another
//! process through CUDA IPC (`tensormem-ipc`), PyTorch's `_share_cuda_` / `_new_shared_cuda` /
//! `_release_ipc_counter_cuda`, and the copies between host and device.
//!
//! A [`CudaContext`] bundles, for one device, what every CUDA storage on it needs: the caching
//! allocator, a stream on which its storages' memory is allocated and copied, the IPC producer
//! (ref-counter files, limbo) and the IPC consumer (opened-handle cache). Pass it to
//! [`Storage::new_cuda`] and [`Storage::new_shared_cuda`].
//!
//! The allocator, producer and consumer are the process's (the process runtime's, `tensormem-runtime`), as in
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

use std::sync::Arc;

use tensormem_ipc::{BatchHandle, IpcHandle};
pub use tensormem_runtime::ipc_collect;

use crate::device::Device;
use crate::error::{cuda, CudaSource, Error, Result};
pub use crate::owner::cuda::CudaContext;
use crate::owner::cuda::{AsyncBlock, ContextAllocator, CudaMemory, CudaOwner};
use crate::owner::Owner;
use crate::storage::Storage;

impl Storage {
    /// A storage of `nbytes` uninitialised bytes of CUDA memory from `ctx`'s caching allocator,
    /// on `ctx`'s stream (PyTorch: `torch.UntypedStorage(n, device="cuda")`).
    ///
    /// # Errors
    ///
    /// [`Error::Alloc`] when the allocator fails (out of memory: PyTorch's message and figures).
    pub fn new_cuda(ctx: &Arc<CudaContext>, nbytes: usize) -> Result<Storage> {
        let memory = match &ctx.allocator {
            ContextAllocator::Caching(allocator) => {
                let allocation = cuda!("new_cuda", allocator.allocate(nbytes, ctx.stream.id()))?;
                CudaMemory::Allocated(ctx.producer.adopt(allocator, allocation))
            }
            ContextAllocator::Async(allocator) => CudaMemory::Async(AsyncBlock {
                ptr: cuda!("new_cuda", allocator.allocate(nbytes, ctx.stream.id()))?,
                allocator,
            }),
        };
        Ok(Storage::with_owner(
            nbytes,
            Owner::Cuda(CudaOwner {
                ctx: Arc::clone(ctx),
                memory,
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
                    CudaMemory::Async(block) => Err(async_refusal("share_cuda", block)),
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
    /// from the IPC layer (the producer ended, slot released or claimed, range out of bounds);
    /// [`Error::Runtime`] for a context on the async allocator (`backend:cudaMallocAsync`, which
    /// PyTorch refuses too: `getIpcDevPtr`).
    pub fn new_shared_cuda(ctx: &Arc<CudaContext>, handle: &IpcHandle) -> Result<Storage> {
        refuse_opening_under_async(ctx, "new_shared_cuda")?;
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
                    CudaMemory::Async(block) => {
                        return Err(async_refusal("share_cuda_batch", block))
                    }
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
    refuse_opening_under_async(ctx, "new_shared_cuda_batch")?;
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

/// PyTorch's refusal to share memory of `backend:cudaMallocAsync` with another process
/// (`cudaMallocAsync does not yet support shareIpcHandle`), as the async allocator words it.
fn async_refusal(op: &'static str, block: &AsyncBlock) -> Error {
    let refusal = match block.allocator.ipc_handle(block.ptr) {
        Err(refusal) => refusal,
        Ok(_) => {
            tensormem_cuda_alloc::Error::Device(tensormem_cuda_alloc::DeviceError::Unsupported {
                what: "sharing memory of backend:cudaMallocAsync with another process",
            })
        }
    };
    refusal.during(op)
}

/// PyTorch's refusal to open another process's memory under `backend:cudaMallocAsync`
/// (`cudaMallocAsync does not yet support getIpcDevPtr`), for a context on the async allocator.
fn refuse_opening_under_async(ctx: &CudaContext, op: &'static str) -> Result<()> {
    match ctx.allocator {
        ContextAllocator::Caching(_) => Ok(()),
        ContextAllocator::Async(_) => Err(Error::Runtime {
            op,
            source: tensormem_runtime::Error::AsyncUnsupported(
                tensormem_runtime::AsyncUnsupported::GetIpcDevPtr,
            ),
        }),
    }
}
