//! The producer's side: [`WeightPublisher`].

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensormem_cuda_alloc::{Device, StreamId};

use super::channel::{wait_until, Channel};
use super::memory::{self, PublishedMemory};
use super::message::WeightsMessage;
use super::meta::{PublishedTensor, TensorMeta};
use crate::batch::CheckedBatch;
use crate::driver::{EventHandle, IpcDriver};
use crate::error::{Error, Result};
use crate::producer::IpcProducer;
use crate::refcounter::RefCounterFile;

/// A set of CUDA tensors published to consumer processes, version after version (see
/// [`crate::weights`]).
///
/// The memory is not copied or owned: the publisher names the allocations the tensors lie in (one
/// handle per allocation) and consumers map them. Each [`message`](Self::message) takes a
/// ref-counter slot that its consumer holds while subscribed (or until it dies).
pub struct WeightPublisher<D: Device, B: IpcDriver> {
    producer: IpcProducer<D, B>,
    device: u32,
    checked: CheckedBatch,
    metas: Vec<TensorMeta>,
    channel: Channel,
    event: B::Event,
    event_handle: EventHandle,
    slots: Mutex<Vec<(Arc<RefCounterFile>, usize)>>,
    closed: bool,
    /// The chunks of expandable segments the tensors lie in, exported once each: what consumers
    /// take copies of, open until the publication is dropped.
    _chunk_fds: Vec<OwnedFd>,
}

impl<D: Device, B: IpcDriver> std::fmt::Debug for WeightPublisher<D, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightPublisher")
            .field("device", &self.device)
            .field("tensors", &self.metas.len())
            .field("channel", self.channel.name())
            .field("version", &self.channel.published())
            .finish_non_exhaustive()
    }
}

impl<D: Device, B: IpcDriver> WeightPublisher<D, B> {
    /// Publishes `tensors` of `device`: finds the memory under each and makes the version channel
    /// and event. Version 0 is not announced yet: call [`publish`](Self::publish) once the weights
    /// are written.
    ///
    /// Memory of `cuMemAlloc` (the caching allocators of PyTorch and tensormem, by default) is
    /// found by its allocation (`cuMemGetAddressRange`) and named by one CUDA IPC memory handle
    /// per allocation. Memory of the virtual memory management calls (`cuMemCreate` + `cuMemMap`:
    /// both allocators' expandable segments) has no such handle: each chunk mapped under a tensor
    /// is exported once as a file descriptor ([`IpcDriver::export_mapping`]), which the publisher
    /// keeps open while it lives, and chunks that lie side by side travel as one range
    /// ([`crate::batch#ranges-of-expandable-segments`]); consumers take copies of the descriptors
    /// as for any share of such memory ([`crate::chunks`]). The chunks must have been made
    /// exportable (`cuMemCreate` with the POSIX file-descriptor handle type, which both
    /// allocators ask for), and the chunks under one tensor must be of one size.
    ///
    /// # Safety
    ///
    /// Each tensor's bytes (from `ptr`, its [`span`](TensorMeta::span)) are device memory of this
    /// process on `device`, and stay allocated (and, for chunks, mapped) until the publisher is
    /// dropped and no consumer holds it ([`wait_released`](Self::wait_released)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBatch`] for no tensors, a name given twice for different bytes, tensors that
    /// partly overlap, a tensor past its allocation or past the chunks mapped under it, chunks of
    /// different sizes under one tensor, or memory with neither a CUDA IPC memory handle nor
    /// exportable chunks (the message names what the driver answered to both);
    /// [`Error::ReceivedMemory`] for memory this process received from another;
    /// [`Error::Driver`] where the driver refuses another call; [`Error::WeightsChannel`] if the
    /// channel's file cannot be made.
    pub unsafe fn new(
        producer: &IpcProducer<D, B>,
        device: u32,
        tensors: &[PublishedTensor],
    ) -> Result<Self> {
        let driver = producer.driver_arc();
        if tensors.is_empty() {
            return Err(Error::InvalidBatch {
                problem: "nothing to publish; pass at least one tensor".into(),
            });
        }
        let PublishedMemory {
            checked,
            metas,
            chunk_fds,
            chunk_segments,
        } = memory::find(producer, device, tensors)?;
        let raw: Vec<RawFd> = chunk_fds.iter().map(AsRawFd::as_raw_fd).collect();
        // Consumers that may not use pidfd_getfd ask this process's descriptor socket; the
        // descriptors stay open (owned here) while the publication lives.
        crate::chunks::offer(&raw);
        let event = driver.create_event(device)?;
        let event_handle = driver.event_handle(&event)?;
        let channel = Channel::create(producer.file_names())?;
        tracing::debug!(
            target: "tensormem_ipc",
            device,
            tensors = tensors.len(),
            segments = checked.segments().len(),
            chunk_segments,
            chunks = chunk_fds.len(),
            channel = %channel.name(),
            "weights published"
        );
        Ok(Self {
            producer: producer.clone(),
            device,
            checked,
            metas,
            channel,
            event,
            event_handle,
            slots: Mutex::new(Vec::new()),
            closed: false,
            _chunk_fds: chunk_fds,
        })
    }

