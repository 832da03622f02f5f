//! What a replay says about pools: which pool each recorded segment went to and why
//! ([`PoolOf`], [`PoolEvidence`]), and the attribution reported per device ([`PoolAttribution`]).

use std::collections::{BTreeMap, HashSet};

use tensormem_cuda_alloc::device::StreamId;
use tensormem_cuda_alloc::MempoolId;

use crate::plan::DevicePlan;

/// How a segment's pool was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolEvidence {
    /// The trace names it: the `pool_id` of an allocation in the segment.
    Recorded,
    /// The snapshot's final segments name it.
    FinalSegments,
    /// Released by a release of private pools only: `empty_cache` left idle segments of the
    /// default pools in place (the final segments name them) while it freed this one.
    PoolRelease,
    /// The default pool could have served the request that made the segment.
    DefaultCouldServe,
    /// The other choice contradicted the record.
    Contradiction,
    /// Assumed (the stream's last pool, or the default); no recorded decision contradicts it.
    Assumed,
}

/// A segment's pool and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PoolOf {
    pub(crate) pool: MempoolId,
    pub(crate) evidence: PoolEvidence,
    /// The pool was chosen among private pools that all fit the evidence (the record may still
    /// show it was one too many: the segment then gets a pool of its own).
    pub(crate) chosen: bool,
}

/// One pool's share of a device's allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolShare {
    /// The pool (`(0, 0)`: the default pools).
    pub pool: MempoolId,
    /// Allocations attributed to it.
    pub allocations: u64,
    /// Recorded segments attributed to it.
    pub segments: u64,
    /// Allocations attributed by each kind of evidence.
    pub by_evidence: BTreeMap<PoolEvidence, u64>,
}

/// An allocation whose pool the trace does not decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UndecidedAllocation {
    /// Index of its `alloc` event in the device's trace.
    pub event: usize,
    /// The size asked for.
    pub size: u64,
    /// Its stream.
    pub stream: StreamId,
    /// The pool the replay assumed.
    pub assumed: MempoolId,
}

/// Which allocations of a device were attributed to which pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolAttribution {
    /// Per pool, in id order (the default pools first).
    pub pools: Vec<PoolShare>,
    /// Allocations whose pool rests on an assumption (see `docs/replay.md`, "Private pools").
    pub undecided: Vec<UndecidedAllocation>,
    /// Assumptions flipped because they contradicted the record.
    pub flips: usize,
    /// Whether the inference stopped at [`MAX_FLIPS`](crate::MAX_FLIPS) or at an assumption contradicted both ways.
    pub gave_up: bool,
    /// Requests that ran out of memory, replayed in a private pool (`use_mem_pool` or a capture):
    /// the default pools' cache would have served them, or they would have released idle default
    /// segments first, which the trace does not show.
    pub private_ooms: usize,
    /// Of those, the ones the trace leaves open and the recorded statistics decided (see
    /// [`Replay::with_expected_stats`](crate::Replay::with_expected_stats)).
    pub ooms_from_stats: usize,
    /// Private pools replayed as made with `no_split` (`torch.cuda.MemPool(no_split=True)`, which
    /// the snapshot does not record): the record agrees with them only so.
    pub no_split: Vec<MempoolId>,
    /// Private pools replayed as made with their own allocator (`torch.cuda.MemPool(allocator=...)`,
    /// which the snapshot does not record): under expandable segments their segments are whole
    /// device allocations in the record.
    pub own_allocator: Vec<MempoolId>,
}

impl PoolAttribution {
    /// Whether a private pool was made up by the inference alone: neither the trace, the final
    /// segments nor a release of private pools names it.
    #[must_use]
    pub fn has_unnamed_private_pools(&self) -> bool {
        self.pools.iter().any(|p| {
            !p.pool.is_default()
                && !p.by_evidence.keys().any(|e| {
                    matches!(
                        e,
                        PoolEvidence::Recorded
                            | PoolEvidence::FinalSegments
                            | PoolEvidence::PoolRelease
                    )
                })
        })
    }

    /// Whether any allocation was attributed to a private pool.
    #[must_use]
    pub fn has_private(&self) -> bool {
        self.pools.iter().any(|p| !p.pool.is_default())
    }

    pub(crate) fn build(
        plan: &DevicePlan,
        of: &[Option<PoolOf>],
    ) -> (Vec<PoolShare>, Vec<UndecidedAllocation>) {
        let mut shares: BTreeMap<MempoolId, PoolShare> = BTreeMap::new();
        let share = |shares: &mut BTreeMap<MempoolId, PoolShare>, pool: MempoolId| {
            shares.entry(pool).or_insert_with(|| PoolShare {
                pool,
                allocations: 0,
                segments: 0,
                by_evidence: BTreeMap::new(),
            });
        };
        for p in of.iter().flatten() {
            share(&mut shares, p.pool);
            if let Some(s) = shares.get_mut(&p.pool) {
                s.segments += 1;
            }
        }
        // Streams some private pool served: a segment of theirs whose pool was only assumed could
        // have been either.
        let mut private_streams = HashSet::new();
        for op in &plan.ops {
            if let crate::plan::Op::Alloc {
                stream, instance, ..
            } = *op
            {
                if of
                    .get(instance as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|p| !p.pool.is_default())
                {
                    private_streams.insert(stream);
                }
            }
        }
        let mut undecided = Vec::new();
        let mut allocs = 0usize;
        for (op, &event) in plan.ops.iter().zip(&plan.op_events) {
            let crate::plan::Op::Alloc {
                size,
                stream,
                instance,
                ..
            } = *op
            else {
                continue;
            };
            allocs += 1;
            let assigned = of.get(instance as usize).copied().flatten();
            let (pool, evidence) = assigned
                .map_or((MempoolId::DEFAULT, PoolEvidence::Assumed), |p| {
                    (p.pool, p.evidence)
                });
            share(&mut shares, pool);
            if let Some(s) = shares.get_mut(&pool) {
                s.allocations += 1;
                *s.by_evidence.entry(evidence).or_default() += 1;
            }
            if assigned.is_some_and(|p| p.evidence == PoolEvidence::Assumed)
                && private_streams.contains(&stream)
            {
                undecided.push(UndecidedAllocation {
                    event: event as usize,
                    size,
                    stream,
                    assumed: pool,
                });
            }
        }
        debug_assert_eq!(allocs, plan.expected.len());
        (shares.into_values().collect(), undecided)
    }
}
