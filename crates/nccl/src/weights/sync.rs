//! [`WeightSync`]: connecting ranks (layout exchanged and checked once) and syncing (every
//! bucket broadcast, packed and unpacked through two staging buffers, pipelined).

use std::fmt;
use std::time::{Duration, Instant};

use tensormem_cuda_alloc::DeviceAddress;

use super::engine::{Collective, CopyEngine, CopySpan, Step};
use super::layout::{LocalTensor, WeightLayout};
use super::plan::SyncPlan;
use crate::error::{Error, Result};

/// The default bucket size: 256 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 256 << 20;

/// The smallest bucket size accepted (1 MiB); the layout travels in pieces of this size.
pub const MIN_BUCKET_BYTES: usize = 1 << 20;

/// How long a rank waits for the collectives of a sync by default before it gives the other ranks
/// up ([`SyncOptions::timeout`]): ten minutes, PyTorch's default for NCCL process groups.
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(600);

/// The longest pause between two looks at the communication stream while waiting for it.
const MAX_POLL_PAUSE: Duration = Duration::from_micros(200);

/// The largest encoded layout a receiving rank accepts (1 GiB): a guard against a header that is
/// not one.
const MAX_LAYOUT_BYTES: u64 = 1 << 30;

/// The first word of the header the sending rank broadcasts when ranks connect.
const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"TMWSYNC1");

/// How weights are bucketed, and how long a rank waits for the others. Every rank must use the
/// same bucket size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncOptions {
    /// The bytes of one broadcast (the last bucket may hold fewer); each rank holds two staging
    /// buffers of this size. At least [`MIN_BUCKET_BYTES`].
    pub bucket_bytes: usize,
    /// How long this rank waits for the collectives of one exchange (the layout's agreement, the
    /// weights) before it gives up with [`Error::TimedOut`]: a rank that died or stopped syncing
    /// leaves them unfinished for ever. [`DEFAULT_SYNC_TIMEOUT`] by default.
    pub timeout: Duration,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            timeout: DEFAULT_SYNC_TIMEOUT,
        }
    }
}

/// What one sync moved, as this rank saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncReport {
    /// The sync's number on this [`WeightSync`], from 1.
    pub sync: u64,
    /// The bytes of all tensors.
    pub bytes: u64,
    /// The broadcasts.
    pub buckets: usize,
    /// The buckets broadcast from or into a tensor directly on this rank (no staging copy).
    pub direct: usize,
    /// From the call until this rank's tensors were done (sent, or holding the new values).
    pub elapsed: Duration,
}

impl SyncReport {
    /// Bytes per second over the sync, in GB/s (10^9).
    #[must_use]
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// The engine, the collective and the staging buffers: what every exchange uses.
struct Link<E: CopyEngine, C: Collective<Event = E::Event>> {
    engine: E,
    collective: C,
    /// Two buffers of the bucket size; `None` once given back or leaked.
    staging: Option<[E::Staging; 2]>,
    /// Their addresses.
    addrs: [DeviceAddress; 2],
    /// Set while work may be queued that a failure left behind: the staging buffers are then
    /// leaked rather than freed under it, and no further sync runs.
    broken: bool,
    /// How long a wait for the collectives may take ([`SyncOptions::timeout`]).
    timeout: Duration,
}

impl<E: CopyEngine, C: Collective<Event = E::Event>> Link<E, C> {
    fn root_is_me(&self, root: usize) -> bool {
        self.collective.rank() == root
    }

    /// `bytes` from `root` to every rank, through staging buffer 0, in pieces of
    /// [`MIN_BUCKET_BYTES`]; returns once done (both streams idle).
    fn broadcast_bytes(&self, root: usize, bytes: &mut [u8]) -> Result<()> {
        let staging = self.addrs[0];
        for piece in bytes.chunks_mut(MIN_BUCKET_BYTES) {
            // SAFETY: staging buffer 0 holds at least MIN_BUCKET_BYTES (the bucket size is no
            // less) and both streams are idle (each exchange ends synchronized), so nothing else
            // uses it.
            unsafe {
                if self.root_is_me(root) {
                    self.engine.write(staging, piece)?;
                }
                self.collective
                    .broadcast(Step::Layout, staging, piece.len(), root)?;
                self.wait_collective()?;
                if !self.root_is_me(root) {
                    self.engine.read(staging, piece)?;
                }
            }
        }
        Ok(())
    }

