//! Many tensors in one message: [`BatchHandle`], built with [`BatchBuilder`] and opened as a
//! [`ReceivedBatch`].
//!
//! # The problem
//!
//! Handing a model's weights to another process (weight sync in reinforcement learning, a trainer
//! feeding an inference server) is hundreds of tensors. PyTorch shares them one by one: a memory
//! handle, an event and a ref-counter slot per tensor, and the consumer opens each. Most of those
//! tensors live in a few segments of the caching allocator, and all of them were written on one
//! stream. A batch sends them as one message:
//!
//! - **one memory handle per segment** (the base allocation the caching allocator carved the tensors
//!   from), however many tensors lie in it; for memory of expandable segments (`cuMemCreate` +
//!   `cuMemMap`, which has no memory handle) one **range of chunks** per run of contiguous chunks
//!   under the tensors, named by the chunks' file descriptors as a single share of such memory
//!   is ([`crate::chunks`]); one message mixes both kinds;
//! - **at most one event** for the message (the stream whose work the consumer waits for; none when
//!   that stream is idle, as for single shares);
//! - **one ref-counter slot** for the message: every allocation in the batch stays allocated (or
//!   waits in the limbo) until the consumer releases the batch, or dies;
//! - **views** rebuilt by the consumer: each a segment index, an offset in the segment, a length in
//!   bytes and a name (a state dict's key), so the consumer can rebuild a state dict by key.
//!
//! The consumer opens each segment once per process and keeps it open between messages
//! ([`ConsumerConfig::batch_segments`](crate::ConsumerConfig::batch_segments)): the second handoff
//! of the same model opens nothing, and costs a slot, an event wait at most and one message.
//!
//! # Ranges of expandable segments
//!
//! A range of chunks is opened as a single share of chunks is: the consumer takes copies of the
//! producer's descriptors (`pidfd_getfd`, or the producer's socket, whose listener is checked;
//! [`ConsumerConfig::chunk_fds`](crate::ConsumerConfig::chunk_fds)), imports the chunks and maps
//! them one after another into one reserved range of its own. The views of a range therefore keep
//! the distances they have in the producer, also across chunk boundaries, and alias the producer's
//! memory (zero copy). Allocations whose chunks overlap or touch (blocks of one expandable segment,
//! sharing a chunk or lying side by side) travel as one range, so a model allocated in one
//! expandable segment is one range and one import. Lifetimes are those of every batch: the
//! message's one slot keeps every allocation of the batch allocated, and so its chunks mapped and
//! their descriptors open in the producer, until the consumer drops the batch, or dies (its slot
//! is then reclaimed by [`IpcProducer::collect`](crate::IpcProducer::collect)); the consumer
//! unmaps a range as soon as no batch holds it (ranges are never kept for the next message: the
//! producer may reuse a descriptor number for other memory once the chunk is released).
//! PyTorch peers do not read batches: to a PyTorch process, share tensor by tensor
//! ([`SharedAllocation::share`](crate::SharedAllocation::share), [`IpcHandle::to_torch`](crate::IpcHandle::to_torch)).
//!
//! # Example
//!
//! Without a GPU, on the simulated device and the [fake driver](crate::driver::fake) (both sides in
//! one process here; normally the bytes travel over a socket):
//!
//! ```
//! use std::sync::Arc;
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_ipc::driver::fake::FakeDriver;
//! use tensormem_ipc::{BatchHandle, IpcConsumer, IpcProducer};
//!
//! let driver = Arc::new(FakeDriver::default());
//! let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
//! let producer = IpcProducer::new(Arc::clone(&driver));
//! let s = StreamId(0);
//!
//! // Producer: the model's tensors, owned for sharing (kept for the life of the model).
//! let mut weight = producer.adopt(&allocator, allocator.allocate(3 << 20, s)?);
//! let mut bias = producer.adopt(&allocator, allocator.allocate(1000, s)?);
//! let mut qkv = producer.adopt(&allocator, allocator.allocate(3 * 4096, s)?);
//!
//! // One message for all of them: whole allocations and views into one.
//! let mut batch = producer.batch();
//! batch.whole(&mut weight, "layer.weight")?;
//! batch.whole(&mut bias, "layer.bias")?;
//! let fused = batch.allocation(&mut qkv)?;
//! for (i, name) in ["q", "k", "v"].into_iter().enumerate() {
//!     batch.view(fused, name, i as u64 * 4096, 4096)?;
//! }
//! let wire: Vec<u8> = batch.share(s)?.encode();
//!
//! // Consumer: every view at once, by name.
//! let consumer = IpcConsumer::new(Arc::clone(&driver));
//! let received = consumer.open_batch(&BatchHandle::decode(&wire)?, s)?;
//! assert_eq!(received.len(), 5);
//! assert_eq!(received.get("layer.bias").unwrap().len(), 1000);
//! assert_eq!(received.get("k").unwrap().view::<f32>()?.len(), 1024);
//!
//! drop(received); // one slot released for the whole message
//! drop((weight, bias, qkv));
//! assert_eq!(producer.stats().limbo, 0); // nothing held: freed at once
//! # Ok::<(), tensormem_ipc::Error>(())
//! ```
//!
//! # Binary encoding
//!
//! All integers little-endian. Version 1 carries device allocations only, and is what a batch
//! without a range of chunks is still written as, byte for byte (so releases that read only
//! version 1 read it); version 2 ([`BATCH_ENCODING_VERSION`]) is written for a batch with a range
//! of chunks, and differs only in its segments, which start with a kind byte. A build that reads
//! version 1 only refuses version 2 with [`Error::MalformedBatch`](crate::Error::MalformedBatch)
//! naming the version.
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `TMIB` |
//! | 4..6 | version (1 or 2) |
//! | 6..8 | flags: bit 0 = an event must be waited on |
//! | 8..12 | device ordinal |
//! | 12..16 | segment count `S` (at least 1) |
//! | 16..20 | view count `V` (at least 1) |
//! | 20..28 | producer id |
//! | 28..36 | ref-counter slot |
//! | 36..100 | event handle (zeros when flag 0 is clear) |
//! | 100..102 | length `N` of the ref-counter file name (at least 1) |
//! | 102..102+N | the name |
//! | then, in version 1, `S` x 72 | per segment: memory handle (64), size in bytes (8) |
//! | or, in version 2, `S` segments | per segment: kind (1), then for kind 0 (a device allocation) memory handle (64), size in bytes (8); for kind 1 (a range of chunks) the producer's pid (4), chunk size (8), chunk count `C` (4), `C` descriptors (4 each, in address order) |
//! | then `V` x (22 + `T`) | per view: segment (4; `0xffffffff` for a zero-byte view of no memory), offset in the segment (8), length in bytes (8), name length `T` (2), the name (UTF-8) |
//!
//! A range of chunks' offsets count from its first chunk's start, and its size is the chunks'
//! extent (chunk size x count).
//!
//! Decoding checks every field before anything is allocated from a count or opened: the magic,
//! version and flags; counts against the bytes that are there; the file name; segments of nonzero
//! size, named once each and used by some view; segment kinds; ranges of 1 to
//! [`MAX_CHUNKS`](crate::chunks::MAX_CHUNKS) chunks of a positive multiple of 2 MiB, whose extent
//! fits 64 bits, with non-negative descriptors, no descriptor named twice in the batch and every
//! range of one process; version 2 only with a range of chunks; each view inside its segment
//! (`offset + length <= size`, no overflow); names valid UTF-8 and distinct; and no two views
//! overlapping, except views of exactly the same bytes (tied weights: two names for one tensor).
//! The exact length must match. Anything else is
//! [`Error::MalformedBatch`](crate::Error::MalformedBatch). The producer refuses the same batches
//! with the same checks before it takes a slot.

mod builder;
mod check;
mod model;
mod received;
mod segments;
mod wire;

pub use builder::BatchBuilder;
pub use model::{BatchSegment, BatchView};
pub use received::{ReceivedBatch, ReceivedView};
pub(crate) use segments::SegmentTable;
pub(crate) use wire::CheckedBatch;
pub use wire::{BatchHandle, BATCH_ENCODING_VERSION};
