//! The consumer's side: [`WeightSubscriber`].

use std::sync::Arc;
use std::time::Duration;

use tensormem_cuda_alloc::{DeviceAddress, StreamId};

use super::channel::Channel;
use super::message::WeightsMessage;
use super::meta::TensorMeta;
use super::plan::{layout_key, InstallPlan, PlacedTensor, PlanOptions};
use crate::batch::ReceivedBatch;
use crate::driver::IpcDriver;
use crate::error::Result;
use crate::received::IpcConsumer;

/// A plan prepared by [`WeightSubscriber::prepare`], to pass to
/// [`install`](WeightSubscriber::install).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanId(usize);

impl PlanId {
    /// Its number among the subscriber's plans (0, 1, ... in the order they were first
    /// prepared), for callers that keep plans as numbers (a C interface); back with
    /// [`WeightSubscriber::plan_id`].
    #[must_use]
    pub fn index(self) -> usize {
        self.0
    }
}

/// A publication open in this process (see [`crate::weights`]): the producer's tensors mapped here
/// (zero copy), its versions followed, and installs into the consumer's own tensors.
///
/// While it lives, the producer's memory stays allocated for it; dropping it lets go (and a
/// consumer that dies lets go too: its slot is reclaimed).
pub struct WeightSubscriber<B: IpcDriver> {
    batch: ReceivedBatch<B>,
    metas: Vec<TensorMeta>,
    channel: Channel,
    slot: usize,
    event: B::ImportedEvent,
    driver: Arc<B>,
    installed: u64,
    plans: Vec<InstallPlan>,
}

impl<B: IpcDriver> std::fmt::Debug for WeightSubscriber<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSubscriber")
            .field("device", &self.batch.device())
            .field("tensors", &self.metas.len())
            .field("installed", &self.installed)
            .field("plans", &self.plans.len())
            .finish_non_exhaustive()
    }
}

impl<B: IpcDriver> WeightSubscriber<B> {
    /// Opens a publication: maps each of its allocations (once per process: later messages of the
    /// same producer memory reuse the mapping while it is open), claims the message's slot, opens
    /// the producer's version event and joins its channel. `stream` is where this process will use
    /// the memory; it is synchronized before the slot is given back.
    ///
    /// # Errors
    ///
    /// As [`IpcConsumer::open_batch`]; [`Error::WeightsChannel`](crate::Error::WeightsChannel) if the channel cannot be joined
    /// (the producer closed the publication or exited).
    pub fn open(
        consumer: &IpcConsumer<B>,
        message: &WeightsMessage,
        stream: StreamId,
    ) -> Result<Self> {
        let driver = Arc::clone(consumer.driver());
        let device = message.batch.device();
        let channel = Channel::open(&message.channel)?;
        let event = driver.open_event_handle(device, &message.event)?;
        let batch = consumer.open_batch(&message.batch, stream)?;
        let slot = channel.attach()?;
        tracing::debug!(
            target: "tensormem_ipc",
            device,
            tensors = message.metas.len(),
            segments = batch.segments(),
            "weights publication opened"
        );
        Ok(Self {
            batch,
            metas: message.metas.clone(),
            channel,
            slot,
            event,
            driver,
            installed: 0,
            plans: Vec::new(),
        })
    }

