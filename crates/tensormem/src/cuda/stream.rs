//! Streams: each thread has a current stream per device (`torch.cuda.current_stream`), the legacy
//! default stream until set.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::cuda::BackendStream;
use tensormem_cuda_alloc::{Device, StreamId};

use super::device::{device_of, resolve};
use super::error::Result;

/// A stream of one device: the legacy default stream, or a non-blocking stream made with
/// [`Stream::new`]. Cheap to clone; a made stream is destroyed when its last clone is dropped (queued
/// work still runs).
#[derive(Clone)]
pub struct Stream {
    device: u32,
    /// `None` for the legacy default stream.
    owned: Option<Arc<BackendStream>>,
}

impl Stream {
    /// Creates a non-blocking stream on `device`, or on the current device (`torch.cuda.Stream()`).
    ///
    /// # Errors
    ///
    /// The errors of [`set_device`](super::set_device); the driver's errors.
    pub fn new(device: Option<u32>) -> Result<Stream> {
        let device = resolve(device)?;
        Ok(Stream {
            device,
            owned: Some(Arc::new(device_of(device)?.create_stream()?)),
        })
    }

    /// The legacy default stream (handle 0) of `device`.
    fn default_of(device: u32) -> Stream {
        Stream {
            device,
            owned: None,
        }
    }

    /// The stream's id: its handle value, 0 for the default stream (what the allocator, snapshots and
    /// `torch.cuda.current_stream().cuda_stream` use).
    #[must_use]
    pub fn id(&self) -> StreamId {
        self.owned.as_ref().map_or(StreamId::DEFAULT, |s| s.id())
    }

    /// The device the stream belongs to.
    #[must_use]
    pub fn device_index(&self) -> u32 {
        self.device
    }

    /// Whether this is the legacy default stream.
    #[must_use]
    pub fn is_default(&self) -> bool {
        self.owned.is_none()
    }

    /// The owned stream, for its operations (copies, host functions, events); `None` for the default
    /// stream.
    #[must_use]
    pub fn as_cuda_stream(&self) -> Option<&BackendStream> {
        self.owned.as_deref()
    }

    /// Waits for all work queued on the stream so far (`torch.cuda.Stream.synchronize`).
    ///
    /// # Errors
    ///
    /// The driver's errors.
    pub fn synchronize(&self) -> Result<()> {
        match &self.owned {
            Some(stream) => Ok(stream.synchronize()?),
            None => {
                // The default stream: record an event on it and wait for that.
                let device = device_of(self.device)?;
                let event = device.create_event()?;
                device.record_event(&event, StreamId::DEFAULT)?;
                Ok(device.synchronize_event(&event)?)
            }
        }
    }

    /// Whether all work queued on the stream has finished (`torch.cuda.Stream.query`).
    ///
    /// # Errors
    ///
    /// The driver's errors.
    pub fn query(&self) -> Result<bool> {
        match &self.owned {
            Some(stream) => Ok(stream.is_idle()?),
            None => {
                let device = device_of(self.device)?;
                let event = device.create_event()?;
                device.record_event(&event, StreamId::DEFAULT)?;
                Ok(device.query_event(&event)?)
            }
        }
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.device == other.device && self.id() == other.id()
    }
}

impl Eq for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "<tensormem::cuda::Stream device={} cuda_stream={}>",
            self.device,
            self.id()
        )
    }
}

thread_local! {
    /// This thread's current stream per device, where one was set.
    static CURRENT_STREAMS: RefCell<Vec<Option<Stream>>> = const { RefCell::new(Vec::new()) };
}

/// The legacy default stream of `device`, or of the current device (`torch.cuda.default_stream`).
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice); the errors of initialising CUDA.
pub fn default_stream(device: Option<u32>) -> Result<Stream> {
    let device = resolve(device)?;
    tensormem_runtime::check_ordinal(device)?;
    Ok(Stream::default_of(device))
}

/// This thread's current stream on `device`, or on the current device (`torch.cuda.current_stream`):
/// the last one [`set_stream`] made current there, else the default stream.
///
/// # Errors
///
/// As [`default_stream`].
pub fn current_stream(device: Option<u32>) -> Result<Stream> {
    let device = resolve(device)?;
    tensormem_runtime::check_ordinal(device)?;
    let set = CURRENT_STREAMS.with(|s| s.borrow().get(device as usize).cloned().flatten());
    Ok(set.unwrap_or_else(|| Stream::default_of(device)))
}

/// Makes `stream` this thread's current stream on its device, and its device the current device, as
/// `torch.cuda.set_stream` does.
///
/// # Errors
///
/// The errors of [`set_device`](super::set_device).
pub fn set_stream(stream: &Stream) -> Result<()> {
    super::set_device(stream.device)?;
    CURRENT_STREAMS.with(|s| {
        let mut streams = s.borrow_mut();
        let index = stream.device as usize;
        if streams.len() <= index {
            streams.resize(index + 1, None);
        }
        streams[index] = if stream.is_default() {
            None
        } else {
            Some(stream.clone())
        };
    });
    Ok(())
}

/// Whether this thread's current stream on the current device is being captured into a CUDA graph
/// (`torch.cuda.is_current_stream_capturing`, `cuStreamGetCaptureInfo`). An invalidated capture that
/// has not been ended counts as capturing, as in PyTorch.
///
/// # Errors
///
/// The errors of [`current_stream`]; the driver's errors.
pub fn is_current_stream_capturing() -> Result<bool> {
    let stream = current_stream(None)?;
    let device = device_of(stream.device)?;
    Ok(device.is_capturing(stream.id())?)
}
