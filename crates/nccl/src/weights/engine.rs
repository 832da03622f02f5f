//! The two things a weight sync drives, each on a stream of its own: a [`CopyEngine`] (this
//! rank's compute stream: staging memory, packing and unpacking copies) and a [`Collective`] (the
//! communication stream: broadcasts). Events of one type order the two. The CUDA and NCCL
//! implementations are in [`cuda`](super::cuda); an in-memory one for tests in
//! [`fake`](super::fake).

use tensormem_cuda_alloc::DeviceAddress;

use crate::error::Result;

/// What an operation is part of, for logs and traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Connecting or checking: the layout, its fingerprint.
    Layout,
    /// Bucket `k` of a sync.
    Bucket(usize),
}

/// One device-to-device copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySpan {
    /// The source's first byte.
    pub src: DeviceAddress,
    /// The destination's first byte.
    pub dst: DeviceAddress,
    /// The bytes copied.
    pub len: usize,
}

/// This rank's compute stream, as a weight sync uses it: the stream the caller writes (sender) or
/// reads (receiver) the weights on, staging memory, copies, events.
///
/// # Safety
///
/// Implementors guarantee:
/// - [`staging`](Self::staging) returns device memory of at least the bytes asked for, valid until
///   the [`Staging`](Self::Staging) value is dropped, at [`staging_addr`](Self::staging_addr);
/// - work is queued in call order and runs in that order; [`record`](Self::record) marks the
///   point reached by the work queued so far, and [`wait`](Self::wait) holds back work queued
///   later until the last record of the event made before the call has completed (CUDA's
///   `cuEventRecord` and `cuStreamWaitEvent`), on this stream or on the collective's;
/// - [`synchronize`](Self::synchronize), [`write`](Self::write) and [`read`](Self::read) return
///   once the work queued before them (and the transfer itself) has completed.
pub unsafe trait CopyEngine {
    /// An ordering point between this stream and the collective's.
    type Event;
    /// A staging buffer, given back when dropped; dropped only once no queued work uses it.
    type Staging;

    /// A staging buffer of `bytes` (memory the collective may reach on its fast paths: registered
    /// with the communicator).
    ///
    /// # Errors
    ///
    /// The memory could not be had.
    fn staging(&self, bytes: usize) -> Result<Self::Staging>;

    /// Where `staging` starts.
    fn staging_addr(staging: &Self::Staging) -> DeviceAddress;

    /// A new event.
    ///
    /// # Errors
    ///
    /// The device's.
    fn event(&self) -> Result<Self::Event>;

    /// Records `event` here (it completes when the work queued so far has).
    ///
    /// # Errors
    ///
    /// The device's.
    fn record(&self, event: &Self::Event) -> Result<()>;

    /// Makes work queued here later wait for `event`'s last record.
    ///
    /// # Errors
    ///
    /// The device's.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Queues `copies`, which belong to `step`.
    ///
    /// # Safety
    ///
    /// Each source is device memory readable for `len` bytes and each destination writable, and
    /// nothing else writes them (or reads a destination) until the copies have completed.
    ///
    /// # Errors
    ///
    /// The device's.
    unsafe fn copy(&self, step: Step, copies: &[CopySpan]) -> Result<()>;

    /// Copies `bytes` from the host to `dst`, after the work queued so far; returns when done.
    ///
    /// # Safety
    ///
    /// `dst` is device memory writable for `bytes.len()` bytes, used by nothing else meanwhile.
    ///
    /// # Errors
    ///
    /// The device's.
    unsafe fn write(&self, dst: DeviceAddress, bytes: &[u8]) -> Result<()>;

    /// Copies `out.len()` bytes from `src` to `out`, after the work queued so far; returns when
    /// done.
    ///
    /// # Safety
    ///
    /// `src` is device memory readable for `out.len()` bytes, written by nothing meanwhile.
    ///
    /// # Errors
    ///
    /// The device's.
    unsafe fn read(&self, src: DeviceAddress, out: &mut [u8]) -> Result<()>;

    /// Waits for everything queued here.
    ///
    /// # Errors
    ///
    /// The device's (an error of earlier asynchronous work may be reported here).
    fn synchronize(&self) -> Result<()>;
}

/// This rank's view of a communicator, and the stream its collectives run on.
///
/// # Safety
///
/// Implementors guarantee: [`broadcast`](Self::broadcast) and
/// [`all_reduce_max`](Self::all_reduce_max) are matched across ranks in call order (NCCL's rule
/// for one communicator) and write only the memory named; work on the stream is ordered as
/// [`CopyEngine`]'s is, with the same event semantics; [`is_idle`](Self::is_idle) answers `true`
/// only once the work queued before it has completed.
pub unsafe trait Collective {
    /// An ordering point, of the same type as the copy engine's.
    type Event;

    /// This rank's number, `0..ranks()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn ranks(&self) -> usize;

    /// Queues a broadcast of `len` bytes at `buf` from rank `root` to every rank's `buf`
    /// (`ncclBroadcast` in place), part of `step`.
    ///
    /// # Safety
    ///
    /// `buf` is device memory of this rank, readable (on `root`) or writable (elsewhere) for `len`
    /// bytes, used by nothing else until the broadcast has completed.
    ///
    /// # Errors
    ///
    /// The communicator's.
    #[doc(alias = "ncclBroadcast")]
    unsafe fn broadcast(
        &self,
        step: Step,
        buf: DeviceAddress,
        len: usize,
        root: usize,
    ) -> Result<()>;

    /// Queues an element-wise maximum over every rank of `count` `u64`s at `buf`, in place
    /// (`ncclAllReduce` with `ncclMax`).
    ///
    /// # Safety
    ///
    /// As for [`broadcast`](Self::broadcast), for `8 * count` bytes read and written.
    ///
    /// # Errors
    ///
    /// The communicator's.
    #[doc(alias = "ncclAllReduce")]
    unsafe fn all_reduce_max(&self, buf: DeviceAddress, count: usize) -> Result<()>;

    /// Records `event` on the communication stream.
    ///
    /// # Errors
    ///
    /// The device's.
    fn record(&self, event: &Self::Event) -> Result<()>;

    /// Makes work queued on the communication stream later wait for `event`'s last record.
    ///
    /// # Errors
    ///
    /// The device's.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Whether everything queued on the communication stream has finished, without blocking (a
    /// sync polls it, with a timeout, rather than block on a collective that may never end). A
    /// failure of the communicator (NCCL's asynchronous error: a rank lost, a network error) is
    /// an error here, so that a wait polling it ends.
    ///
    /// # Errors
    ///
    /// The device's or the communicator's.
    fn is_idle(&self) -> Result<bool>;
}
