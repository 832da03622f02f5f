//! Which pool each recorded allocation went to: read from the trace when its entries name it
//! (`pool_id`), else inferred, since PyTorch 2.11's trace events do not say.
//!
//! Private pools (CUDA graph capture, `torch.cuda.MemPool` with `use_mem_pool`) own their
//! segments: a block carved from a segment belongs to the segment's pool. So the question is asked
//! per recorded segment (an *instance*: from its `segment_alloc` to its `segment_free`), and every
//! allocation landing in it shares the answer. The answer comes from, in order:
//!
//! 0. **the record**: the `pool_id` of the allocation that makes the segment's pool known, which
//!    PyTorch after 2.11 and tensormem write on every entry about memory;
//! 1. **the final segments**: a segment alive when the snapshot was taken carries `segment_pool_id`;
//! 2. **the default pool's cache**: a new segment made while the default pool held a cached block
//!    that would have served the request (same stream, best fit) was not made for the default pool:
//!    it belongs to a private pool (the one in use on that stream, else the one in use last, else
//!    the one the final segments name, else an unnamed one);
//! 3. **consistency**: otherwise the segment is assumed to belong to the pool most of the stream's
//!    allocations went to so far (among the default pools and private pools not yet released; the
//!    last one on ties), and the replay checks the assumption: when a later allocation lands in it
//!    although PyTorch put that allocation elsewhere, the assumption was wrong, it is flipped, and
//!    the inference starts again (at most [`MAX_FLIPS`] times).
//!
//! Allocations whose pool rests on an assumption, on a stream that some private pool served, are
//! reported as undecided ([`PoolAttribution::undecided`]): either pool would have produced the same
//! record.
//!
//! Replaying into a private pool is what PyTorch's capture does: the allocation is made while a
//! capture routes its stream to the pool (`begin_allocate_to_pool` / `end_allocate_to_pool` around
//! it). A trace never records a graph's destruction (`releasePool`); the replay releases a pool when
//! the trace releases one of its segments, which PyTorch does only for pools no graph uses.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use tensormem_cuda_alloc::device::{Device, StreamId};
use tensormem_cuda_alloc::snapshot::{TraceAction, TraceEntry};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, MempoolId};

use crate::plan::{DevicePlan, Instance, Op};

mod attribution;

pub(crate) use attribution::PoolOf;
pub use attribution::{PoolAttribution, PoolEvidence, PoolShare, UndecidedAllocation};

/// The most assumptions flipped while inferring one device's pools.
pub const MAX_FLIPS: usize = 256;

/// Pools inferred but not named by the snapshot get ids `(UNNAMED_POOL_BASE + n, 0)`.
pub const UNNAMED_POOL_BASE: u64 = 1 << 63;

/// A forced assignment meaning "a private pool, chosen when the segment is made".
const FORCE_PRIVATE: MempoolId = MempoolId(u64::MAX, u64::MAX);

/// Per allocation of `plan` (in the order of [`DevicePlan::expected`]), the pool its `alloc` entry
/// in `trace` names: `pool_id`, which PyTorch after 2.11 and tensormem write. Empty when no
/// allocation's entry names one (PyTorch 2.11's traces), so that those cost nothing.
pub(crate) fn recorded_pools(plan: &DevicePlan, trace: &[TraceEntry]) -> Arc<[Option<MempoolId>]> {
    if !trace
        .iter()
        .any(|e| e.action == TraceAction::Alloc && e.pool_id.is_some())
    {
        return Arc::from(Vec::new());
    }
    plan.ops
        .iter()
        .zip(&plan.op_events)
        .filter(|(op, _)| matches!(op, Op::Alloc { .. }))
        .map(|(_, &event)| {
            let (first, second) = trace.get(event as usize)?.pool_id?;
            Some(MempoolId(first, second))
        })
        .collect()
}

