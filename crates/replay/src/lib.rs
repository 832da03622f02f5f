//! Trace replay: run a recorded PyTorch workload's allocations through tensormem's caching allocator
//! ([`tensormem_cuda_alloc`]), on the CPU.
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_replay::{ExpectedStats, Replay};
//!
//! // A workload recorded with its history on, as `_record_memory_history()` records PyTorch's.
//! let allocator = CachingAllocator::new(SimDevice::new(1 << 30));
//! allocator.record_history(true, 1000);
//! let s = StreamId(0);
//! let a = allocator.allocate(3 << 20, s)?;
//! let b = allocator.allocate(4096, s)?;
//! allocator.free(a)?;
//! let c = allocator.allocate(1 << 20, s)?; // reuses part of a's block
//! allocator.free(b)?;
//! allocator.free(c)?;
//! let snapshot = allocator.snapshot(); // what `_dump_snapshot()` saves
//! let recorded = ExpectedStats::from_figures(allocator.memory_stats().to_flat());
//!
//! // Replayed under the recorded configuration: same addresses, same statistics.
//! let replay = Replay::new(&snapshot)?.with_expected_stats(recorded);
//! let run = replay.run_recorded()?;
//! assert_eq!(run.matches_record(), Some(true));
//!
//! // What if large blocks were never split?
//! let what_if = replay.run_with("max_split_size_mb:20")?;
//! println!("reserved peak: {}", what_if.flat_stats()["reserved_bytes.all.peak"]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! `torch.cuda.memory._record_memory_history()` makes PyTorch's caching allocator record every
//! event (`alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_map`, ...), and
//! `_dump_snapshot()` saves them. Those events are enough to redo the run's *requests* (what
//! was allocated, on which stream, freed when, held back by which other stream's work) on a
//! simulated device, in milliseconds, under any configuration:
//!
//! - **under the recorded configuration** (the snapshot's `allocator_settings`) the replay makes
//!   PyTorch's decisions exactly: every block lands where PyTorch put it and every figure of
//!   `torch.cuda.memory_stats()` comes out the same. [`Check`] compares the replay with the record;
//! - **under another configuration** (`expandable_segments:True`, `max_split_size_mb:64`,
//!   `garbage_collection_threshold:0.6,per_process_memory_fraction:0.8`, ...) it answers what the
//!   run would have reserved, how fragmented the cache would have been, and whether it would have
//!   run out of memory on a device of a given size.
//!
//! How the events become calls:
//!
//! - `alloc` is `allocate(size, stream)` with the size the caller asked for;
//! - `free_requested` is `free`. When the trace's `free_completed` for the block does not follow at
//!   once, the block was in use on another stream (`record_stream`): the replay records it as used
//!   on a synthetic stream whose work completes where the trace says `free_completed`, so the block
//!   returns to its pool at the next allocation, as in PyTorch;
//! - new segments get the addresses the trace's `segment_alloc` events recorded, and expandable
//!   segments the ranges their first `segment_map` shows (see [`ReplayDevice`]): the allocator
//!   breaks ties by address, so the layout must be the real one for the decisions to be;
//! - a run of `segment_free` events ending in an `oom`, or in a new segment the device had no room
//!   for, happened inside an allocation (the replayed allocator makes those releases itself); any
//!   other run was an `empty_cache()` call. An `oom` event is the failed request, replayed on a
//!   device as large as the record shows it was;
//! - the device's memory is not in the trace: every recorded decision that depended on it (new
//!   segments, `oom` events with their `device_free`, releases that made room) bounds it, and the
//!   replay picks a value inside the interval they allow ([`CapacityInference`]);
//! - private pools (CUDA graph capture, `torch.cuda.MemPool`): a trace whose entries carry `pool_id`
//!   (PyTorch after 2.11, tensormem) names the pool of every allocation; PyTorch 2.11's do not, and
//!   the pool of each recorded segment is inferred (the snapshot's final `segment_pool_id`, whether
//!   the default pool could have served the request that made it, and assumptions checked against
//!   the record). Private allocations are replayed into private pools ([`PoolAttribution`]);
//! - every device has its own allocator; [`ReplayRun::flat_stats`] is device 0's, as
//!   `torch.cuda.memory_stats()` with no argument.
//!
//! Under `backend:cudaMallocAsync` (a what-if only: PyTorch records no history under it) there is no
//! caching allocator to replay: the driver's memory pool decides where each request goes. The
//! requests run through a model of that pool instead ([`async_model`]), which gives the figures
//! PyTorch reports for that backend: its used memory from the trace's live requested bytes, its
//! reserved memory as a lower bound ([`ReplayRun::lower_bounds`], [`DeviceRun::async_model`]), and
//! the requests that would certainly run out of memory on the device the record implies.
//!
//! Reading PyTorch's files:
//!
//! ```no_run
//! use tensormem_replay::{ExpectedStats, Replay};
//! use tensormem_cuda_alloc::snapshot::Snapshot;
//!
//! let snapshot = Snapshot::read_file("gpt2_train.pickle")?;
//! let replay = Replay::new(&snapshot)?
//!     .with_expected_stats(ExpectedStats::read_file("gpt2_train.stats.json")?);
//! let recorded = replay.run_recorded()?;
//! assert_eq!(recorded.matches_record(), Some(true));
//! let what_if = replay.run_with("expandable_segments:True")?;
//! println!(
//!     "reserved peak {} -> {}",
//!     recorded.flat_stats()["reserved_bytes.all.peak"],
//!     what_if.flat_stats()["reserved_bytes.all.peak"]
//! );
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod async_model;
mod capacity;
mod check;
mod device;
mod inference;
pub mod matrix;
mod plan;
mod pools;
mod prepared;
mod restore;
mod run;
mod settings_phases;
mod timeline;

