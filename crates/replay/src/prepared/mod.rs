//! One device's trace as a [`Replay`](crate::Replay) keeps it: the plan read from the trace and
//! everything inferred from it once (the device's memory, the pool of every recorded segment, the
//! steps of the `backend:cudaMallocAsync` model), and the runs made from them.

use std::collections::HashSet;

use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceEntry};
use tensormem_cuda_alloc::MempoolId;

use crate::async_model::{self, AsyncPlan};
use crate::capacity::CapacityInference;
use crate::check::ExpectedStats;
use crate::plan::{DevicePlan, PlanError};
use crate::pools::{self, PoolAttribution, PoolOf, PoolRun};
use crate::run::{self, DeviceRun, ProgramSettings, Schedule};
use crate::settings_phases::{SettingsInference, SettingsPhase};
use crate::{inference, Error, Result, RunOptions, DEFAULT_CAPACITY};

mod settings;

/// The most out-of-memory requests [`PreparedDevice::attribute_ooms_from_stats`] tries in a
/// private pool, one replay each.
const MAX_OOM_TRIALS: usize = 64;

/// The most private pools [`PreparedDevice::infer_pool_options`] tries options on (two replays
/// each a pass at most).
const MAX_POOLS_TRIED: usize = 32;

/// The most passes [`PreparedDevice::infer_pool_options`] makes over the pools.
const MAX_OPTION_PASSES: usize = 3;

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
    /// The settings the program changed while it ran, as far as the trace tells.
    pub(crate) settings: SettingsInference,
    /// Private pools made with `no_split`, as far as the trace tells.
    no_split: HashSet<MempoolId>,
    /// Private pools made with their own allocator, as far as the trace tells.
    own_allocator: HashSet<MempoolId>,
    /// Per recorded run of releases, whether it was the program's `empty_cache()`, as the replay
    /// under the recorded configuration judged it (empty until judged; see
    /// [`run::Schedule::releases_external`]).
    releases_external: Vec<bool>,
    /// The recorded configuration (the settings phases apply to runs under its settings).
    recorded: AllocatorConfig,
}

