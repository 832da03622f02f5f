//! A model's weights into another process's own tensors, version after version: publish, open,
//! install.
//!
//! # The job
//!
//! Reinforcement-learning post-training keeps a trainer and an inference engine on the same GPU
//! and, after every optimizer step, moves the trainer's weights into the engine's parameters (the
//! engine keeps its own tensors, so the CUDA graphs it captured over them stay valid). Done tensor
//! by tensor through `torch.multiprocessing`, that is a handle, an event and a slot per tensor and
//! per step; done through flattened buckets, an extra device copy of the whole model per step.
//! Here the weights are named once and then only versions travel:
//!
//! 1. **Publish** ([`WeightPublisher::new`]): the producer names its tensors (name, address,
//!    [`TensorMeta`]); one memory handle per allocation they lie in (or, in expandable segments,
//!    one range of exported chunks per run of chunks under them), one interprocess event, one
//!    small shared-memory [channel](WeightPublisher::publish) for versions. Each consumer gets a
//!    [`WeightsMessage`] ([`WeightPublisher::message`]): a few bytes per tensor, one ref-counter slot.
//! 2. **Open** ([`WeightSubscriber::open`]): the consumer maps each allocation (or range of
//!    chunks, in one piece) once; the published tensors alias the producer's memory
//!    ([`WeightSubscriber::tensors`], zero copy). While the
//!    subscription lives the producer's memory stays allocated for it; when it is dropped, or its
//!    process dies, the hold goes.
//! 3. **Install** ([`WeightSubscriber::prepare`], [`WeightSubscriber::install`]): the published
//!    tensors are matched to the consumer's by name, element type, shape and strides once (an
//!    [`InstallPlan`]: every mismatch is an error before anything is written), reduced to as few
//!    copies as the two layouts allow, and replayed on every version with one batched copy call
//!    (`cuMemcpyBatchAsync`).
//! 4. **Versions**: the producer announces a version after writing the weights
//!    ([`WeightPublisher::publish`]: an event recorded on its stream, a counter bumped); a consumer
//!    waits for it, orders its stream after the producer's writes (no host wait), copies, and
//!    records the version installed. Before writing the weights again the producer waits for its
//!    consumers ([`WeightPublisher::wait_installed`]), so a version is never torn under a reader.
//!    A consumer that dies is skipped; a producer that dies or closes ends the consumer's wait
//!    with [`Error::PublicationClosed`](crate::Error::PublicationClosed).
//!
//! Memory of `cuMemAlloc` is named by CUDA IPC memory handles (`cuIpcGetMemHandle`), which need
//! no descriptor passing: it works between containers of one host and between users, wherever the
//! consumer can map the producer's ref-counter and channel files (`/dev/shm` shared). Memory of
//! expandable segments (`cuMemCreate` + `cuMemMap`) has no such handle: its chunks are exported as
//! file descriptors, which the consumer takes as for single shares of such memory
//! ([`crate::chunks`]: `pidfd_getfd`, or the producer's socket; so the consumer must see the
//! producer's pid, and be its user or root). One publication mixes both kinds.
//!
//! PyTorch programs use this through `tensormem_torch.weights` (the plugin crate).
//!
//! # How copies are merged
//!
//! A plan merges copies of tensors adjacent on both sides only inside one region per side, so that
//! a merged copy never runs through memory that is not mapped as one piece. On the consumer's side
//! of the sources, a region is a segment of the publication as mapped there: an allocation, or a
//! range of chunks, which the consumer maps contiguously, so copies merge across its chunk
//! boundaries; two segments are never one region, even where the consumer happens to map them side
//! by side. On the destinations' side, a region is what `cuMemGetAddressRange` gives: an
//! allocation, or, for the consumer's own memory of expandable segments, one chunk's mapping (a
//! merged copy then starts and ends as its tensors do, and adds no crossing a copy per tensor would
//! not make).
//!
//! # Example
//!
//! Without a GPU, on the [fake driver](crate::driver::fake) (both sides in one process here;
//! normally the message's bytes travel over a socket or a queue once, and only versions after):
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{DeviceAddress, StreamId};
//! use tensormem_ipc::driver::fake::FakeDriver;
//! use tensormem_ipc::weights::{
//!     DType, PlacedTensor, PlanOptions, PublishedTensor, TensorMeta, WeightPublisher,
//!     WeightSubscriber, WeightsMessage,
//! };
//! use tensormem_ipc::{IpcConsumer, IpcProducer};
//!
//! let driver = Arc::new(FakeDriver::default());
//! let s = StreamId(0);
//! // The trainer's parameters: two bf16 matrices in one 1 MiB allocation.
//! driver.add_allocation(0, DeviceAddress(0x10_0000), 1 << 20);
//! let meta = TensorMeta::contiguous(DType::BFloat16, &[256, 256]); // 128 KiB
//! let trainer = [
//!     PublishedTensor { name: "w1".into(), ptr: DeviceAddress(0x10_0000), meta: meta.clone() },
//!     PublishedTensor { name: "w2".into(), ptr: DeviceAddress(0x12_0000), meta: meta.clone() },
//! ];
//! let producer = IpcProducer::<SimDevice, _>::new(Arc::clone(&driver));
//! // SAFETY: the fake driver has no memory behind these addresses; nothing reads them.
//! let publisher = unsafe { WeightPublisher::new(&producer, 0, &trainer)? };
//! let wire: Vec<u8> = publisher.message()?.encode();
//!
//! // The engine: open once, plan once against its own parameters.
//! let consumer = IpcConsumer::new(Arc::clone(&driver));
//! driver.add_allocation(0, DeviceAddress(0x90_0000), 1 << 20); // the engine's parameters
//! let mut sub = WeightSubscriber::open(&consumer, &WeightsMessage::decode(&wire)?, s)?;
//! let engine = [
//!     PlacedTensor { name: "w1", ptr: DeviceAddress(0x90_0000), meta: &meta },
//!     PlacedTensor { name: "w2", ptr: DeviceAddress(0x92_0000), meta: &meta },
//! ];
//! let plan = sub.prepare(&engine, PlanOptions::default())?;
//! assert_eq!(sub.plan(plan).copies().len(), 1); // adjacent in one allocation each side: one copy
//!
//! // Every step: the trainer announces, the engine installs, the trainer waits for it.
//! let version = publisher.publish(s)?;
//! // SAFETY: as above, the fake moves no bytes.
//! assert_eq!(unsafe { sub.install(plan, s, Some(Duration::from_secs(5)))? }, version);
//! publisher.wait_installed(version, Some(Duration::from_secs(5)))?;
//! assert_eq!(driver.copies().len(), 1);
//! # Ok::<(), tensormem_ipc::Error>(())
//! ```

mod channel;
mod memory;
mod message;
mod meta;
mod plan;
mod publisher;
mod subscriber;

pub use crate::driver::DeviceCopy;
pub use channel::MAX_CONSUMERS;
pub use message::{WeightsMessage, WEIGHTS_ENCODING_VERSION};
pub use meta::{DType, PublishedTensor, TensorMeta, MAX_DIMS};
pub use plan::{layout_key, InstallPlan, PlacedTensor, PlanOptions};
pub use publisher::WeightPublisher;
pub use subscriber::{PlanId, WeightSubscriber};
