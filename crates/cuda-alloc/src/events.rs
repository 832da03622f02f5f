//! Outstanding events of blocks freed while other streams still used them (`record_stream`).
//!
//! Freeing a block that was recorded on other streams records an event on each of them; the block
//! returns to its pool once all its events have completed. Events are queued per stream in recording
//! order (PyTorch's `cuda_events`), and each queue is processed from its front until an event is not
//! done yet, so one slow stream does not hold up the others. Events are pooled and reused (PyTorch's
//! `EventPool`): creating one can be expensive.

use std::collections::{BTreeMap, VecDeque};

use crate::device::StreamId;

/// A block, named by its shard and arena index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockRef {
    /// The shard's index.
    pub(crate) shard: u32,
    /// The block's index in the shard's arena.
    pub(crate) block: u32,
}

/// An event recorded on a stream for a block.
#[derive(Debug)]
pub(crate) struct PendingEvent<E> {
    pub(crate) event: E,
    pub(crate) block: BlockRef,
}

/// Every outstanding event, the blocks whose events wait for the end of graph captures, and the pool
/// of spare events. Guarded by one mutex; taken after a shard lock, never before one.
#[derive(Debug)]
pub(crate) struct EventQueues<E> {
    /// Per stream the events were recorded on, in recording order; streams visited in id order.
    pub(crate) queues: BTreeMap<StreamId, VecDeque<PendingEvent<E>>>,
    /// Blocks freed with stream uses while a capture was underway (PyTorch's
    /// `needs_events_deferred_until_no_capture`): their events are recorded once no capture is.
    pub(crate) deferred: Vec<BlockRef>,
    /// Spare events.
    pub(crate) spare: Vec<E>,
}

impl<E> Default for EventQueues<E> {
    fn default() -> Self {
        EventQueues {
            queues: BTreeMap::new(),
            deferred: Vec::new(),
            spare: Vec::new(),
        }
    }
}

impl<E> EventQueues<E> {
    /// Entries outstanding (queued events plus deferred blocks).
    pub(crate) fn outstanding(&self) -> usize {
        self.queues.values().map(VecDeque::len).sum::<usize>() + self.deferred.len()
    }
}