use std::collections::BTreeMap;

pub use async_model::{AsyncBounds, ASYNC_LOWER_BOUNDS, POOL_GRANULARITY};
pub use capacity::{CapacityInference, LimitPhase};
pub use check::{
    Check, Divergence, DivergenceKind, ExpectedStats, SegmentCheck, StatMismatch, StatsCheck,
};
pub use device::{AddressUse, ReplayDevice};
pub use matrix::{
    FailedRequest, Grid, GridError, GridPoint, MatrixOptions, MatrixResult, MatrixRow,
    Recommendation, Setting, SettingsMatrix,
};
pub use pools::{
    PoolAttribution, PoolEvidence, PoolShare, UndecidedAllocation, MAX_FLIPS, UNNAMED_POOL_BASE,
};
pub use run::{DeviceRun, RestoreCount};
pub use settings_phases::{SettingsInference, SettingsPhase};
pub use timeline::{Timeline, TimelinePoint};

use plan::DevicePlan;
use prepared::PreparedDevice;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend, ConfigError};
use tensormem_cuda_alloc::snapshot::{Snapshot, SnapshotError};
use tensormem_cuda_alloc::InvariantViolation;

/// The simulated device's memory when neither the caller nor the trace says how much the real one
/// had: 1 TiB, so that nothing runs out.
pub const DEFAULT_CAPACITY: u64 = 1 << 40;