/// Pools inferred for the segments of one run of releases that frees only private segments get
/// `(MERGED_POOL_BASE + run, 0)` when merged.
const MERGED_POOL_BASE: u64 = UNNAMED_POOL_BASE + (2 << 40);

/// Pools of segments released by a run of releases that freed private pools only get
/// `(POOL_RELEASE_BASE + set, 0)`.
const POOL_RELEASE_BASE: u64 = UNNAMED_POOL_BASE + (3 << 40);

/// Segments whose pool a release run decides: a run that is not an allocation's (nothing needing
/// memory follows it) is `empty_cache`, which frees every idle segment of the pools it empties. If
/// a segment of the default pools stayed although it was idle when the run started (the final
/// segments name its pool), the run emptied private pools only, and every segment it freed was a
/// private pool's; one pool's (`MemPool`'s destruction or `empty_cache` of one pool), since
/// releases of several pools at once are told apart by nothing in the trace.
pub(crate) fn released_private(plan: &DevicePlan) -> HashMap<u32, MempoolId> {
    let mut pools = HashMap::new();
    for run in plan.releases.iter().filter(|r| r.next_segment.is_none()) {
        let set = run.set as usize;
        let (Some(freed), Some(idle)) = (plan.release_sets.get(set), plan.idle_at_release.get(set))
        else {
            continue;
        };
        if freed.is_empty() || !freed.iter().all(|id| idle.contains(id)) {
            continue;
        }
        let default_kept = idle.iter().filter(|id| !freed.contains(id)).any(|&id| {
            plan.instances
                .get(id as usize)
                .is_some_and(|i| i.final_pool == Some(MempoolId::DEFAULT))
        });
        if default_kept {
            let pool = MempoolId(POOL_RELEASE_BASE + set as u64, 0);
            for &id in freed {
                pools.entry(id).or_insert(pool);
            }
        }
    }
    pools
}

/// Whether the default pools hold a segment that releasing cached memory would free (one free
/// block, no expandable mapping).
fn holds_idle_default_segment<D: Device>(allocator: &CachingAllocator<D>) -> bool {
    allocator.snapshot().segments.iter().any(|s| {
        s.segment_pool_id == (0, 0) && !s.is_expandable && s.active_size == 0 && s.blocks.len() == 1
    })
}

/// The pools to impose so that the unnamed pools of every run of releases freeing only private
/// segments are one.
///
/// PyTorch releases a private pool's segments only in `empty_cache` (of every pool, or of one:
/// `MemPool`'s destruction), once per pool, and each such release synchronizes once. The inference
/// gives a segment that no other pool could have made a pool of its own (always consistent with
/// the addresses, so nothing else tells), which splits one real pool into several: the unnamed
/// pools of one run are most likely one (`MemPool`s destroyed together are usually told apart by
/// their addresses, which the caller checks). Every segment of those pools gets one new pool;
/// pools the final segments name stay as they are. Empty when no run needs it.
pub(crate) fn merged_release_pools(
    plan: &DevicePlan,
    of: &[Option<PoolOf>],
) -> HashMap<u32, MempoolId> {
    let mut forced = HashMap::new();
    let pool_of = |id: u32| of.get(id as usize).copied().flatten().map(|p| p.pool);
    for (run, set) in plan.release_sets.iter().enumerate() {
        let pools: Option<Vec<MempoolId>> = set.iter().map(|&id| pool_of(id)).collect();
        let Some(mut pools) = pools else { continue };
        if pools.iter().any(|p| p.is_default()) {
            continue;
        }
        pools.retain(|p| p.0 >= UNNAMED_POOL_BASE);
        pools.sort_unstable();
        pools.dedup();
        if pools.len() < 2 {
            continue;
        }
        let target = MempoolId(MERGED_POOL_BASE + run as u64, 0);
        for (id, p) in of.iter().enumerate() {
            if p.is_some_and(|p| pools.contains(&p.pool)) {
                forced.entry(id as u32).or_insert(target);
            }
        }
    }
    forced
}

