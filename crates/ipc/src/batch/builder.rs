//! The producer's side of a batch: [`BatchBuilder`] collects allocations and views and shares them
//! as one [`BatchHandle`].

use tensormem_cuda_alloc::{Device, StreamId};

use super::wire::BatchHandle;
use crate::driver::IpcDriver;
use crate::error::{Error, Result};
use crate::producer::{IpcProducer, SharedAllocation};

/// Collects allocations and views for one batch message (see the
/// [module docs](crate::batch)); made by [`IpcProducer::batch`].
///
/// Each allocation is borrowed mutably until [`share`](Self::share) (or until the builder is
/// dropped): sharing records the message's slot in each of them, so that dropping one while the
/// consumer holds the batch puts it in the limbo.
pub struct BatchBuilder<'a, D: Device, B: IpcDriver> {
    producer: &'a IpcProducer<D, B>,
    allocations: Vec<&'a mut SharedAllocation<D, B>>,
    /// (allocation, name, offset in the allocation, length).
    views: Vec<(usize, String, u64, u64)>,
}

impl<D: Device, B: IpcDriver> IpcProducer<D, B> {
    /// A batch: many allocations and views of them shared as one message, with one slot, at most
    /// one event and one memory handle (or range of expandable-segment chunks) per segment (see
    /// [`crate::batch`]).
    pub fn batch(&self) -> BatchBuilder<'_, D, B> {
        BatchBuilder {
            producer: self,
            allocations: Vec::new(),
            views: Vec::new(),
        }
    }
}

impl<D: Device, B: IpcDriver> std::fmt::Debug for BatchBuilder<'_, D, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchBuilder")
            .field("allocations", &self.allocations.len())
            .field("views", &self.views.len())
            .finish_non_exhaustive()
    }
}

impl<'a, D: Device, B: IpcDriver> BatchBuilder<'a, D, B> {
    /// Adds an allocation without a view of it yet (add views with [`view`](Self::view)); returns
    /// its index in this batch.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBatch`] if the allocation was adopted by another producer (share it with
    /// that one).
    pub fn allocation(&mut self, allocation: &'a mut SharedAllocation<D, B>) -> Result<usize> {
        if !allocation.is_of(self.producer) {
            return Err(Error::InvalidBatch {
                problem: "the allocation was adopted by another IpcProducer; build the batch with \
                          the producer that adopted it"
                    .into(),
            });
        }
        self.allocations.push(allocation);
        Ok(self.allocations.len() - 1)
    }

    /// A view named `name` of `len` bytes at `offset` of allocation `index` (from
    /// [`allocation`](Self::allocation) or [`whole`](Self::whole)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBatch`] for an index not added, or a range past the allocation's bytes
    /// ([`SharedAllocation::nbytes`]).
    pub fn view(
        &mut self,
        index: usize,
        name: impl Into<String>,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let name = name.into();
        let Some(allocation) = self.allocations.get(index) else {
            return Err(Error::InvalidBatch {
                problem: format!(
                    "view {name:?} names allocation {index}, but {} were added",
                    self.allocations.len()
                ),
            });
        };
        let nbytes = allocation.nbytes() as u64;
        if offset.checked_add(len).is_none_or(|end| end > nbytes) {
            return Err(Error::InvalidBatch {
                problem: format!(
                    "view {name:?} claims {len} bytes at offset {offset} of an allocation of \
                     {nbytes} bytes; keep offset + len <= nbytes()"
                ),
            });
        }
        self.views.push((index, name, offset, len));
        Ok(())
    }

    /// Adds an allocation and a view of all its bytes named `name`; returns its index.
    ///
    /// # Errors
    ///
    /// As [`allocation`](Self::allocation).
    pub fn whole(
        &mut self,
        allocation: &'a mut SharedAllocation<D, B>,
        name: impl Into<String>,
    ) -> Result<usize> {
        let len = allocation.nbytes() as u64;
        let index = self.allocation(allocation)?;
        self.views.push((index, name.into(), 0, len));
        Ok(index)
    }

    /// Shares everything added as one message: one slot (set to 1) for the whole batch, at most one
    /// event recorded on `stream` (none when `stream` is idle), one memory handle per segment, and
    /// for allocations of expandable segments one range of chunks per run of chunks under them
    /// (see [`crate::batch#ranges-of-expandable-segments`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidBatch`] for a batch without views or without memory, allocations of
    /// several devices, duplicate names or overlapping views; [`Error::ReceivedMemory`] for memory
    /// this process received; [`Error::Allocator`], [`Error::RefCounterFile`], [`Error::Driver`]
    /// as [`SharedAllocation::share`]. Nothing is handed out then.
    pub fn share(self, stream: StreamId) -> Result<BatchHandle> {
        let Self {
            producer,
            mut allocations,
            views,
        } = self;
        producer.share_batch(&mut allocations, views, stream)
    }
}
