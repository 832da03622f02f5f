//! One device's trace as a [`Replay`](crate::Replay) keeps it: the plan read from the trace and
//! everything inferred from it once (the device's memory, the pool of every recorded segment, the
//! steps of the `backend:cudaMallocAsync` model), and the runs made from them.

use std::collections::HashSet;

use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceEntry};

use crate::async_model::{self, AsyncPlan};
use crate::capacity::{CapacityInference, LimitPhase};
use crate::check::ExpectedStats;
use crate::plan::{DevicePlan, PlanError};
use crate::pools::{self, PoolAttribution, PoolOf, PoolRun};
use crate::run::{self, DeviceRun};
use crate::{inference, Error, Result, RunOptions, DEFAULT_CAPACITY};

/// The most out-of-memory requests [`PreparedDevice::attribute_ooms_from_stats`] tries in a
/// private pool, one replay each.
const MAX_OOM_TRIALS: usize = 64;

/// One device's trace, prepared for replaying.
#[derive(Debug)]
pub(crate) struct PreparedDevice {
    /// The trace read as the calls a replay makes.
    pub(crate) plan: DevicePlan,
    /// The device memory its trace implies.
    pub(crate) capacity: CapacityInference,
    /// The pool of each recorded segment.
    pub(crate) pools: Vec<Option<PoolOf>>,
    /// Which allocations went to which pool.
    pub(crate) attribution: PoolAttribution,
    /// Out-of-memory requests (by order) the trace leaves to either pool: replayed in the default
    /// pools unless [`ooms_private`](Self::ooms_private) names them.
    pub(crate) ambiguous_ooms: Vec<u32>,
    /// Out-of-memory requests the recorded statistics put in a private pool.
    pub(crate) ooms_private: HashSet<u32>,
    /// Its trace as steps of the `backend:cudaMallocAsync` model.
    pub(crate) async_plan: AsyncPlan,
}

/// Reads device `device`'s trace into a plan, under the recorded configuration `recorded` (its
/// `max_split_size` and garbage collection tell which releases synchronized); warns of frees of
/// blocks the trace never allocated.
pub(crate) fn read_plan(
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEntry],
    recorded: &AllocatorConfig,
) -> Result<DevicePlan> {
    let segments = snapshot
        .segments
        .iter()
        .filter(|s| usize::try_from(s.device).ok() == Some(device))
        .cloned()
        .collect();
    let plan = DevicePlan::build(
        device,
        trace,
        segments,
        recorded.max_split_size,
        recorded.garbage_collection_threshold > 0.0,
    )
    .map_err(|e| Error::Trace {
        device,
        reason: match e {
            PlanError::TooManyEvents => "it has more than 2^32 events",
            PlanError::StreamIds => "its stream ids leave no room for synthetic streams",
        },
    })?;
    if plan.unmatched_frees > 0 {
        tracing::warn!(
            device,
            frees = plan.unmatched_frees,
            "the trace frees blocks it never allocated (it starts mid-run: raise max_entries when \
             recording); those frees are skipped"
        );
    }
    Ok(plan)
}

impl PreparedDevice {
    /// Prepares `plan` (read from `snapshot`'s trace of its device) under the recorded
    /// configuration `recorded`: infers the device's memory (`fraction_implied`: the memory
    /// fraction in `recorded` was implied by the traces, not recorded), then the pool of every
    /// recorded segment, and reads the trace as steps of the `backend:cudaMallocAsync` model.
    pub(crate) fn prepare(
        plan: DevicePlan,
        snapshot: &Snapshot,
        recorded: &AllocatorConfig,
        fraction_implied: bool,
    ) -> Result<PreparedDevice> {
        let capacity = CapacityInference {
            fraction_implied,
            ..CapacityInference::infer(&plan.capacity, recorded)
        };
        let trace = snapshot.trace(plan.device);
        let named = pools::recorded_pools(&plan, trace);
        let (pools, attribution, ambiguous_ooms) =
            inference::infer_pools(&plan, recorded, &capacity, &named)?;
        let async_plan = AsyncPlan::build(trace, &plan);
        Ok(PreparedDevice {
            plan,
            capacity,
            pools,
            attribution,
            ambiguous_ooms,
            ooms_private: HashSet::new(),
            async_plan,
        })
    }