    /// A message for one more consumer: the publication with a ref-counter slot of its own. Send
    /// its bytes ([`WeightsMessage::encode`]) to the consumer, which opens it with
    /// [`WeightSubscriber::open`](super::WeightSubscriber::open).
    ///
    /// # Errors
    ///
    /// [`Error::RefCounterFile`] if no slot can be had; [`Error::PublicationClosed`] after
    /// [`close`](Self::close).
    pub fn message(&self) -> Result<WeightsMessage> {
        if self.closed {
            return Err(Error::PublicationClosed {
                pid: std::process::id(),
            });
        }
        let (file, slot) = self.producer.message_slot()?;
        let batch = self.checked.clone().into_handle(
            self.device,
            file.name().clone(),
            slot as u64,
            None,
            self.producer.id(),
        );
        self.slots.lock().push((file, slot));
        Ok(WeightsMessage {
            batch,
            metas: self.metas.clone(),
            channel: self.channel.name().clone(),
            event: self.event_handle,
        })
    }

    /// Announces a new version of the weights: records the publication's event on `stream` (the
    /// stream that wrote them) and makes the version visible to consumers. Returns its number (1,
    /// 2, ...).
    ///
    /// Write the weights again only after [`wait_installed`](Self::wait_installed) for this
    /// version: a consumer may be reading them until then.
    ///
    /// # Errors
    ///
    /// [`Error::Driver`] if the event cannot be recorded.
    pub fn publish(&self, stream: StreamId) -> Result<u64> {
        self.producer
            .driver_arc()
            .record_event(self.device, &self.event, stream)?;
        let version = self.channel.announce();
        tracing::trace!(target: "tensormem_ipc", version, "weights version announced");
        Ok(version)
    }

    /// The last version announced (0 before the first).
    #[must_use]
    pub fn version(&self) -> u64 {
        self.channel.published()
    }

    /// Waits until every subscribed consumer has installed `version` (consumers that died are
    /// skipped, with a `warn` event). Then the weights may be written again. A consumer that has
    /// not opened its message yet reads nothing and is not waited for: to wait for it too, have it
    /// say so once it opened (as a first sync does).
    ///
    /// # Errors
    ///
    /// [`Error::WeightsTimedOut`] after `timeout` (`None`: no limit), naming nobody's memory
    /// as lost: call again, or close.
    pub fn wait_installed(&self, version: u64, timeout: Option<Duration>) -> Result<()> {
        wait_until(
            timeout,
            "every consumer to install the version",
            || Ok(self.channel.lagging(version).is_empty().then_some(())),
            || None,
        )
    }

    /// How many consumers hold the publication's memory now (consumers that died are not counted:
    /// their slots are reclaimed here).
    #[must_use]
    pub fn holders(&self) -> usize {
        let mut slots = self.slots.lock();
        slots.retain(|(file, slot)| {
            if matches!(file.value(*slot), Ok(v) if v <= 0) {
                return false;
            }
            if file.reclaim_if_owner_dead(*slot).is_some() {
                tracing::warn!(
                    target: "tensormem_ipc",
                    "a weights consumer died subscribed; its hold was reclaimed"
                );
                return false;
            }
            !(self.closed && file.expire_if_unclaimed(*slot))
        });
        slots.len()
    }

    /// Closes the publication: consumers' waits for a next version end with
    /// [`Error::PublicationClosed`], messages not opened yet can no longer be opened, and no new
    /// message is made. Consumers that opened it keep their mappings until they drop their
    /// subscription ([`wait_released`](Self::wait_released) waits for that).
    pub fn close(&mut self) {
        self.closed = true;
        self.channel.close();
        let _ = self.holders();
    }

    /// Closes the publication and waits until no consumer holds its memory (they dropped their
    /// subscriptions, or died). Then the memory may be freed.
    ///
    /// # Errors
    ///
    /// [`Error::WeightsTimedOut`] after `timeout` (`None`: no limit) while consumers still hold it.
    pub fn wait_released(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.close();
        wait_until(
            timeout,
            "every consumer to let go of the publication",
            || Ok((self.holders() == 0).then_some(())),
            || None,
        )
    }
}

impl<D: Device, B: IpcDriver> Drop for WeightPublisher<D, B> {
    fn drop(&mut self) {
        self.close();
        let holding = self.holders();
        if holding > 0 {
            tracing::warn!(
                target: "tensormem_ipc",
                consumers = holding,
                "a weights publication was dropped while consumers still map its memory; free that memory only after they let go (WeightPublisher::wait_released)"
            );
        }
    }
}
