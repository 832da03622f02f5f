//! The producer's side: [`WeightPublisher`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensormem_cuda_alloc::{Device, DeviceAddress, StreamId};

use super::channel::{wait_until, Channel};
use super::message::WeightsMessage;
use super::meta::TensorMeta;
use crate::batch::{BatchSegment, BatchView, CheckedBatch};
use crate::driver::{EventHandle, IpcDriver};
use crate::error::{Error, Result};
use crate::producer::IpcProducer;
use crate::refcounter::RefCounterFile;

/// One tensor to publish: its name, the address of its first element, what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedTensor {
    /// The name consumers know it by (a state dict's key); distinct within a publication, except
    /// for tied weights (two names, the same bytes and layout).
    pub name: String,
    /// The address of its first element (PyTorch's `data_ptr()`).
    pub ptr: DeviceAddress,
    /// Element type, shape and strides.
    pub meta: TensorMeta,
}

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
    /// Publishes `tensors` of `device`: finds the allocation under each (`cuMemGetAddressRange`),
    /// exports one memory handle per allocation, and makes the version channel and event. Version
    /// 0 is not announced yet: call [`publish`](Self::publish) once the weights are written.
    ///
    /// # Safety
    ///
    /// Each tensor's bytes (from `ptr`, its [`span`](TensorMeta::span)) are device memory of this
    /// process on `device`, in an allocation made by `cuMemAlloc` (PyTorch's and tensormem's
    /// caching allocators without expandable segments), and stay allocated until the publisher is
    /// dropped and no consumer holds it ([`wait_released`](Self::wait_released)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBatch`] for no tensors, a name given twice for different bytes, tensors that
    /// partly overlap, a tensor past its allocation, or memory without a CUDA IPC memory handle
    /// (an expandable segment's: publish from an allocator without expandable segments);
    /// [`Error::Driver`] where the driver refuses another call; [`Error::WeightsChannel`] if the
    /// channel's file cannot be made.
    pub unsafe fn new(
        producer: &IpcProducer<D, B>,
        device: u32,
        tensors: &[PublishedTensor],
    ) -> Result<Self> {
        let invalid = |problem: String| Error::InvalidBatch { problem };
        let driver = producer.driver_arc();
        if tensors.is_empty() {
            return Err(invalid(
                "nothing to publish; pass at least one tensor".into(),
            ));
        }
        let mut segments: Vec<BatchSegment> = Vec::new();
        let mut index_of_base: HashMap<u64, u32> = HashMap::new();
        let mut views = Vec::with_capacity(tensors.len());
        let mut metas = Vec::with_capacity(tensors.len());
        for t in tensors {
            t.meta
                .check()
                .map_err(|p| invalid(format!("tensor {:?}: {p}", t.name)))?;
            let len = t.meta.span();
            if len == 0 {
                views.push(BatchView {
                    name: t.name.clone(),
                    segment: None,
                    offset: 0,
                    len: 0,
                });
                metas.push(t.meta.clone());
                continue;
            }
            let (base, size) = driver.address_range(device, t.ptr)?;
            let offset = t.ptr.0 - base.0;
            if offset.checked_add(len).is_none_or(|end| end > size as u64) {
                return Err(invalid(format!(
                    "tensor {:?} ({}) spans {len} bytes from offset {offset} of an allocation of \
                     {size} bytes",
                    t.name, t.meta
                )));
            }
            let segment = match index_of_base.get(&base.0) {
                Some(&i) => i,
                None => {
                    let mem_handle = producer.handle_of(device, base, size).map_err(|err| {
                        invalid(format!(
                            "tensor {:?} lies in memory that has no CUDA IPC memory handle \
                             ({err}); memory of an expandable segment (cuMemCreate) cannot be \
                             published: allocate the weights with expandable_segments:False",
                            t.name
                        ))
                    })?;
                    segments.push(BatchSegment {
                        mem_handle,
                        size: size as u64,
                    });
                    let i = (segments.len() - 1) as u32;
                    index_of_base.insert(base.0, i);
                    i
                }
            };
            views.push(BatchView {
                name: t.name.clone(),
                segment: Some(segment),
                offset,
                len,
            });
            metas.push(t.meta.clone());
        }
        if segments.is_empty() {
            return Err(invalid(
                "every tensor is empty (no bytes); there is no memory to publish".into(),
            ));
        }
        let checked = CheckedBatch::new(segments, views).map_err(invalid)?;
        let event = driver.create_event(device)?;
        let event_handle = driver.event_handle(&event)?;
        let channel = Channel::create(producer.file_names())?;
        tracing::debug!(
            target: "tensormem_ipc",
            device,
            tensors = tensors.len(),
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