    /// Waits for everything queued on the communication stream, but no longer than the timeout:
    /// the collectives of a rank whose peers died or stopped syncing never finish. Looks at the
    /// stream with pauses growing to [`MAX_POLL_PAUSE`].
    fn wait_collective(&self) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(2);
        while !self.collective.is_idle()? {
            let waited = start.elapsed();
            if waited >= self.timeout {
                let rank = self.collective.rank();
                tracing::error!(
                    target: "tensormem_nccl",
                    rank,
                    ?waited,
                    "a weight sync's collectives did not finish in time: another rank most likely \
                     died; abort the communicator"
                );
                return Err(Error::TimedOut { rank, waited });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_POLL_PAUSE);
        }
        Ok(())
    }

    /// `words` from `root` to every rank.
    fn broadcast_words(&self, root: usize, words: &mut [u64]) -> Result<()> {
        let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.broadcast_bytes(root, &mut bytes)?;
        for (w, b) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_le_bytes(b.try_into().expect("eight bytes"));
        }
        Ok(())
    }

    /// Whether every rank offered `value` (0: this rank refuses): one all-reduce of
    /// `[value, !value]` with `max`, which yields `[max, !min]`.
    fn agree(&self, value: u64) -> Result<bool> {
        let staging = self.addrs[0];
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&value.to_le_bytes());
        bytes[8..].copy_from_slice(&(!value).to_le_bytes());
        // SAFETY: 16 bytes of staging buffer 0, idle (see `broadcast_bytes`).
        unsafe {
            self.engine.write(staging, &bytes)?;
            self.collective.all_reduce_max(staging, 2)?;
            self.wait_collective()?;
            self.engine.read(staging, &mut bytes)?;
        }
        let max = u64::from_le_bytes(bytes[..8].try_into().expect("eight bytes"));
        let min = !u64::from_le_bytes(bytes[8..].try_into().expect("eight bytes"));
        Ok(value != 0 && min == value && max == value)
    }
}

impl<E: CopyEngine, C: Collective<Event = E::Event>> Drop for Link<E, C> {
    fn drop(&mut self) {
        if self.broken {
            if let Some(staging) = self.staging.take() {
                tracing::warn!(
                    target: "tensormem_nccl",
                    "a weight sync failed part way: its staging buffers are leaked, not freed under \
                     work that may still use them"
                );
                std::mem::forget(staging);
            }
        }
    }
}

/// Where one bucket is broadcast from (on the sender) or into (elsewhere).
enum Transfer {
    /// One piece of one of this rank's tensors: the tensor itself, without a staging copy.
    Direct(DeviceAddress),
    /// The staging buffer of the bucket's slot, with the copies between it and this rank's tensors
    /// (into it on the sender, out of it elsewhere).
    Staged(Vec<CopySpan>),
}

/// One rank's end of a weight sync: the sending rank (`root`) broadcasts its tensors' bytes, every
/// other rank receives them into its own tensors, matched by name. See the
/// [module docs](super).
pub struct WeightSync<E: CopyEngine, C: Collective<Event = E::Event>> {
    link: Link<E, C>,
    root: usize,
    plan: SyncPlan,
    /// Per bucket, where its bytes are broadcast from or into.
    transfers: Vec<Transfer>,
    /// Per staging buffer: its bucket is in place (packed on the sender, received elsewhere).
    filled: [E::Event; 2],
    /// Per staging buffer: it may be written again (broadcast on the sender, unpacked elsewhere).
    drained: [E::Event; 2],
    /// The compute stream reached the sync.
    begin: E::Event,
    /// The communication stream finished the sync.
    end: E::Event,
    syncs: u64,
}

