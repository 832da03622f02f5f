//! The consumer's side of a batch: [`ReceivedBatch`], every view of a batch opened in this process
//! (by [`IpcConsumer::open_batch`](crate::IpcConsumer::open_batch)).

use std::sync::Arc;

use tensormem_cuda_alloc::{DeviceAddress, StreamId};
use tensormem_shm::ShmName;

use super::wire::find;
use crate::cache::Lease;
use crate::driver::IpcDriver;
use crate::error::Result;
use crate::opened::{release_held, OpenedBase, SegmentKey};
use crate::refcounter::MappedCounterFile;
use crate::view::{DeviceElement, DeviceView};

/// One tensor of a [`ReceivedBatch`]: its name, where it is mapped in this process, its length.
#[derive(Debug, Clone)]
pub struct ReceivedView {
    name: String,
    ptr: DeviceAddress,
    len: u64,
    /// The batch's segment it lies in (`None` for a zero-byte view of no memory).
    segment: Option<u32>,
}

impl ReceivedView {
    /// The name the producer gave it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device address in this process (null for a zero-byte view of no memory).
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        self.ptr
    }

    /// Its length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The view as elements of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::BadView`](crate::Error::BadView) if the length is not a multiple of `T`'s size or
    /// the address not aligned to it.
    pub fn view<T: DeviceElement>(&self) -> Result<DeviceView<'_, T>> {
        DeviceView::new(self.ptr, self.len)
    }
}

/// A batch another process shared, open in this one (from
/// [`IpcConsumer::open_batch`](crate::IpcConsumer::open_batch)). Dropping it synchronizes its
/// streams and releases the message's one slot: from then on the producer may free or reuse every
/// allocation of the batch.
pub struct ReceivedBatch<B: IpcDriver> {
    pub(crate) driver: Arc<B>,
    pub(crate) device: u32,
    pub(crate) stream: StreamId,
    pub(crate) more_streams: Vec<StreamId>,
    pub(crate) views: Vec<ReceivedView>,
    pub(crate) by_name: Vec<u32>,
    pub(crate) slot: usize,
    pub(crate) file: Lease<ShmName, MappedCounterFile>,
    pub(crate) segments: Vec<Lease<SegmentKey, OpenedBase<B>>>,
}

impl<B: IpcDriver> std::fmt::Debug for ReceivedBatch<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceivedBatch")
            .field("device", &self.device)
            .field("views", &self.views.len())
            .field("segments", &self.segments.len())
            .field("file", self.file.get().name())
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl<B: IpcDriver> ReceivedBatch<B> {
    pub(crate) fn make_view(
        name: String,
        ptr: DeviceAddress,
        len: u64,
        segment: Option<u32>,
    ) -> ReceivedView {
        ReceivedView {
            name,
            ptr,
            len,
            segment,
        }
    }

    /// For each view, in order, the piece of memory it lies in as mapped here: where its
    /// segment's mapping starts (a base allocation, or the one range the chunks of an expandable
    /// segment are mapped into, contiguously), or a number of its own for a view of no memory.
    /// Copies may run through a region without a gap; two regions are never one, even where their
    /// mappings happen to be adjacent.
    pub(crate) fn regions(&self) -> Vec<u64> {
        self.views
            .iter()
            .enumerate()
            .map(|(i, view)| match view.segment {
                Some(s) => self.segments[s as usize].get().ptr.0,
                None => u64::MAX - i as u64,
            })
            .collect()
    }

    /// The device ordinal.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The views, in the producer's order.
    #[must_use]
    pub fn views(&self) -> &[ReceivedView] {
        &self.views
    }

    /// The view named `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&ReceivedView> {
        find(&self.by_name, |i| self.views[i].name.as_str(), name).map(|i| &self.views[i])
    }

    /// How many views.
    #[must_use]
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether there are no views (never, for a batch that opened).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }

    /// How many segments were opened for it (one memory handle, or one range of chunks, each).
    #[must_use]
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// Records that work on `stream` uses the batch's memory: it is synchronized too before the
    /// slot is released.
    pub fn use_on(&mut self, stream: StreamId) {
        if stream != self.stream && !self.more_streams.contains(&stream) {
            self.more_streams.push(stream);
        }
    }
}

impl<B: IpcDriver> Drop for ReceivedBatch<B> {
    fn drop(&mut self) {
        release_held(
            &*self.driver,
            self.device,
            std::iter::once(&self.stream).chain(&self.more_streams),
            self.file.get(),
            self.slot,
        );
        // The leases (file mapping, opened segments) are released after this, in field order.
    }
}