/// The pools of one run: fixed by an earlier inference, or inferred while replaying.
#[derive(Debug, Default)]
pub(crate) struct PoolRun {
    /// Per instance, its pool once decided.
    pub(crate) of: Vec<Option<PoolOf>>,
    /// Decide undecided instances while replaying.
    infer: bool,
    /// Instances whose pool an earlier pass found contradicted.
    forced: HashMap<u32, MempoolId>,
    /// Per allocation, the pool its trace entry names ([`recorded_pools`]; empty when none does).
    recorded: Arc<[Option<MempoolId>]>,
    /// Instances whose pool a release of private pools decides ([`released_private`]).
    released_private: HashMap<u32, MempoolId>,
    /// Out-of-memory requests (by order in the trace) to replay in a private pool although
    /// nothing in the trace rules out the default pools (decided from the recorded statistics).
    ooms_private: HashSet<u32>,
    /// Out-of-memory requests seen so far.
    ooms_seen: u32,
    /// Private pools made with `no_split` (inferred), and those of them the allocator was told of.
    no_split: HashSet<MempoolId>,
    no_split_set: HashSet<MempoolId>,
    /// Private pools made with their own allocator (inferred).
    own_allocator: HashSet<MempoolId>,
    /// Out-of-memory requests replayed in a private pool.
    pub(crate) private_ooms: usize,
    /// Out-of-memory requests replayed in the default pools that a private pool in use on their
    /// stream could have failed as well (by order in the trace).
    pub(crate) ambiguous_ooms: Vec<u32>,
    /// The first contradiction found (inference stops there): the instance and its other pool.
    pub(crate) contradiction: Option<(u32, MempoolId)>,
    /// Captures begun per private pool (its use count in the allocator).
    begun: HashMap<MempoolId, u64>,
    /// Private pools released (no graph uses them any more).
    released: HashSet<MempoolId>,
    /// The pool each stream used last.
    last_on_stream: HashMap<StreamId, MempoolId>,
    /// Allocations per stream and pool so far.
    counts: HashMap<StreamId, HashMap<MempoolId, u64>>,
    /// Private pools used on each stream, most recent last.
    private_on_stream: HashMap<StreamId, Vec<MempoolId>>,
    /// Unnamed pools made so far.
    unnamed: u64,
    /// The private pools the snapshot's final segments name.
    named: Vec<MempoolId>,
    /// Recorded instances alive in the replay (start -> (end, instance)).
    live: BTreeMap<u64, (u64, u32)>,
}

impl PoolRun {
    /// A run with pools fixed by `of` (instances it does not decide go to the default pools).
    pub(crate) fn fixed(of: Vec<Option<PoolOf>>) -> Self {
        PoolRun {
            of,
            ..PoolRun::default()
        }
    }

    /// The run, with the out-of-memory requests `ooms` (by order in the trace) replayed in a
    /// private pool.
    pub(crate) fn with_private_ooms(mut self, ooms: HashSet<u32>) -> Self {
        self.ooms_private = ooms;
        self
    }

    /// The run, with the private pools `pools` made with `no_split` (their blocks never split).
    pub(crate) fn with_no_split(mut self, pools: HashSet<MempoolId>) -> Self {
        self.no_split = pools;
        self
    }

    /// The run, with the private pools `pools` made with their own allocator.
    pub(crate) fn with_own_allocator(mut self, pools: HashSet<MempoolId>) -> Self {
        self.own_allocator = pools;
        self
    }