/// Why a replay could not be prepared or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The snapshot holds no trace to replay.
    #[error(
        "the snapshot has no recorded allocator events to replay; record them with \
         torch.cuda.memory._record_memory_history(max_entries=...) before the workload runs, then \
         torch.cuda.memory._dump_snapshot(path)"
    )]
    NoEvents,
    /// The trace of a device cannot be replayed.
    #[error("device {device}'s trace cannot be replayed: {reason}")]
    Trace {
        /// The device.
        device: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// The snapshot's recorded allocator settings are not usable.
    #[error(transparent)]
    Settings(#[from] SnapshotError),
    /// A what-if configuration string does not parse.
    #[error("invalid configuration '{config}': {source}")]
    Config {
        /// The string given.
        config: String,
        /// The parser's error.
        #[source]
        source: ConfigError,
    },
    /// The snapshot's recorded settings name `backend:cudaMallocAsync`, or a run checked against
    /// the record asks for it. No such trace comes from PyTorch, which refuses memory history under
    /// that backend; a run of a native trace under it is a what-if, through the model of the
    /// driver's pool ([`async_model`]), which has nothing to check against the record.
    #[error(
        "cannot replay a run recorded under backend:{backend}: PyTorch records no memory history \
         under that backend, so there is no record to replay or check; record the trace with the \
         native backend (remove backend:{backend} from PYTORCH_CUDA_ALLOC_CONF) and ask for \
         backend:{backend} as a what-if (tensormem replay TRACE --config backend:{backend}), which \
         models the driver's memory pool"
    )]
    UnsupportedBackend {
        /// The backend asked for.
        backend: tensormem_cuda_alloc::config::Backend,
    },
    /// The allocator failed in a way other than running out of memory (a bug, or a trace the
    /// allocator cannot follow).
    #[error("replaying device {device}'s event {event} failed: {source}")]
    Allocator {
        /// The device.
        device: usize,
        /// The trace event.
        event: usize,
        /// The allocator's error.
        #[source]
        source: tensormem_cuda_alloc::Error,
    },
    /// The allocator's state was inconsistent after the replay (a bug in the allocator).
    #[error("after replaying device {device}: {source}")]
    Invariant {
        /// The device.
        device: usize,
        /// The violation.
        #[source]
        source: InvariantViolation,
    },
    /// A file of expected statistics is unusable.
    #[error("expected statistics: {reason}")]
    ExpectedStats {
        /// What is wrong.
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to run a replay.
#[derive(Clone)]
pub struct RunOptions<'a> {
    /// The allocator's configuration.
    pub config: AllocatorConfig,
    /// Compare the replay with the record ([`DeviceRun::check`]); meaningful under the recorded
    /// configuration.
    pub check: bool,
    /// The simulated device's memory in bytes; `None`: what the trace implies (the layout of its
    /// expandable reservations, cache releases that made room for a new segment, its `oom`
    /// events), else [`DEFAULT_CAPACITY`].
    pub capacity: Option<u64>,
    /// About how many points each device's [`Timeline`] gets.
    pub timeline_points: usize,
    /// Record the replaying allocator's own trace (it then appears in [`DeviceRun::snapshot`]).
    pub record_history: bool,
    /// Take the allocator's snapshot at the end ([`DeviceRun::snapshot`]).
    pub snapshot: bool,
    /// Called now and then with the number of events replayed so far (over all devices).
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl std::fmt::Debug for RunOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("config", &self.config.to_string())
            .field("check", &self.check)
            .field("capacity", &self.capacity)
            .field("timeline_points", &self.timeline_points)
            .field("record_history", &self.record_history)
            .field("snapshot", &self.snapshot)
            .finish_non_exhaustive()
    }
}

impl RunOptions<'_> {
    /// Options for a run under `config`: no check, the trace's capacity, 1000 timeline points, no
    /// history, no snapshot, no progress.
    #[must_use]
    pub fn new(config: AllocatorConfig) -> Self {
        RunOptions {
            config,
            check: false,
            capacity: None,
            timeline_points: 1000,
            record_history: false,
            snapshot: false,
            progress: None,
        }
    }
}

/// A snapshot's traces, prepared for replaying (once; each run replays them again).
#[derive(Debug)]
pub struct Replay {
    /// Per device with events, in order.
    devices: Vec<PreparedDevice>,
    recorded: AllocatorConfig,
    settings_recorded: bool,
    expected: Option<ExpectedStats>,
    events: u64,
}

impl Replay {
    /// Prepares the traces of every device of `snapshot`.
    ///
    /// # Errors
    /// [`Error::NoEvents`] when the snapshot has no trace; [`Error::Settings`] when its
    /// recorded allocator settings do not make a configuration; [`Error::UnsupportedBackend`]
    /// when they name `backend:cudaMallocAsync`; [`Error::Trace`] for a trace
    /// of more than 2^32 events.
    pub fn new(snapshot: &Snapshot) -> Result<Replay> {
        if snapshot.event_count() == 0 {
            return Err(Error::NoEvents);
        }
        let (mut recorded, settings_recorded) = recorded_settings(snapshot)?;
        supported(&recorded)?;
        let mut plans = Vec::new();
        for (device, trace) in snapshot.traces() {
            if !trace.is_empty() {
                plans.push(prepared::read_plan(snapshot, device, trace)?);
            }
        }
        let fraction_implied = imply_fraction(&mut recorded, &plans);
        let devices = plans
            .into_iter()
            .map(|plan| PreparedDevice::prepare(plan, snapshot, &recorded, fraction_implied))
            .collect::<Result<_>>()?;
        Ok(Replay {
            devices,
            recorded,
            settings_recorded,
            expected: None,
            events: snapshot.event_count() as u64,
        })
    }

