//! [`BatchBuilder::share`](crate::BatchBuilder::share)'s work on the producer's side: each
//! allocation located in its segment (a base allocation, or the chunks of an expandable segment
//! under it), the segments collected once each, the batch checked, then one slot and at most one
//! event for the whole message, recorded in every allocation.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tensormem_cuda_alloc::{Device, StreamId};

use super::sent::SentSlot;
use super::{IpcProducer, SharedAllocation};
use crate::batch::{BatchHandle, BatchView, CheckedBatch, SegmentTable};
use crate::driver::IpcDriver;
use crate::error::{Error, Result};
use crate::handle::SegmentMemory;

impl<D: Device, B: IpcDriver> IpcProducer<D, B> {
    /// [`BatchBuilder::share`](crate::BatchBuilder::share)'s work.
    pub(crate) fn share_batch(
        &self,
        allocations: &mut [&mut SharedAllocation<D, B>],
        views: Vec<(usize, String, u64, u64)>,
        stream: StreamId,
    ) -> Result<BatchHandle> {
        let invalid = |problem: String| Error::InvalidBatch { problem };
        let producer = &self.inner;
        let Some(first) = allocations.first() else {
            return Err(invalid(
                "nothing was added; add allocations and views first".into(),
            ));
        };
        let device = first.sent().allocator.device().index();
        let mut table = SegmentTable::default();
        // Per allocation: its piece in the table and its address, `None` without memory.
        let mut pieces: Vec<Option<(usize, u64)>> = Vec::with_capacity(allocations.len());
        for allocation in allocations.iter_mut() {
            let on = allocation.sent().allocator.device().index();
            if on != device {
                return Err(invalid(format!(
                    "allocations of devices {device} and {on}; a batch is of one device (send \
                     one batch per device)"
                )));
            }
            pieces.push(allocation.locate()?.map(|located| {
                let ptr = located.base + located.offset;
                let piece = match located.memory {
                    SegmentMemory::Allocation(handle) => {
                        table.add_allocation(located.base, located.base_size, handle)
                    }
                    SegmentMemory::Chunks(chunks) => table.add_chunks(located.base, chunks),
                };
                (piece, ptr)
            }));
        }
        let (segments, placements) = table.finish();
        if segments.is_empty() {
            return Err(invalid(
                "no allocation of the batch has memory (all are zero-byte); share empty \
                 allocations one by one (IpcHandle::empty)"
                    .into(),
            ));
        }
        let chunk_segments = segments
            .iter()
            .filter(|s| matches!(s.memory, SegmentMemory::Chunks(_)))
            .count();
        let views: Vec<BatchView> = views
            .into_iter()
            .map(|(index, name, offset, len)| match pieces[index] {
                Some((piece, ptr)) => {
                    let placed = placements[piece];
                    BatchView {
                        name,
                        segment: Some(placed.segment),
                        offset: ptr - placed.base + offset,
                        len,
                    }
                }
                None => BatchView {
                    name,
                    segment: None,
                    offset: 0,
                    len: 0,
                },
            })
            .collect();
        // Checked before a slot is taken: the consumer refuses what fails here.
        let checked = CheckedBatch::new(segments, views).map_err(invalid)?;
        for allocation in allocations.iter_mut() {
            if let Some(sent) = allocation.sent.as_mut() {
                sent.prune(false);
            }
        }
        let (file, slot, event, event_handle) = producer.slot_and_event(device, stream)?;
        let shared_at = Instant::now();
        let event = event.map(Arc::new);
        for (allocation, piece) in allocations.iter_mut().zip(&pieces) {
            if piece.is_none() {
                continue; // no memory to hold
            }
            if let Some(sent) = allocation.sent.as_mut() {
                sent.slots.push(SentSlot {
                    file: Arc::clone(&file),
                    slot,
                    _event: event.clone(),
                    shared_at,
                    expires: producer.config.expire_unopened_batches,
                });
            }
        }
        producer.counters.shares.fetch_add(1, Ordering::Relaxed);
        let handle = checked.into_handle(
            device,
            file.name().clone(),
            slot as u64,
            event_handle,
            producer.id,
        );
        tracing::debug!(
            target: "tensormem_ipc",
            device,
            views = handle.views().len(),
            segments = handle.segments().len(),
            chunk_segments,
            file = %file.name(),
            slot,
            event = event_handle.is_some(),
            "batch shared"
        );
        Ok(handle)
    }
}