impl<E: CopyEngine, C: Collective<Event = E::Event>> fmt::Debug for WeightSync<E, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightSync")
            .field("rank", &self.link.collective.rank())
            .field("root", &self.root)
            .field("bytes", &self.plan.bytes())
            .field("buckets", &self.plan.buckets().len())
            .field("syncs", &self.syncs)
            .field("broken", &self.link.broken)
            .finish_non_exhaustive()
    }
}

impl<E: CopyEngine, C: Collective<Event = E::Event>> WeightSync<E, C> {
    /// Connects this rank: every rank of the communicator calls it, with the same `root` and
    /// options. The root's `tensors` (in their order) are the layout; it is broadcast, each
    /// receiving rank matches it against its own `tensors` by name, and every rank learns whether
    /// all agree before returning.
    ///
    /// Nothing of the tensors is read or written here.
    ///
    /// # Errors
    ///
    /// Before anything is exchanged (the other ranks then wait for this one, as for any rank that
    /// misses a collective): [`Error::BadRoot`], [`Error::BucketTooSmall`],
    /// [`Error::DuplicateName`], the engine's errors making staging buffers or events. After the
    /// exchange, on every rank alike: [`Error::Layout`] on a rank whose tensors differ (naming
    /// each difference), [`Error::BucketSize`] on a rank whose bucket size differs,
    /// [`Error::LayoutRejected`] on the others. The collective's and engine's errors.
    pub fn connect(
        engine: E,
        collective: C,
        root: usize,
        tensors: &[LocalTensor],
        options: SyncOptions,
    ) -> Result<Self> {
        let ranks = collective.ranks();
        if root >= ranks {
            return Err(Error::BadRoot { root, ranks });
        }
        let bucket = options.bucket_bytes;
        if bucket < MIN_BUCKET_BYTES {
            return Err(Error::BucketTooSmall {
                bytes: bucket,
                min: MIN_BUCKET_BYTES,
            });
        }
        let here = WeightLayout::of(tensors)?;
        let staging = [engine.staging(bucket)?, engine.staging(bucket)?];
        let addrs = [E::staging_addr(&staging[0]), E::staging_addr(&staging[1])];
        let filled = [engine.event()?, engine.event()?];
        let drained = [engine.event()?, engine.event()?];
        let (begin, end) = (engine.event()?, engine.event()?);
        let mut link = Link {
            engine,
            collective,
            staging: Some(staging),
            addrs,
            broken: true,
            timeout: options.timeout,
        };
        let is_root = link.root_is_me(root);

        let encoded = if is_root { here.encode() } else { Vec::new() };
        let mut header = [HEADER_MAGIC, encoded.len() as u64, bucket as u64];
        link.broadcast_words(root, &mut header)?;
        if header[0] != HEADER_MAGIC || header[1] > MAX_LAYOUT_BYTES {
            // The root is not connecting a weight sync: the ranks are out of step.
            return Err(Error::LayoutBytes {
                reason: "no weight-sync header from the sending rank",
            });
        }
        let mut bytes = if is_root {
            encoded
        } else {
            vec![0; header[1] as usize]
        };
        link.broadcast_bytes(root, &mut bytes)?;
        let planned = if header[2] != bucket as u64 {
            Err(Error::BucketSize {
                sender: header[2],
                here: bucket as u64,
            })
        } else if is_root {
            SyncPlan::new(&here, tensors, bucket)
        } else {
            WeightLayout::decode(&bytes).and_then(|sent| SyncPlan::new(&sent, tensors, bucket))
        };
        let fingerprint = planned.as_ref().map_or(0, SyncPlan::fingerprint);
        let agreed = link.agree(fingerprint)?;
        // Every exchange ended synchronized: nothing is left queued.
        link.broken = false;
        let plan = planned?;
        if !agreed {
            return Err(Error::LayoutRejected { fingerprint });
        }
        let transfers = plan
            .buckets()
            .iter()
            .enumerate()
            .map(|(k, b)| {
                let staging = addrs[k % 2];
                if let Some(tensor) = b.direct() {
                    return Transfer::Direct(tensor);
                }
                Transfer::Staged(
                    b.spans()
                        .iter()
                        .map(|s| {
                            let (src, dst) = if is_root {
                                (s.addr, staging.offset(s.offset))
                            } else {
                                (staging.offset(s.offset), s.addr)
                            };
                            CopySpan {
                                src,
                                dst,
                                len: s.len,
                            }
                        })
                        .collect(),
                )
            })
            .collect();
        tracing::debug!(
            target: "tensormem_nccl",
            rank = link.collective.rank(),
            root,
            tensors = tensors.len(),
            bytes = plan.bytes(),
            buckets = plan.buckets().len(),
            fingerprint,
            "weight sync connected"
        );
        Ok(Self {
            link,
            root,
            plan,
            transfers,
            filled,
            drained,
            begin,
            end,
            syncs: 0,
        })
    }