    /// The device ordinal.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.batch.device()
    }

    /// The published tensors as mapped here: name, address of the first element, element type,
    /// shape and strides. They alias the producer's memory (zero copy): read them only between
    /// [`begin`](Self::begin) and [`finish`](Self::finish) (or inside [`install`](Self::install)),
    /// when no new version is being written.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = PlacedTensor<'_>> {
        self.batch
            .views()
            .iter()
            .zip(&self.metas)
            .map(|(view, meta)| PlacedTensor {
                name: view.name(),
                ptr: view.ptr(),
                meta,
            })
    }

    /// The last version installed (0 before the first).
    #[must_use]
    pub fn installed(&self) -> u64 {
        self.installed
    }

    /// The plan that copies every published tensor into the destination of the same name, checked
    /// and built once for this pair of layouts (asking again for the same destinations returns
    /// the same plan without building it). Tensors adjacent on both sides inside one region of
    /// each side are copied as one range: on the sources' side a segment of the publication as
    /// mapped here (an allocation, or a range of expandable-segment chunks, mapped contiguously,
    /// so merging runs across its chunk boundaries but never from one segment into another), on
    /// the destinations' side the allocation or mapping `cuMemGetAddressRange` gives (see
    /// [`crate::weights#how-copies-are-merged`]).
    ///
    /// # Errors
    ///
    /// [`Error::WeightsMismatch`](crate::Error::WeightsMismatch) as [`InstallPlan::build`]: nothing was written.
    pub fn prepare(
        &mut self,
        destinations: &[PlacedTensor<'_>],
        options: PlanOptions,
    ) -> Result<PlanId> {
        let sources: Vec<PlacedTensor<'_>> = self.tensors().collect();
        let key = layout_key(&sources, destinations);
        if let Some(i) = self.plans.iter().position(|p| p.key() == key) {
            return Ok(PlanId(i));
        }
        let device = self.batch.device();
        // Sources: the segment each lies in as mapped here (an allocation, or the one range the
        // chunks of an expandable segment are mapped into); destinations: cuMemGetAddressRange.
        let source_regions = self.batch.regions();
        let destination_regions = regions(&*self.driver, device, destinations);
        let plan = InstallPlan::build_in_regions(
            &sources,
            &source_regions,
            destinations,
            &destination_regions,
            options,
        )?;
        drop(sources);
        self.plans.push(plan);
        Ok(PlanId(self.plans.len() - 1))
    }

    /// The plan numbered `index` ([`PlanId::index`]), if this subscriber prepared that many.
    #[must_use]
    pub fn plan_id(&self, index: usize) -> Option<PlanId> {
        (index < self.plans.len()).then_some(PlanId(index))
    }

    /// How many plans this subscriber prepared.
    #[must_use]
    pub fn plan_count(&self) -> usize {
        self.plans.len()
    }

    /// The plan `id` names.
    ///
    /// # Panics
    ///
    /// If `id` is not from this subscriber's [`prepare`](Self::prepare).
    #[must_use]
    pub fn plan(&self, id: PlanId) -> &InstallPlan {
        &self.plans[id.0]
    }

    /// Waits for a version newer than the last installed, then orders `stream` after the
    /// producer's writes of it (no host wait) and records that this consumer reads it. Copy from
    /// [`tensors`](Self::tensors) on `stream`, then call [`finish`](Self::finish). Returns the
    /// version.
    ///
    /// # Errors
    ///
    /// [`Error::WeightsTimedOut`](crate::Error::WeightsTimedOut) after `timeout` (`None`: no limit); [`Error::PublicationClosed`](crate::Error::PublicationClosed)
    /// when the producer closed the publication or died; [`Error::Driver`](crate::Error::Driver) if the stream cannot
    /// wait for the event.
    pub fn begin(&mut self, stream: StreamId, timeout: Option<Duration>) -> Result<u64> {
        let version = self.channel.wait_version(self.installed, timeout)?;
        self.channel.mark(self.slot, version, false);
        self.driver
            .wait_event(self.batch.device(), &self.event, stream)?;
        self.batch.use_on(stream);
        Ok(version)
    }

    /// Records that `version` (from [`begin`](Self::begin)) is installed: the producer may write
    /// the weights again. Call it once the copies that read the version have completed (the
    /// stream synchronized, or an event of it waited for).
    pub fn finish(&mut self, version: u64) {
        self.installed = self.installed.max(version);
        self.channel.mark(self.slot, version, true);
    }

    /// One whole sync: waits for the next version ([`begin`](Self::begin)), queues the plan's
    /// copies on `stream` in as few launches as the driver allows, synchronizes `stream` and
    /// records the version installed. Returns the version.
    ///
    /// `stream` may be of another device than the publication's (parameters on another GPU of
    /// the node): the copies then run on the stream's device, which is given peer access to the
    /// publication's device first (NVLink or PCIe peer copies).
    ///
    /// # Safety
    ///
    /// The destinations the plan was prepared for are device memory of this process on `stream`'s
    /// device, not in use by other work while the copies run, and still allocated.
    ///
    /// # Errors
    ///
    /// As [`begin`](Self::begin); [`Error::Driver`](crate::Error::Driver) if a copy or the synchronization fails (the
    /// version is then not recorded as installed).
    pub unsafe fn install(
        &mut self,
        plan: PlanId,
        stream: StreamId,
        timeout: Option<Duration>,
    ) -> Result<u64> {
        let version = self.begin(stream, timeout)?;
        // The copies run on the stream's device: the parameters may be on another GPU than the
        // publication, which that device then reads through peer access.
        let published_on = self.batch.device();
        let device = self.driver.stream_device(stream)?.unwrap_or(published_on);
        if device != published_on {
            self.driver.enable_peer_access(device, published_on)?;
        }
        let copies = self.plans[plan.0].copies();
        // SAFETY: the sources are the publication's views, mapped while `self` lives and inside
        // their allocations (checked when the message was decoded and opened), reachable from
        // `device` (its own, or through the peer access just enabled); the destinations are the
        // caller's obligation; the plan refused overlapping destinations.
        unsafe { self.driver.copy_batch(device, copies, stream)? };
        self.driver.synchronize_stream(device, stream)?;
        self.finish(version);
        Ok(version)
    }

    /// The address of the first element of the published tensor `name`, or `None`.
    #[must_use]
    pub fn ptr(&self, name: &str) -> Option<DeviceAddress> {
        self.batch.get(name).map(|v| v.ptr())
    }
}

impl<B: IpcDriver> Drop for WeightSubscriber<B> {
    fn drop(&mut self) {
        self.channel.detach(self.slot);
        // The batch (dropped next) synchronizes its streams and gives the slot back.
    }
}

/// The allocation (or, for memory of expandable segments, the chunk mapping) each destination
/// lies in: its base address (`cuMemGetAddressRange`), or a number of its own where the driver
/// does not know the address (then it merges with nothing).
fn regions<B: IpcDriver>(driver: &B, device: u32, tensors: &[PlacedTensor<'_>]) -> Vec<u64> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| match driver.address_range(device, t.ptr) {
            Ok((base, _)) => base.0,
            Err(_) => u64::MAX - i as u64,
        })
        .collect()
}