/// Reads device `device`'s trace into a plan; warns of frees of blocks the trace never allocated.
pub(crate) fn read_plan(
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEntry],
) -> Result<DevicePlan> {
    let segments = snapshot
        .segments
        .iter()
        .filter(|s| usize::try_from(s.device).ok() == Some(device))
        .cloned()
        .collect();
    let plan = DevicePlan::build(device, trace, segments).map_err(|e| Error::Trace {
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
        let inferred = inference::infer_pools(&plan, recorded, &capacity, &[], &named)?;
        let async_plan = AsyncPlan::build(trace, &plan);
        let departs = inferred.mismatches > 0;
        let mut device = PreparedDevice {
            plan,
            capacity,
            pools: inferred.of,
            attribution: inferred.attribution,
            ambiguous_ooms: inferred.ambiguous_ooms,
            ooms_private: HashSet::new(),
            async_plan,
            settings: SettingsInference::default(),
            recorded: recorded.clone(),
            no_split: HashSet::new(),
            own_allocator: HashSet::new(),
            releases_external: Vec::new(),
        };
        let departs = departs && device.infer_pool_options();
        if departs {
            let found = device.settings_and_pools(&named)?;
            let unexplained = found.1.as_ref().map_or(u64::MAX, |(_, i)| i.mismatches);
            if unexplained > 0 && device.attribution.has_unnamed_private_pools() {
                // The private pools were invented to explain allocations the recorded settings
                // contradict; settings changed while the program ran explain those as well, and
                // the pools invented then hide them. Searched again with every segment in the
                // default pools (the pools are inferred again under what is found).
                let default_pools = vec![None; device.pools.len()];
                let invented = std::mem::replace(&mut device.pools, default_pools);
                let again = device.settings_and_pools(&named)?;
                if again
                    .1
                    .as_ref()
                    .is_some_and(|(_, i)| i.mismatches < unexplained)
                {
                    device.adopt(again);
                } else {
                    device.pools = invented;
                    device.adopt(found);
                }
            } else {
                device.adopt(found);
            }
        }
        device.judge_releases();
        Ok(device)
    }

    /// Searches for settings changed while the program ran with the pools as they are, and
    /// infers the pools again under the settings found (`None` when none were found).
    fn settings_and_pools(
        &self,
        named: &std::sync::Arc<[Option<MempoolId>]>,
    ) -> Result<(
        SettingsInference,
        Option<(CapacityInference, inference::Inferred)>,
    )> {
        let settings = self.infer_settings();
        if settings.phases.is_empty() {
            return Ok((settings, None));
        }
        // Garbage collection on where it was not recorded (or off where it was) reads the
        // releases that bound the limit otherwise.
        let capacity = if settings.phases.iter().any(|p| {
            p.config.garbage_collection_threshold != self.recorded.garbage_collection_threshold
        }) {
            CapacityInference {
                fraction_implied: self.capacity.fraction_implied,
                ..CapacityInference::infer_under(
                    &self.plan.capacity,
                    &self.recorded,
                    &settings.phases,
                )
            }
        } else {
            self.capacity.clone()
        };
        let inferred = inference::infer_pools(
            &self.plan,
            &self.recorded,
            &capacity,
            &settings.phases,
            named,
        )?;
        Ok((settings, Some((capacity, inferred))))
    }

    /// Takes the settings found, and the device's memory and the pools inferred under them, if
    /// any.
    fn adopt(
        &mut self,
        (settings, inferred): (
            SettingsInference,
            Option<(CapacityInference, inference::Inferred)>,
        ),
    ) {
        self.settings = settings;
        if let Some((capacity, inferred)) = inferred {
            self.capacity = capacity;
            self.pools = inferred.of;
            self.attribution = inferred.attribution;
            self.ambiguous_ooms = inferred.ambiguous_ooms;
        }
    }

    /// Decides once, under the recorded configuration, which recorded runs of releases followed
    /// by a new segment were the program's `empty_cache()`: what-if runs keep the answer (their
    /// own state, under other settings, would say otherwise: a collector a what-if run adds would
    /// take the program's `empty_cache()` for its own).
    pub(crate) fn judge_releases(&mut self) {
        self.releases_external = Vec::new();
        if !self.plan.releases.iter().any(|r| r.next_segment.is_some()) {
            return;
        }
        let mut options = RunOptions::new(self.recorded.clone());
        options.timeline_points = 1;
        match self.run(&options, 0, None) {
            Ok(run) => self.releases_external = run.releases_external,
            Err(e) => tracing::debug!(error = %e, "judging the recorded releases failed"),
        }
    }

    /// The replay of the inferred pools, with the out-of-memory requests and the `no_split` pools
    /// decided.
    fn pool_run(&self) -> PoolRun {
        PoolRun::fixed(self.pools.clone())
            .with_private_ooms(self.ooms_private.clone())
            .with_no_split(self.no_split.clone())
            .with_own_allocator(self.own_allocator.clone())
    }

    /// Finds the options private pools were made with (`torch.cuda.MemPool(no_split=True)`,
    /// `MemPool(allocator=...)`; the snapshot records neither) when the replay departs from the
    /// record: each private pool in turn is replayed with each option (its own allocator only
    /// under expandable segments, where it shows: its segments are whole device allocations), kept
    /// when the record agrees with it better. Whether the replay still departs.
    fn infer_pool_options(&mut self) -> bool {
        let Some((_, mut least)) = self.retries_and_mismatches(&self.recorded, &self.ooms_private)
        else {
            return true;
        };
        let private: Vec<MempoolId> = self
            .attribution
            .pools
            .iter()
            .map(|share| share.pool)
            .filter(|pool| !pool.is_default())
            .take(MAX_POOLS_TRIED)
            .collect();
        let expandable = self.recorded.expandable_segments;
        // Each pool's options turned on or off, one at a time, kept when the replay departs less;
        // again while that helps (an option taken early can be one another pool's explains).
        for _ in 0..MAX_OPTION_PASSES {
            let before = least;
            for &pool in &private {
                for own_allocator in [false, true] {
                    if least == 0 || (own_allocator && !expandable) {
                        break;
                    }
                    let toggle = |device: &mut Self| {
                        let set = if own_allocator {
                            &mut device.own_allocator
                        } else {
                            &mut device.no_split
                        };
                        if !set.remove(&pool) {
                            set.insert(pool);
                        }
                    };
                    toggle(self);
                    match self.retries_and_mismatches(&self.recorded, &self.ooms_private) {
                        Some((_, mismatches)) if mismatches < least => least = mismatches,
                        _ => toggle(self),
                    }
                }
            }
            if least == 0 || least == before {
                break;
            }
        }
        let sorted = |set: &HashSet<MempoolId>| {
            let mut pools: Vec<MempoolId> = set.iter().copied().collect();
            pools.sort_unstable();
            pools
        };
        self.attribution.no_split = sorted(&self.no_split);
        self.attribution.own_allocator = sorted(&self.own_allocator);
        if !self.no_split.is_empty() || !self.own_allocator.is_empty() {
            tracing::info!(
                device = self.plan.device,
                no_split = ?self.attribution.no_split,
                own_allocator = ?self.attribution.own_allocator,
                "private pools replayed with options the snapshot does not record"
            );
        }
        least > 0
    }

    /// The plan replayed under the recorded configuration with the settings `phases` (none: the
    /// recorded settings throughout), checked against the record (and `expected`, when given) and
    /// stopped at its first departure from it. `None` when the replay fails.
    fn checked_run(
        &self,
        phases: &[SettingsPhase],
        expected: Option<&ExpectedStats>,
    ) -> Option<DeviceRun> {
        let mut options = RunOptions::new(self.recorded.clone());
        options.timeline_points = 1;
        options.check = true;
        let schedule = Schedule {
            limits: self
                .capacity
                .phases_for(self.recorded.per_process_memory_fraction),
            settings: phases,
            stop_at_divergence: true,
            releases_external: None,
            program: ProgramSettings {
                recorded: &self.recorded,
                phases,
            },
        };
        run::run_device(
            &self.plan,
            &options,
            self.default_capacity(),
            schedule,
            0,
            expected,
            &mut self.pool_run(),
        )
        .ok()
    }

    /// The device memory the simulated device gets when the caller does not say.
    fn default_capacity(&self) -> u64 {
        self.capacity.capacity.unwrap_or(DEFAULT_CAPACITY)
    }

    /// What the program changed while it ran, for a run under `options`: the limits unless the
    /// run names a memory fraction of its own, the settings unless it names settings of its own
    /// (a what-if run replaces the program's).
    fn schedule(&self, options: &RunOptions<'_>) -> Schedule<'_> {
        Schedule {
            limits: self
                .capacity
                .phases_for(options.config.per_process_memory_fraction),
            settings: self.settings.phases_for(&options.config, &self.recorded),
            stop_at_divergence: false,
            releases_external: (!self.releases_external.is_empty())
                .then_some(self.releases_external.as_slice()),
            program: ProgramSettings {
                recorded: &self.recorded,
                phases: &self.settings.phases,
            },
        }
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
        let mut pools = self.pool_run().with_private_ooms(ooms.clone());
        match run::run_device(
            &self.plan,
            &options,
            self.default_capacity(),
            self.schedule(&options),
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
            self.schedule(options),
            events_before,
            expected,
            &mut self.pool_run(),
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