    /// Makes the pools of [`with_own_allocator`](Self::with_own_allocator) before the replay
    /// starts, each taking whole segments from the replay's device (a `MemPool` object holds one
    /// use of its pool from when it is made).
    pub(crate) fn make_pools(&mut self, allocator: &CachingAllocator<crate::ReplayDevice>) {
        let mut pools: Vec<MempoolId> = self.own_allocator.iter().copied().collect();
        pools.sort_unstable();
        for pool in pools {
            let own = allocator.device().pool_allocator();
            match allocator.create_or_incref_pool_with(pool, Some(own)) {
                Ok(()) => *self.begun.entry(pool).or_default() += 1,
                Err(e) => tracing::debug!(%pool, error = %e, "making a replayed pool failed"),
            }
        }
    }

    /// A capture into `pool` began: counted, and the pool told it never splits when it was made so.
    fn began<D: Device>(&mut self, allocator: &CachingAllocator<D>, pool: MempoolId) {
        *self.begun.entry(pool).or_default() += 1;
        if self.no_split.contains(&pool) && self.no_split_set.insert(pool) {
            if let Err(e) = allocator.set_no_split(pool) {
                tracing::debug!(%pool, error = %e, "making a replayed pool no_split failed");
            }
        }
    }

    /// An inference pass over `instances`, with the pools of `forced` imposed, those the trace
    /// names (`recorded`, from [`recorded_pools`]) taken as they are and those of
    /// `released_private` (see [`released_private`]) taken as evidence.
    pub(crate) fn inferring(
        plan: &DevicePlan,
        forced: HashMap<u32, MempoolId>,
        recorded: Arc<[Option<MempoolId>]>,
        released_private: HashMap<u32, MempoolId>,
    ) -> Self {
        let mut named: Vec<MempoolId> = plan
            .instances
            .iter()
            .filter_map(|i| i.final_pool)
            .filter(|p| !p.is_default())
            .collect();
        named.sort_unstable();
        named.dedup();
        PoolRun {
            of: vec![None; plan.instances.len()],
            named,
            infer: true,
            forced,
            recorded,
            released_private,
            ..PoolRun::default()
        }
    }

    /// Whether the pass should stop (a contradiction was found).
    pub(crate) fn stopped(&self) -> bool {
        self.contradiction.is_some()
    }

    fn live_private(&self, pool: MempoolId) -> bool {
        !pool.is_default() && !self.released.contains(&pool)
    }

