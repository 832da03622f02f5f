//! The streams the CUDA backend accepts: a [`StreamId`] is a number anyone can write, but the driver
//! must only ever see handles of live streams.
//!
//! Every stream made by [`CudaBackend::create_stream`](super::CudaBackend::create_stream) or handed
//! over with [`CudaBackend::register_stream`](super::CudaBackend::register_stream) is entered here,
//! process-wide, under its handle value. An entry holds the stream weakly until the allocator first
//! uses it (a block allocated on it, a `record_stream`), and from then on strongly ("pinned"): a
//! stream the allocator may record an event on stays alive for the rest of the process, as PyTorch's
//! streams do. Streams never used with the allocator are destroyed when their owner drops them.
//!
//! The legacy default stream (0) and the per-thread default stream (2) are always accepted.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Weak};

use cudarc::driver::CudaStream as CudarcStream;
use parking_lot::RwLock;

use crate::device::{DeviceError, DeviceResult, StreamId};

/// `CU_STREAM_PER_THREAD`.
pub(crate) const PER_THREAD_STREAM: u64 = 0x2;

struct Entry {
    /// The device ordinal of the stream's context.
    ordinal: u32,
    weak: Weak<CudarcStream>,
    /// Set once the allocator used the stream: keeps it alive.
    pinned: Option<Arc<CudarcStream>>,
}

static STREAMS: LazyLock<RwLock<HashMap<u64, Entry>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Enters `stream` (of device `ordinal`), weakly, or pinned when `pin`. Returns its id.
pub(crate) fn register(ordinal: u32, stream: &Arc<CudarcStream>, pin: bool) -> StreamId {
    let id = stream.cu_stream() as u64;
    if id == 0 || id == PER_THREAD_STREAM {
        return StreamId(id);
    }
    let mut streams = STREAMS.write();
    // Forget streams that died unused (their handle values may come back for new streams).
    streams.retain(|_, e| e.pinned.is_some() || e.weak.strong_count() > 0);
    let entry = streams.entry(id).or_insert_with(|| Entry {
        ordinal,
        weak: Arc::downgrade(stream),
        pinned: None,
    });
    if entry.pinned.is_none() && entry.weak.strong_count() == 0 {
        // A dead entry under a reused handle value. (Two live wrappers of one handle name the same
        // live stream: the entry stays.)
        *entry = Entry {
            ordinal,
            weak: Arc::downgrade(stream),
            pinned: None,
        };
    }
    if pin {
        entry.pinned = Some(Arc::clone(stream));
    }
    StreamId(id)
}

/// Checks that `stream` names a live stream of device `ordinal` (or a default stream), and pins it:
/// from now on it stays alive, so the allocator may record events on it at any later time.
///
/// # Errors
/// [`DeviceError::UnknownStream`] otherwise.
pub(crate) fn check_and_pin(ordinal: u32, stream: StreamId) -> DeviceResult<()> {
    if stream.0 == 0 || stream.0 == PER_THREAD_STREAM {
        return Ok(());
    }
    let unknown = || DeviceError::UnknownStream {
        stream,
        device: ordinal,
    };
    {
        let streams = STREAMS.read();
        match streams.get(&stream.0) {
            Some(e) if e.ordinal != ordinal => return Err(unknown()),
            Some(e) if e.pinned.is_some() => return Ok(()),
            Some(_) => {}
            None => return Err(unknown()),
        }
    }
    let mut streams = STREAMS.write();
    let Some(entry) = streams.get_mut(&stream.0) else {
        return Err(unknown());
    };
    if entry.ordinal != ordinal {
        return Err(unknown());
    }
    if entry.pinned.is_none() {
        match entry.weak.upgrade() {
            Some(live) => entry.pinned = Some(live),
            None => {
                streams.remove(&stream.0);
                return Err(unknown());
            }
        }
    }
    Ok(())
}

/// The cudarc stream behind `stream`, if it is a registered live stream of device `ordinal`.
pub(crate) fn lookup(ordinal: u32, stream: StreamId) -> Option<Arc<CudarcStream>> {
    let streams = STREAMS.read();
    let entry = streams.get(&stream.0)?;
    (entry.ordinal == ordinal)
        .then(|| entry.pinned.clone().or_else(|| entry.weak.upgrade()))
        .flatten()
}