    /// Adds the statistics PyTorch reported after the recorded run, for [`Check::stats`]: each
    /// device is checked against its entry of the file's `"devices"` map, device 0 against the top
    /// level when the map does not list it.
    ///
    /// A request that ran out of memory with nothing idle to release and no cached block to use
    /// may have been the default pools' or a private pool's in use on its stream (`use_mem_pool`):
    /// the trace shows the same, only the statistics differ (a default request synchronizes and
    /// retries once before failing, `num_alloc_retries`). When the replay counts more retries than
    /// the record, that many of those requests (the earliest) are replayed in the private pool;
    /// [`PoolAttribution::ooms_from_stats`] says how many.
    #[must_use]
    pub fn with_expected_stats(mut self, expected: ExpectedStats) -> Self {
        for device in &mut self.devices {
            let before = (
                device.ooms_private.clone(),
                device.settings.phases.clone(),
                device.capacity.capacity,
            );
            if let Some(&want) = expected
                .for_device(device.plan.device)
                .and_then(|e| e.figures.get("num_alloc_retries"))
            {
                device.attribute_ooms_from_stats(&self.recorded, want);
            }
            if let Some(figures) = expected.for_device(device.plan.device) {
                device.settle_switch(figures);
                device.settle_allowed(figures);
            }
            let after = (
                &device.ooms_private,
                &device.settings.phases,
                device.capacity.capacity,
            );
            if after != (&before.0, &before.1, before.2) {
                // What the releases were judged under changed: judge them again.
                device.judge_releases();
            }
        }
        self.expected = Some(expected);
        self
    }

    /// The configuration the trace was recorded with (the defaults when the snapshot does not say).
    #[must_use]
    pub fn recorded_config(&self) -> &AllocatorConfig {
        &self.recorded
    }

    /// Whether the snapshot recorded its allocator settings.
    #[must_use]
    pub fn settings_recorded(&self) -> bool {
        self.settings_recorded
    }

    /// Events in the snapshot's traces, over all devices.
    #[must_use]
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The devices that have events, in order.
    #[must_use]
    pub fn devices(&self) -> Vec<usize> {
        self.devices.iter().map(|d| d.plan.device).collect()
    }

    /// The prepared trace of `device`.
    fn device(&self, device: usize) -> Option<&PreparedDevice> {
        self.devices.iter().find(|d| d.plan.device == device)
    }

    /// The memory the simulated device gets when [`RunOptions::capacity`] is `None`: inside the
    /// interval the recorded decisions allow (see [`capacity_inference`](Self::capacity_inference)),
    /// else [`DEFAULT_CAPACITY`].
    #[must_use]
    pub fn default_capacity(&self, device: usize) -> u64 {
        self.device(device)
            .and_then(|d| d.capacity.capacity)
            .unwrap_or(DEFAULT_CAPACITY)
    }

    /// Which of `device`'s allocations the replay attributes to which pool (private pools of CUDA
    /// graphs and `MemPool`s, inferred; see [`PoolAttribution`]).
    #[must_use]
    pub fn pool_attribution(&self, device: usize) -> Option<&PoolAttribution> {
        self.device(device).map(|d| &d.attribution)
    }

    /// What the trace of `device` says about the memory the allocator could obtain: the interval
    /// every recorded decision allows, and the value picked inside it.
    #[must_use]
    pub fn capacity_inference(&self, device: usize) -> Option<&CapacityInference> {
        self.device(device).map(|d| &d.capacity)
    }

    /// What the replay found about allocator settings the program of `device`'s trace changed
    /// while it ran (`torch.cuda.memory._set_allocator_settings` mid-run, which the trace does not
    /// record): where the recorded settings first depart from the record, and the settings in
    /// force before they were set, when the search found them (see [`SettingsInference`]).
    #[must_use]
    pub fn settings_inference(&self, device: usize) -> Option<&SettingsInference> {
        self.device(device).map(|d| &d.settings)
    }

