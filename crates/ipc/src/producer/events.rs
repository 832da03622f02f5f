//! The producer's interprocess events: a pool of events made once and lent to one share at a
//! time, within the budget of [`MAXIMUM_EVENTS_TO_USE`](super::MAXIMUM_EVENTS_TO_USE), and the slot
//! and event every share or batch takes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tensormem_cuda_alloc::{Device, StreamId};

use super::ProducerInner;
use crate::driver::{EventHandle, IpcDriver};
use crate::error::Result;
use crate::refcounter::RefCounterFile;

impl<D: Device, B: IpcDriver> ProducerInner<D, B> {
    /// A ref-counter slot for one message, and the event (with its handle) that orders the
    /// consumer after the work queued on `stream` so far; the slot goes back unsent if the event
    /// cannot be had.
    pub(super) fn slot_and_event(&self, device: u32, stream: StreamId) -> Result<SlotAndEvent<B>> {
        let (file, slot) = self.take_slot()?;
        let event = match self.event(device, stream) {
            Ok(event) => event,
            Err(err) => {
                file.release_unsent(slot);
                return Err(err);
            }
        };
        let event_handle = event
            .as_ref()
            .and_then(|g| g.pooled.as_ref())
            .map(|p| p.handle);
        Ok((file, slot, event, event_handle))
    }

    /// An event recorded on `stream` (from the pool, or new while fewer than the budget exist), or
    /// `None` when the stream has no pending work (nothing to wait for), or `None` after
    /// synchronizing the stream when every event is in use.
    fn event(&self, device: u32, stream: StreamId) -> Result<Option<EventGuard<B>>> {
        // An idle stream needs no event: every write queued on it has completed.
        if self.config.skip_event_when_idle && self.driver.stream_idle(device, stream)? {
            self.counters.idle_stream.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let pool = &self.events;
        let pooled = {
            let mut idle = pool.idle.lock();
            idle.iter()
                .position(|e| e.device == device)
                .map(|i| idle.swap_remove(i))
        };
        let pooled = match pooled {
            Some(pooled) => pooled,
            None => {
                let budget = self.config.max_events;
                if pool
                    .live
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < budget).then_some(n + 1)
                    })
                    .is_err()
                {
                    self.driver.synchronize_stream(device, stream)?;
                    self.counters.synchronized.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                let made = self.driver.create_event(device).and_then(|event| {
                    let handle = self.driver.event_handle(&event)?;
                    Ok(PooledEvent {
                        device,
                        event,
                        handle,
                    })
                });
                match made {
                    Ok(pooled) => pooled,
                    Err(err) => {
                        pool.live.fetch_sub(1, Ordering::AcqRel);
                        return Err(err.into());
                    }
                }
            }
        };
        pool.lent.fetch_add(1, Ordering::AcqRel);
        // From here the guard gives the event back to the pool, also if recording fails.
        let guard = EventGuard {
            pooled: Some(pooled),
            pool: Arc::clone(pool),
        };
        if let Some(pooled) = &guard.pooled {
            self.driver.record_event(device, &pooled.event, stream)?;
        }
        Ok(Some(guard))
    }
}

/// An interprocess event with its exported handle (taken once).
pub(super) struct PooledEvent<B: IpcDriver> {
    device: u32,
    event: B::Event,
    handle: EventHandle,
}

/// The producer's interprocess events: idle ones ready for the next share, and how many exist and
/// are lent out. An event is reused only after the share it served was released (its slot back to
/// 0), when the consumer has waited on it already; events are destroyed with the producer.
pub(super) struct EventPool<B: IpcDriver> {
    idle: Mutex<Vec<PooledEvent<B>>>,
    live: AtomicUsize,
    lent: AtomicUsize,
}

impl<B: IpcDriver> EventPool<B> {
    pub(super) fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            live: AtomicUsize::new(0),
            lent: AtomicUsize::new(0),
        }
    }

    /// Events lent to shares now.
    pub(super) fn lent(&self) -> usize {
        self.lent.load(Ordering::Relaxed)
    }
}

/// A message's ref-counter file and slot, its event if it needs one, and that event's handle.
pub(super) type SlotAndEvent<B> = (
    Arc<RefCounterFile>,
    usize,
    Option<EventGuard<B>>,
    Option<EventHandle>,
);

/// An event lent to one share; returns to the pool when the share goes.
pub(super) struct EventGuard<B: IpcDriver> {
    pooled: Option<PooledEvent<B>>,
    pool: Arc<EventPool<B>>,
}

impl<B: IpcDriver> Drop for EventGuard<B> {
    fn drop(&mut self) {
        if let Some(pooled) = self.pooled.take() {
            self.pool.idle.lock().push(pooled);
        }
        self.pool.lent.fetch_sub(1, Ordering::AcqRel);
    }
}