    /// The device memory the simulated device gets when the caller does not say.
    fn default_capacity(&self) -> u64 {
        self.capacity.capacity.unwrap_or(DEFAULT_CAPACITY)
    }

    /// The limits the program set while it ran, for a run under `options`: none when the run
    /// names a memory fraction of its own (a what-if run of another fraction replaces the
    /// program's).
    fn phases(&self, options: &RunOptions<'_>) -> &[LimitPhase] {
        self.capacity
            .phases_for(options.config.per_process_memory_fraction)
    }

    /// Decides which out-of-memory requests the trace leaves to either pool were a private pool's,
    /// from the `num_alloc_retries` PyTorch reported (`want`): when the replay under the recorded
    /// configuration `recorded` counts more retries, the earliest requests whose move to a private
    /// pool keeps the replay as close to the record are moved, one per retry too many (see
    /// [`Replay::with_expected_stats`](crate::Replay::with_expected_stats)).
    pub(crate) fn attribute_ooms_from_stats(&mut self, recorded: &AllocatorConfig, want: i64) {
        if self.ambiguous_ooms.is_empty() {
            return;
        }
        let Some((retries, mismatches)) = self.retries_and_mismatches(recorded, &HashSet::new())
        else {
            return;
        };
        let mut extra = usize::try_from(retries - want).unwrap_or(0);
        // The earliest requests whose move to a private pool keeps the replay as close to the
        // record (their pool can change where later blocks land).
        let mut chosen = HashSet::new();
        for &ordinal in self.ambiguous_ooms.iter().take(MAX_OOM_TRIALS) {
            if extra == 0 {
                break;
            }
            chosen.insert(ordinal);
            match self.retries_and_mismatches(recorded, &chosen) {
                Some((_, m)) if m <= mismatches => extra -= 1,
                _ => {
                    chosen.remove(&ordinal);
                }
            }
        }
        self.attribution.private_ooms += chosen.len();
        self.attribution.ooms_from_stats = chosen.len();
        self.ooms_private = chosen;
    }

    /// The plan replayed under the recorded configuration `recorded` with the out-of-memory
    /// requests `ooms` in a private pool: its `num_alloc_retries`, and its address and
    /// reserved-bytes mismatches.
    fn retries_and_mismatches(
        &self,
        recorded: &AllocatorConfig,
        ooms: &HashSet<u32>,
    ) -> Option<(i64, u64)> {
        let mut options = RunOptions::new(recorded.clone());
        options.timeline_points = 1;
        options.check = true;
        let mut pools = PoolRun::fixed(self.pools.clone()).with_private_ooms(ooms.clone());
        match run::run_device(
            &self.plan,
            &options,
            self.default_capacity(),
            self.phases(&options),
            0,
            None,
            &mut pools,
        ) {
            Ok(run) => Some((
                run.stats
                    .to_flat()
                    .get("num_alloc_retries")
                    .copied()
                    .unwrap_or(0),
                run.check
                    .map_or(0, |c| c.address_mismatches + c.reserved_mismatches),
            )),
            Err(e) => {
                tracing::debug!(error = %e, "replay for the out-of-memory attribution failed");
                None
            }
        }
    }

    /// Replays the trace with a fresh allocator under `options`, in the pools inferred;
    /// `events_before` counts the events of earlier devices (for progress), `expected` is this
    /// device's recorded statistics.
    pub(crate) fn run(
        &self,
        options: &RunOptions<'_>,
        events_before: u64,
        expected: Option<&ExpectedStats>,
    ) -> Result<DeviceRun> {
        run::run_device(
            &self.plan,
            options,
            self.default_capacity(),
            self.phases(options),
            events_before,
            expected,
            &mut PoolRun::fixed(self.pools.clone()).with_private_ooms(self.ooms_private.clone()),
        )
    }

    /// Runs the trace through the model of the driver's pool (`backend:cudaMallocAsync`) under
    /// `options`; `recorded` is the recorded configuration, `events_before` as for
    /// [`run`](Self::run).
    pub(crate) fn run_async(
        &self,
        options: &RunOptions<'_>,
        recorded: &AllocatorConfig,
        events_before: u64,
    ) -> DeviceRun {
        async_model::run_device(
            self.plan.device,
            &self.async_plan,
            options,
            self.default_capacity(),
            &self.capacity,
            recorded,
            events_before,
        )
    }
}