    /// The recorded configuration with `config` applied over it, the way
    /// `torch.cuda.memory._set_allocator_settings(config)` would change it. A configuration asking
    /// for `backend:cudaMallocAsync` runs through the model of the driver's pool ([`async_model`]).
    ///
    /// # Errors
    /// [`Error::Config`] when the string does not parse.
    pub fn what_if_config(&self, config: &str) -> Result<AllocatorConfig> {
        let mut applied = self.recorded.clone();
        applied.apply(config).map_err(|source| Error::Config {
            config: config.to_owned(),
            source,
        })?;
        Ok(applied)
    }

    /// Replays under the recorded configuration and checks the result against the record.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub fn run_recorded(&self) -> Result<ReplayRun> {
        let mut options = RunOptions::new(self.recorded.clone());
        options.check = true;
        self.run(&options)
    }

    /// Replays under the recorded configuration with `config` applied over it (see
    /// [`what_if_config`](Self::what_if_config)).
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed string; as [`run`](Self::run).
    pub fn run_with(&self, config: &str) -> Result<ReplayRun> {
        self.run(&RunOptions::new(self.what_if_config(config)?))
    }

    /// Replays every device's trace with a fresh allocator under `options`. Allocations the device
    /// has no memory for are counted ([`DeviceRun::refused`]) and the replay goes on.
    ///
    /// Under `backend:cudaMallocAsync` there is no allocator of PyTorch's to replay: the trace runs
    /// through the model of the driver's pool ([`async_model`]), whose statistics hold the six
    /// figures PyTorch fills for that backend, some of them lower bounds
    /// ([`DeviceRun::async_model`]).
    ///
    /// # Errors
    /// [`Error::UnsupportedBackend`] when `options.config` asks for `backend:cudaMallocAsync` with
    /// `options.check` (there is no record of such a run to check against);
    /// [`Error::Allocator`] when the allocator fails other than by running out of memory;
    /// [`Error::Invariant`] when its state is inconsistent at the end.
    pub fn run(&self, options: &RunOptions<'_>) -> Result<ReplayRun> {
        if options.config.backend == Backend::CudaMallocAsync {
            if options.check {
                return Err(Error::UnsupportedBackend {
                    backend: options.config.backend,
                });
            }
            return Ok(self.run_async(options));
        }
        supported(&options.config)?;
        let mut devices = Vec::with_capacity(self.devices.len());
        let mut events_before = 0u64;
        for device in &self.devices {
            let expected = self
                .expected
                .as_ref()
                .and_then(|e| e.for_device(device.plan.device));
            devices.push(device.run(options, events_before, expected)?);
            events_before += device.plan.events as u64;
        }
        Ok(ReplayRun {
            config: options.config.clone(),
            recorded: options.check,
            seconds: devices.iter().map(|d| d.seconds).sum(),
            devices,
            events: self.events,
        })
    }

    /// [`run`](Self::run) under `backend:cudaMallocAsync`: every device's trace through the model of
    /// its driver pool.
    fn run_async(&self, options: &RunOptions<'_>) -> ReplayRun {
        let mut devices = Vec::with_capacity(self.devices.len());
        let mut events_before = 0u64;
        for device in &self.devices {
            devices.push(device.run_async(options, &self.recorded, events_before));
            events_before += device.plan.events as u64;
        }
        ReplayRun {
            config: options.config.clone(),
            recorded: false,
            seconds: devices.iter().map(|d| d.seconds).sum(),
            devices,
            events: self.events,
        }
    }
}

/// The result of one replay.
#[derive(Clone, Debug)]
pub struct ReplayRun {
    /// The configuration replayed under.
    pub config: AllocatorConfig,
    /// Whether the run was checked against the record.
    pub recorded: bool,
    /// Per device with events, in order.
    pub devices: Vec<DeviceRun>,
    /// Seconds spent replaying events, over all devices.
    pub seconds: f64,
    /// Events in the trace, over all devices.
    pub events: u64,
}

impl ReplayRun {
    /// The configuration string (`"(defaults)"` for PyTorch's defaults).
    #[must_use]
    pub fn label(&self) -> String {
        let text = self.config.to_string();
        if text.is_empty() {
            "(defaults)".to_owned()
        } else {
            text
        }
    }