    /// A private pool for a new segment on `stream` that the default pool could have spared: the
    /// private pool used on the stream most recently that could not have served the request either
    /// (a pool that could have, would have: the segment is another one's), else a pool the final
    /// segments name that could not have, else a new unnamed pool.
    ///
    /// Choosing a pool of its own for a segment is always consistent with the record: a block is
    /// the best fit over its real pool, so it is over any part of it. Merging two real pools is
    /// not, and the replay's check finds it (see [`landed_elsewhere`](Self::landed_elsewhere)).
    fn some_private<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        size: usize,
        stream: StreamId,
    ) -> MempoolId {
        if let Some(pool) = self.recent_private_failing(allocator, size, stream) {
            return pool;
        }
        let named: Vec<MempoolId> = self
            .named
            .iter()
            .copied()
            .filter(|p| self.live_private(*p))
            .collect();
        for pool in named {
            if !self.pool_could_serve(allocator, pool, size, stream) {
                return pool;
            }
        }
        self.unnamed += 1;
        MempoolId(UNNAMED_POOL_BASE + self.unnamed, 0)
    }

    /// The live private pool used most recently on `stream` that holds no cached block for `size`
    /// bytes there.
    fn recent_private_failing<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        size: usize,
        stream: StreamId,
    ) -> Option<MempoolId> {
        let recent: Vec<MempoolId> = self
            .private_on_stream
            .get(&stream)
            .map(|v| {
                v.iter()
                    .rev()
                    .copied()
                    .filter(|p| self.live_private(*p))
                    .collect()
            })
            .unwrap_or_default();
        recent
            .into_iter()
            .find(|&pool| !self.pool_could_serve(allocator, pool, size, stream))
    }

    /// Whether private pool `pool` holds a cached block that would serve `size` bytes on `stream`.
    fn pool_could_serve<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        pool: MempoolId,
        size: usize,
        stream: StreamId,
    ) -> bool {
        if allocator
            .begin_allocate_to_pool(pool, move |s| s == stream)
            .is_err()
        {
            return false;
        }
        self.began(allocator, pool);
        let serves = allocator.would_serve_from_cache(size, stream);
        if let Err(e) = allocator.end_allocate_to_pool(pool) {
            tracing::debug!(%pool, error = %e, "ending a replayed capture failed");
        }
        serves
    }

    /// The pool of the allocation `index` (of [`DevicePlan::expected`]) landing in recorded
    /// `instance`, deciding it when inferring.
    pub(crate) fn pool_for<D: Device>(
        &mut self,
        plan: &DevicePlan,
        allocator: &CachingAllocator<D>,
        instance: u32,
        index: usize,
        size: u64,
        stream: StreamId,
    ) -> MempoolId {
        let Some(recorded) = plan.instances.get(instance as usize) else {
            return MempoolId::DEFAULT;
        };
        if let Some(p) = self.of[instance as usize] {
            // The trace allocates into a segment of a pool it released: a released pool serves
            // nothing, so the segment's pool was wrong (an assumed one was the default pools', a
            // chosen one was a pool of its own).
            if self.infer && self.contradiction.is_none() && self.released.contains(&p.pool) {
                let own = MempoolId(UNNAMED_POOL_BASE + (1 << 40) + u64::from(instance), 0);
                let other = match p.evidence {
                    PoolEvidence::Assumed => MempoolId::DEFAULT,
                    _ if p.chosen && p.pool != own => own,
                    _ => return p.pool,
                };
                self.contradiction = Some((instance, other));
            }
            return p.pool;
        }
        if !self.infer {
            return MempoolId::DEFAULT;
        }
        let decided = self.decide(allocator, instance, recorded, index, size, stream);
        tracing::trace!(
            segment = format_args!("{:#x}", recorded.addr),
            event = index,
            pool = %decided.pool,
            evidence = ?decided.evidence,
            "segment's pool decided"
        );
        self.of[instance as usize] = Some(decided);
        if recorded.first_alloc == Some(index as u32) {
            self.live
                .insert(recorded.addr, (recorded.addr + recorded.size, instance));
        }
        decided.pool
    }

    #[allow(clippy::too_many_arguments)]
    fn decide<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        instance: u32,
        recorded: &Instance,
        index: usize,
        size: u64,
        stream: StreamId,
    ) -> PoolOf {
        let decided = |pool, evidence| PoolOf {
            pool,
            evidence,
            chosen: false,
        };
        // The trace says: nothing else can be stronger (no check contradicts it, see
        // `landed_elsewhere`).
        if let Some(pool) = self.recorded.get(index).copied().flatten() {
            return decided(pool, PoolEvidence::Recorded);
        }
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        if let Some(&pool) = self.forced.get(&instance) {
            if pool == FORCE_PRIVATE {
                return PoolOf {
                    pool: self.some_private(allocator, bytes, stream),
                    evidence: PoolEvidence::Contradiction,
                    chosen: true,
                };
            }
            return decided(pool, PoolEvidence::Contradiction);
        }
        if let Some(pool) = recorded.final_pool {
            return decided(pool, PoolEvidence::FinalSegments);
        }
        if let Some(&pool) = self.released_private.get(&instance) {
            return decided(pool, PoolEvidence::PoolRelease);
        }
        let made_here = recorded.first_alloc == Some(index as u32);
        if made_here && allocator.would_serve_from_cache(bytes, stream) {
            return PoolOf {
                pool: self.some_private(allocator, bytes, stream),
                evidence: PoolEvidence::DefaultCouldServe,
                chosen: true,
            };
        }
        // The pool most of the stream's allocations went to (among the default and live private
        // pools), the last one used on ties. A pool a release decided has all its segments
        // already (its release freed every idle one): it is not assumed for others.
        let last = self.last_on_stream.get(&stream).copied();
        let closed = |p: &MempoolId| self.released_private.values().any(|c| c == p);
        let pool = self
            .counts
            .get(&stream)
            .and_then(|counts| {
                counts
                    .iter()
                    .filter(|(p, _)| p.is_default() || (self.live_private(**p) && !closed(p)))
                    .max_by_key(|(p, n)| (**n, Some(**p) == last, **p))
                    .map(|(p, _)| *p)
            })
            .unwrap_or(MempoolId::DEFAULT);
        PoolOf {
            pool,
            evidence: PoolEvidence::Assumed,
            chosen: false,
        }
    }

    /// The pool of a request that ran out of memory on `stream` in the record: the default pools,
    /// unless their cache would have served it, or the record shows no release before the failure
    /// although they held an idle segment (a default request releases every one before it fails):
    /// then a private pool in use on the stream that could not serve it either (`use_mem_pool`, or
    /// a capture, which gets no cache release before its failure).
    ///
    /// Where the trace allows both, the default pools, unless [`ooms_private`](Self::ooms_private)
    /// names the request: the two differ only in the statistics (a default request synchronizes
    /// and retries once before it fails, a private pool's does not).
    pub(crate) fn oom_pool<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        size: usize,
        stream: StreamId,
        after_releases: bool,
    ) -> MempoolId {
        let ordinal = self.ooms_seen;
        self.ooms_seen += 1;
        let default_failed = !allocator.would_serve_from_cache(size, stream)
            && (after_releases || !holds_idle_default_segment(allocator));
        if default_failed && after_releases {
            return MempoolId::DEFAULT;
        }
        let Some(private) = self.recent_private_failing(allocator, size, stream) else {
            return MempoolId::DEFAULT;
        };
        if default_failed && !self.ooms_private.contains(&ordinal) {
            tracing::trace!(
                ordinal,
                size,
                "out-of-memory request either pool's: replayed as the default pools'"
            );
            self.ambiguous_ooms.push(ordinal);
            return MempoolId::DEFAULT;
        }
        tracing::trace!(ordinal, size, %private, "out-of-memory request replayed in a private pool");
        self.private_ooms += 1;
        private
    }

    /// Requests `size` bytes on `stream` from `pool` (see [`allocate`](Self::allocate)) without
    /// counting it as the stream's use of the pool.
    pub(crate) fn request<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        pool: MempoolId,
        size: usize,
        stream: StreamId,
    ) -> tensormem_cuda_alloc::Result<Allocation> {
        if pool.is_default()
            || allocator
                .begin_allocate_to_pool(pool, move |s| s == stream)
                .is_err()
        {
            return allocator.allocate(size, stream);
        }
        self.began(allocator, pool);
        let result = allocator.allocate(size, stream);
        if let Err(e) = allocator.end_allocate_to_pool(pool) {
            tracing::debug!(%pool, error = %e, "ending a replayed capture failed");
        }
        result
    }

    /// Notes that an allocation on `stream` went to `pool`.
    fn used(&mut self, stream: StreamId, pool: MempoolId) {
        self.last_on_stream.insert(stream, pool);
        *self
            .counts
            .entry(stream)
            .or_default()
            .entry(pool)
            .or_default() += 1;
        if !pool.is_default() {
            let list = self.private_on_stream.entry(stream).or_default();
            list.retain(|p| *p != pool);
            list.push(pool);
        }
    }

    /// Allocates `size` bytes on `stream` in `pool`: in a private pool, while a capture routes the
    /// stream to it, as PyTorch's graph capture and `use_mem_pool` do.
    pub(crate) fn allocate<D: Device>(
        &mut self,
        allocator: &CachingAllocator<D>,
        pool: MempoolId,
        size: usize,
        stream: StreamId,
    ) -> tensormem_cuda_alloc::Result<Allocation> {
        self.used(stream, pool);
        if !pool.is_default() && self.released.contains(&pool) {
            // The pool was released in the replay although the trace allocates into it: the
            // check reports where this leads.
            tracing::debug!(%pool, "allocation into a released pool replayed in the default pool");
        }
        self.request(allocator, pool, size, stream)
    }

    /// The trace releases the segments `set` of the plan: the private pools they belong to were
    /// released by their users before (PyTorch releases a private pool's segments only then).
    pub(crate) fn release_starts<D: Device>(
        &mut self,
        plan: &DevicePlan,
        allocator: &CachingAllocator<D>,
        set: &[u32],
    ) {
        for &id in set {
            let Some(pool) = self.of.get(id as usize).copied().flatten().map(|p| p.pool) else {
                continue;
            };
            if pool.is_default() || !self.released.insert(pool) {
                continue;
            }
            for _ in 0..self.begun.get(&pool).copied().unwrap_or(0) {
                if allocator.release_pool(pool).is_err() {
                    break;
                }
            }
        }
        for &id in set {
            if let Some(i) = plan.instances.get(id as usize).filter(|i| i.released) {
                self.live.remove(&i.addr);
            }
        }
    }

    /// The private pools of the segments `set`, when every one of them is private (a release of
    /// those pools only: `torch.cuda.memory.empty_cache` for a `MemPool`, or its destruction).
    pub(crate) fn only_private(&self, set: &[u32]) -> Option<Vec<MempoolId>> {
        let mut pools = Vec::new();
        for &id in set {
            let pool = self.of.get(id as usize).copied().flatten()?.pool;
            if pool.is_default() {
                return None;
            }
            if !pools.contains(&pool) {
                pools.push(pool);
            }
        }
        (!pools.is_empty()).then_some(pools)
    }

    /// The private pool every segment `restore` restores belongs to, if they all belong to one
    /// that is still in use.
    pub(crate) fn restored_pool(&self, restore: &crate::plan::RestorePlan) -> Option<MempoolId> {
        let mut pools = restore
            .instances
            .iter()
            .map(|&id| self.of.get(id as usize).copied().flatten().map(|p| p.pool));
        let pool = pools.next()??;
        let one = pools.all(|p| p == Some(pool));
        (one && self.live_private(pool)).then_some(pool)
    }

    /// While inferring: the allocation of recorded pool `pool` landed at `landed` instead of the
    /// recorded address. If it landed in a segment whose pool was only assumed, the assumption was
    /// wrong: the segment belongs to another pool than this allocation's.
    pub(crate) fn landed_elsewhere(&mut self, pool: MempoolId, landed: u64) {
        if !self.infer || self.contradiction.is_some() {
            return;
        }
        let Some((_, &(end, id))) = self.live.range(..=landed).next_back() else {
            return;
        };
        if landed >= end {
            return;
        }
        let Some(p) = self.of[id as usize] else {
            return;
        };
        // The segment's pool is this allocation's in the replay, not in the record. An assumed
        // pool was wrong; a private pool chosen among several was one too many: the segment gets
        // a pool of its own (or the default pool, when this allocation's was private).
        let own = MempoolId(UNNAMED_POOL_BASE + (1 << 40) + u64::from(id), 0);
        let other = match p.evidence {
            PoolEvidence::Assumed if pool.is_default() => FORCE_PRIVATE,
            PoolEvidence::Assumed => MempoolId::DEFAULT,
            // Made the default pools' by an earlier contradiction (of an assumed private pool),
            // and a default allocation went elsewhere: a private pool after all, another one.
            PoolEvidence::Contradiction if pool.is_default() && p.pool.is_default() => {
                FORCE_PRIVATE
            }
            _ if p.chosen && !pool.is_default() && p.pool == pool => own,
            _ => return,
        };
        self.contradiction = Some((id, other));
    }
}