    /// Moves the weights once: on the root, its tensors' current values (as written by the work
    /// queued so far on the engine's stream) are broadcast; on every other rank they land in its
    /// tensors. Returns when this rank is done: its engine stream has waited for every bucket and
    /// been synchronized. Every rank calls it, once per version.
    ///
    /// Each sync starts by checking that every rank holds the same plan (one small all-reduce);
    /// buckets are then pipelined through two staging buffers (see the [module docs](super)).
    ///
    /// # Safety
    ///
    /// The tensors given to [`connect`](Self::connect) are still this rank's device memory, each
    /// `bytes` long at `ptr`; until the call returns no stream but the engine's (whose work
    /// queued before the call runs first) writes them, nor, on a receiving rank, reads them.
    ///
    /// # Errors
    ///
    /// [`Error::LayoutRejected`] when another rank's plan differs (nothing is sent; the sync can
    /// be called again); [`Error::Broken`] after a sync failed part way; the collective's and the
    /// engine's errors (which leave the sync broken).
    pub unsafe fn sync(&mut self) -> Result<SyncReport> {
        if self.link.broken {
            return Err(Error::Broken);
        }
        let start = Instant::now();
        let rank = self.rank();
        let fingerprint = self.plan.fingerprint();
        self.link.broken = true;
        if !self.link.agree(fingerprint)? {
            self.link.broken = false;
            return Err(Error::LayoutRejected { fingerprint });
        }
        let (engine, collective) = (&self.link.engine, &self.link.collective);
        engine.record(&self.begin)?;
        collective.wait(&self.begin)?;
        if self.link.root_is_me(self.root) {
            // SAFETY: the caller's obligations cover the tensors; staging buffers are ordered by
            // `filled` and `drained`.
            unsafe { self.send()? };
        } else {
            // SAFETY: as above.
            unsafe { self.receive()? };
        }
        let (engine, collective) = (&self.link.engine, &self.link.collective);
        collective.record(&self.end)?;
        engine.wait(&self.end)?;
        // The collectives first, within the timeout: the copies after them wait for them.
        self.link.wait_collective()?;
        engine.synchronize()?;
        self.link.broken = false;
        self.syncs += 1;
        let report = SyncReport {
            sync: self.syncs,
            bytes: self.plan.bytes(),
            buckets: self.plan.buckets().len(),
            direct: self
                .transfers
                .iter()
                .filter(|t| matches!(t, Transfer::Direct(_)))
                .count(),
            elapsed: start.elapsed(),
        };
        tracing::info!(
            target: "tensormem_nccl",
            rank,
            root = self.root,
            sync = report.sync,
            bytes = report.bytes,
            buckets = report.buckets,
            direct = report.direct,
            elapsed_ms = report.elapsed.as_secs_f64() * 1e3,
            gb_per_s = report.gb_per_s(),
            "weights synced"
        );
        Ok(report)
    }