    /// The final statistics under `torch.cuda.memory_stats()`'s flat keys, for device 0 (as
    /// `memory_stats()` with no argument; the first device traced when device 0 has no events).
    /// Each device's are in [`devices`](Self::devices); [`total_stats`](Self::total_stats) sums
    /// them.
    #[must_use]
    pub fn flat_stats(&self) -> BTreeMap<String, i64> {
        self.devices
            .iter()
            .find(|d| d.device == 0)
            .or_else(|| self.devices.first())
            .map(|d| d.stats.to_flat())
            .unwrap_or_default()
    }

    /// The final statistics summed over devices (peaks: the sum of each device's peak).
    #[must_use]
    pub fn total_stats(&self) -> BTreeMap<String, i64> {
        let mut total: BTreeMap<String, i64> = BTreeMap::new();
        for device in &self.devices {
            for (key, value) in device.stats.to_flat() {
                if key == "max_split_size" {
                    total.insert(key, value);
                } else {
                    *total.entry(key).or_default() += value;
                }
            }
        }
        total
    }

    /// Replay speed: trace events per second.
    #[must_use]
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.seconds.max(1e-9)
    }

    /// Whether every figure checked matched the record; `None` for runs that were not checked.
    #[must_use]
    pub fn matches_record(&self) -> Option<bool> {
        self.recorded.then(|| {
            self.devices
                .iter()
                .all(|d| d.check.as_ref().is_some_and(Check::matches))
        })
    }

    /// The figures of [`flat_stats`](Self::flat_stats) (and of each device's statistics) that are
    /// lower bounds rather than what the run would report: [`ASYNC_LOWER_BOUNDS`] for a run under
    /// `backend:cudaMallocAsync` (the driver decides the rest), none for a replay.
    #[must_use]
    pub fn lower_bounds(&self) -> &'static [&'static str] {
        if self.config.backend == Backend::CudaMallocAsync {
            &ASYNC_LOWER_BOUNDS
        } else {
            &[]
        }
    }

    /// Allocations refused for lack of memory, over all devices.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.devices.iter().map(|d| d.refused).sum()
    }

    /// The final snapshot of every device's allocator in one (when [`RunOptions::snapshot`] was set):
    /// all segments, and each device's trace at its index.
    #[must_use]
    pub fn snapshot(&self) -> Option<Snapshot> {
        let mut merged: Option<Snapshot> = None;
        for device in &self.devices {
            let snapshot = device.snapshot.as_ref()?;
            let merged = merged.get_or_insert_with(|| Snapshot {
                allocator_settings: snapshot.allocator_settings.clone(),
                external_annotations: snapshot.external_annotations.clone(),
                ..Snapshot::default()
            });
            merged.segments.extend(snapshot.segments.iter().cloned());
            if merged.device_traces.len() <= device.device {
                merged
                    .device_traces
                    .resize_with(device.device + 1, Vec::new);
            }
            merged.device_traces[device.device] = snapshot.trace(0).to_vec();
        }
        merged
    }
}

/// The configuration the snapshot records (its `allocator_settings`) and whether it records one: the
/// defaults when it does not (PyTorch before 2.1).
fn recorded_settings(snapshot: &Snapshot) -> Result<(AllocatorConfig, bool)> {
    match &snapshot.allocator_settings {
        Some(settings) => Ok((settings.to_config()?, true)),
        None => {
            tracing::warn!(
                "the snapshot does not record its allocator settings (PyTorch before 2.1); \
                 replaying under the defaults"
            );
            Ok((AllocatorConfig::default(), false))
        }
    }
}

/// Sets in `recorded` the memory fraction the traces of `plans` imply together
/// ([`capacity::implied_fraction`]), unless `recorded` sets one; whether it did.
fn imply_fraction(recorded: &mut AllocatorConfig, plans: &[DevicePlan]) -> bool {
    let fraction_recorded =
        recorded.per_process_memory_fraction > 0.0 && recorded.per_process_memory_fraction < 1.0;
    if fraction_recorded {
        return false;
    }
    match capacity::implied_fraction(plans.iter().map(|p| &p.capacity)) {
        Some(fraction) => {
            recorded.per_process_memory_fraction = fraction;
            true
        }
        None => false,
    }
}

/// [`Error::UnsupportedBackend`] unless `config` runs the native allocator.
fn supported(config: &AllocatorConfig) -> Result<()> {
    config
        .check_supported()
        .map_err(|_| Error::UnsupportedBackend {
            backend: config.backend,
        })
}
