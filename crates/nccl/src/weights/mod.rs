//! A model's weights from one rank into other ranks' own tensors, through NCCL: a trainer after
//! every optimizer step, inference engines on other GPUs or other machines.
//!
//! # The job
//!
//! Reinforcement-learning post-training updates the trainer's weights at every step, and the
//! engines that generate with them must serve the new values. The engines keep their own
//! parameters (the CUDA graphs they captured read those addresses), so the new values are copied
//! into them. PyTorch programs do this with `torch.distributed`: one broadcast per tensor (a
//! collective per tensor: thousands for a mixture of experts), or tensors flattened into buckets,
//! broadcast, and copied out into the parameters, each step after the other. Here:
//!
//! 1. **Connect**, once per pair of layouts ([`WeightSync::connect`]): every rank names its
//!    tensors ([`LocalTensor`]: name, address, bytes, opaque metadata such as the element type and
//!    shape). The sending rank's tensors, in its order, are the [`WeightLayout`]; it is broadcast
//!    once, every receiving rank matches it against its own tensors by name, and one all-reduce
//!    tells every rank whether all agree. A difference is an error on every rank
//!    ([`Error::Layout`](crate::Error::Layout) naming it where it is,
//!    [`Error::LayoutRejected`](crate::Error::LayoutRejected) elsewhere) before any weight moves.
//! 2. **Plan** ([`SyncPlan`]): the tensors laid end to end in the sender's order and cut every
//!    [`SyncOptions::bucket_bytes`] (256 MiB by default; a tensor may cross a cut). Each bucket
//!    is one `ncclBroadcast` of a contiguous buffer: a staging buffer, packed from the sender's
//!    tensors and unpacked into each receiver's, or, for a bucket that is one piece of one
//!    tensor on a rank, that tensor itself.
//! 3. **Sync**, every version ([`WeightSync::sync`]): every rank checks that all hold the same
//!    plan (its fingerprint, one 16-byte all-reduce), then the buckets go, pipelined.
//!
//! # The pipeline
//!
//! Each rank holds two staging buffers of the bucket size, allocated once with `ncclMemAlloc` and
//! registered with the communicator ([`NcclPoolAllocator`](crate::NcclPoolAllocator)), reused by
//! every sync. Packing and unpacking run on the compute stream (the caller's: where the weights
//! are written on the sender and read on the receivers), broadcasts on a communication stream;
//! two events per staging buffer order them, `filled` (packed on the sender, received on a
//! receiver) and `drained` (broadcast on the sender, unpacked on a receiver):
//!
//! ```text
//! sender    compute  | pack 0 | pack 1 | pack 2 |  pack k waits for drained: bcast k-2
//!           comm              | bcast 0| bcast 1| bcast 2 |  bcast k waits for filled: pack k
//! receiver  comm              | bcast 0| bcast 1| bcast 2 |  bcast k waits for drained: unpack k-2
//!           compute                    |unpack 0|unpack 1|unpack 2|  unpack k waits for filled
//! ```
//!
//! A receiver queues the broadcast of bucket `k + 1` before the unpacking of bucket `k`, so the
//! unpacking of one bucket overlaps the transfer of the next; a sync costs about the transfer
//! time plus one bucket's pack and one's unpack. The communication stream starts after the work
//! the caller queued on the compute stream, and the compute stream waits for the last broadcast;
//! `sync` returns once the compute stream is synchronized: the receiver's tensors hold the new
//! values, and the sender may write its weights again. Each sync logs a `tracing` event (target
//! `tensormem_nccl`: rank, bytes, buckets, direct buckets, milliseconds, GB/s).
//!
//! # Without a GPU
//!
//! The sync drives two small traits: a [`CopyEngine`] (the compute stream: staging memory, copies,
//! events) and a [`Collective`] (the communication stream: broadcasts). [`cuda`] implements them
//! on CUDA and NCCL; [`fake`] in memory, with a thread per stream and a rendezvous for
//! collectives, which is how the whole sync is tested without a device. Two ranks on the fake:
//!
//! ```
//! use tensormem_nccl::weights::fake::{FakeRank, FakeWorld};
//! use tensormem_nccl::weights::{LocalTensor, SyncOptions, WeightSync};
//!
//! /// A rank's tensors, filled with `fill`.
//! fn tensors(rank: &FakeRank, fill: u8) -> Vec<LocalTensor> {
//!     [("wte", 3 << 20), ("ln_f.weight", 4096)]
//!         .into_iter()
//!         .map(|(name, bytes)| {
//!             let ptr = rank.alloc(bytes);
//!             rank.write(ptr, &vec![fill; bytes]);
//!             LocalTensor { name: name.into(), ptr, bytes: bytes as u64, meta: format!("u8[{bytes}]") }
//!         })
//!         .collect()
//! }
//!
//! let world = FakeWorld::new(2);
//! let ranks: Vec<_> = (0..2)
//!     .map(|r| {
//!         let rank = world.rank(r);
//!         std::thread::spawn(move || -> tensormem_nccl::Result<Vec<u8>> {
//!             let mine = tensors(&rank, if r == 0 { 7 } else { 0 });
//!             let options = SyncOptions { bucket_bytes: 1 << 20, ..SyncOptions::default() };
//!             let mut sync = WeightSync::connect(rank.engine(), rank.collective(), 0, &mine, options)?;
//!             // SAFETY: the tensors are the fake's memory, used by nothing else.
//!             let report = unsafe { sync.sync()? };
//!             assert_eq!(report.buckets, 4); // 3 MiB + 4 KiB in 1 MiB buckets
//!             Ok(rank.read(mine[1].ptr, 4096))
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     assert!(rank.join().unwrap()?.iter().all(|&b| b == 7));
//! }
//! # Ok::<(), tensormem_nccl::Error>(())
//! ```
//!
//! # On GPUs
//!
//! Every rank, in its own process (or thread), on its own GPU:
//!
//! ```ignore
//! use cudarc::nccl::result;
//! use tensormem_cuda_alloc::backend::cuda::CudaBackend;
//! use tensormem_nccl::weights::{self, LocalTensor, SyncOptions};
//!
//! // `id` is rank 0's `result::get_uniqueid()`, sent to every rank (see below).
//! let mut comm = std::ptr::null_mut();
//! // SAFETY: `comm` is a valid out-parameter; every rank passes the same id and rank count.
//! unsafe { result::comm_init_rank(&mut comm, world_size, id, rank) }?;
//! let device = CudaBackend::new(gpu)?;
//! let stream = device.create_stream()?; // where the weights are written (trainer) or read
//! let tensors: Vec<LocalTensor> = state_dict
//!     .iter()
//!     .map(|p| LocalTensor { name: p.name.clone(), ptr: p.ptr, bytes: p.bytes, meta: p.dtype_shape() })
//!     .collect();
//! // SAFETY: `comm` lives on this GPU until the sync is dropped.
//! let mut sync = unsafe { weights::cuda::connect(comm, stream, 0, &tensors, SyncOptions::default())? };
//! loop {
//!     if rank == 0 {
//!         optimizer_step(); // on `stream`
//!     }
//!     // SAFETY: the tensors are live; no other stream touches them during the call.
//!     let report = unsafe { sync.sync()? };
//! }
//! ```
//!
//! # Across machines
//!
//! Nothing changes but the communicator. NCCL does not exchange its unique id itself: rank 0
//! calls `result::get_uniqueid()` and sends the 128 bytes of `ncclUniqueId::internal` to every
//! other rank out of band (a TCP socket, a shared file, the launcher's key-value store); each
//! rank then calls `comm_init_rank` with it, its rank and the rank count. NCCL's environment
//! picks the network: `NCCL_SOCKET_IFNAME` names the interface for its bootstrap and socket
//! transport (`eth0`, or `^lo,docker` to exclude), `NCCL_IB_HCA` the InfiniBand or RoCE adapters,
//! `NCCL_DEBUG=INFO` prints the transports chosen (`P2P/NVLink` within a machine, `NET/IB` or
//! `NET/Socket` between machines). The staging buffers are `ncclMemAlloc` memory registered with
//! the communicator, which NCCL's network transports can use directly (GPUDirect RDMA, where the
//! machine supports it).

pub mod cuda;
mod engine;
pub mod fake;
mod layout;
mod plan;
mod sync;

pub use engine::{Collective, CopyEngine, CopySpan, Step};
pub use layout::{LocalTensor, TensorSpec, WeightLayout};
pub use plan::{Bucket, Span, SyncPlan};
pub use sync::{
    SyncOptions, SyncReport, WeightSync, DEFAULT_BUCKET_BYTES, DEFAULT_SYNC_TIMEOUT,
    MIN_BUCKET_BYTES,
};