    /// The root's side: bucket `k` packed into staging buffer `k % 2` on the compute stream once
    /// the broadcast of bucket `k - 2` from it is done, then broadcast on the communication
    /// stream once packed; so packing `k + 1` overlaps broadcasting `k`.
    ///
    /// # Safety
    ///
    /// [`sync`](Self::sync)'s.
    unsafe fn send(&self) -> Result<()> {
        let (engine, collective) = (&self.link.engine, &self.link.collective);
        for (k, bucket) in self.plan.buckets().iter().enumerate() {
            let (step, slot) = (Step::Bucket(k), k % 2);
            let src = match &self.transfers[k] {
                Transfer::Staged(copies) => {
                    engine.wait(&self.drained[slot])?;
                    // SAFETY: the sources are the caller's tensors (sync's obligations); the
                    // destination is the staging buffer, free once `drained` completes.
                    unsafe { engine.copy(step, copies)? };
                    engine.record(&self.filled[slot])?;
                    collective.wait(&self.filled[slot])?;
                    self.link.addrs[slot]
                }
                Transfer::Direct(tensor) => *tensor,
            };
            // SAFETY: `src` is the packed staging buffer or a piece of one of the caller's
            // tensors, `bucket.len()` bytes; the broadcast only reads it on the root.
            unsafe { collective.broadcast(step, src, bucket.len(), self.root)? };
            if matches!(self.transfers[k], Transfer::Staged(_)) {
                collective.record(&self.drained[slot])?;
            }
        }
        Ok(())
    }

    /// A receiving rank's side: the broadcast of bucket `k + 1` is queued before the unpacking
    /// of bucket `k`, which waits for bucket `k`'s broadcast; a staging buffer is received into
    /// again once the bucket before in it is unpacked.
    ///
    /// # Safety
    ///
    /// [`sync`](Self::sync)'s.
    unsafe fn receive(&self) -> Result<()> {
        let n = self.plan.buckets().len();
        if n > 0 {
            // SAFETY: sync's obligations.
            unsafe { self.issue(0)? };
        }
        for k in 0..n {
            if k + 1 < n {
                // SAFETY: sync's obligations.
                unsafe { self.issue(k + 1)? };
            }
            if let Transfer::Staged(copies) = &self.transfers[k] {
                let slot = k % 2;
                let engine = &self.link.engine;
                engine.wait(&self.filled[slot])?;
                // SAFETY: the sources are the staging buffer, holding bucket `k` once `filled`
                // completes; the destinations are pieces of the caller's tensors.
                unsafe { engine.copy(Step::Bucket(k), copies)? };
                engine.record(&self.drained[slot])?;
            }
        }
        Ok(())
    }

    /// Queues the broadcast of bucket `k` on a receiving rank.
    ///
    /// # Safety
    ///
    /// [`sync`](Self::sync)'s.
    unsafe fn issue(&self, k: usize) -> Result<()> {
        let collective = &self.link.collective;
        let bucket = &self.plan.buckets()[k];
        let (step, slot) = (Step::Bucket(k), k % 2);
        if let Transfer::Direct(tensor) = self.transfers[k] {
            // SAFETY: a piece of one of the caller's tensors, `bucket.len()` bytes, used by
            // nothing else during the sync.
            return unsafe { collective.broadcast(step, tensor, bucket.len(), self.root) };
        }
        collective.wait(&self.drained[slot])?;
        // SAFETY: the staging buffer, free once `drained` (bucket `k - 2` unpacked) completes.
        unsafe { collective.broadcast(step, self.link.addrs[slot], bucket.len(), self.root)? };
        collective.record(&self.filled[slot])
    }

    /// This rank's plan.
    #[must_use]
    pub fn plan(&self) -> &SyncPlan {
        &self.plan
    }

    /// The sending rank.
    #[must_use]
    pub fn root(&self) -> usize {
        self.root
    }

    /// This rank.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.link.collective.rank()
    }

    /// The copy engine.
    #[must_use]
    pub fn engine(&self) -> &E {
        &self.link.engine
    }

    /// The collective.
    #[must_use]
    pub fn collective(&self) -> &C {
        &self.link.collective
    }
}
