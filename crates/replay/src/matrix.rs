//! Which allocator settings give a trace the lowest peak reserved memory on its device: the trace
//! replayed under a grid of configurations, ranked.
//!
//! Four of `PYTORCH_CUDA_ALLOC_CONF`'s settings decide how much a program's requests reserve:
//! `expandable_segments`, `max_split_size_mb`, `roundup_power2_divisions` and (under a memory
//! fraction) `garbage_collection_threshold`. How they interact depends on the program's sizes and
//! lifetimes, so the way to know is to try them: a [`SettingsMatrix`] replays the trace under every
//! combination of a [`Grid`] of values, each applied over the recorded configuration as
//! [`Replay::what_if_config`] applies a string, and ranks the runs by peak reserved bytes.
//!
//! A configuration under which a request fails that the recorded run served would have run out of
//! memory on that device: it is disqualified ([`MatrixRow::disqualified`]) and ranked last. A
//! program that caught an out-of-memory error went on differently from then on; a replay cannot
//! know how, and repeats the recorded requests. So every row also says whether its requests fail
//! and succeed exactly as the recorded ones did ([`MatrixRow::same_path`]): only then are its
//! figures those of the program's own sequence of requests.
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_replay::{MatrixOptions, Replay, Setting, SettingsMatrix};
//!
//! // A recorded run: blocks of 30 MiB and 60 MiB, freed and asked for again in other sizes.
//! let allocator = CachingAllocator::new(SimDevice::new(1 << 30));
//! allocator.record_history(true, 1000);
//! let s = StreamId(0);
//! let mut live = Vec::new();
//! for round in 0..4usize {
//!     let size = ((30 + 7 * round) % 64 + 1) << 20;
//!     live.push(allocator.allocate(size, s)?);
//!     live.push(allocator.allocate(2 * size, s)?);
//!     allocator.free(live.remove(0))?;
//! }
//! let snapshot = allocator.snapshot();
//!
//! let replay = Replay::new(&snapshot)?;
//! let matrix = SettingsMatrix::new(&replay, &snapshot);
//! let grid = matrix.grid(&[Setting::ExpandableSegments, Setting::MaxSplitSize]);
//! let result = matrix.run(&grid, &MatrixOptions::default())?;
//! assert!(result.rows.windows(2).all(|w| w[0].peak_reserved() <= w[1].peak_reserved()));
//! let best = result.recommendation().expect("nothing runs out of memory on 1 TiB");
//! println!("PYTORCH_CUDA_ALLOC_CONF={:?}: {} bytes", best.env, best.peak_reserved);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod grid;

use std::cmp::Ordering;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction, TraceEntry};

pub use grid::{
    Grid, GridError, GridPoint, Setting, GRID_GC_THRESHOLDS, GRID_ROUNDUP_DIVISIONS,
    MIN_GRID_SPLIT_SIZE,
};

use crate::{Replay, ReplayRun, Result, RunOptions};

/// A trace prepared for replaying under a grid of configurations.
#[derive(Debug)]
pub struct SettingsMatrix<'r> {
    replay: &'r Replay,
    /// The largest request of the trace, in bytes.
    largest_request: u64,
    /// Per device with events, the trace's requests.
    requests: Vec<DeviceRequests>,
}

/// One device's requests in a trace: every `alloc` and `oom` event, in order.
#[derive(Debug)]
struct DeviceRequests {
    device: usize,
    /// Per request, its event index and size.
    requests: Vec<(u32, u64)>,
    /// The requests (by position in `requests`) that failed (`oom` events).
    failed: Vec<u32>,
}

impl DeviceRequests {
    fn read(device: usize, trace: &[TraceEntry]) -> DeviceRequests {
        let mut requests = Vec::new();
        let mut failed = Vec::new();
        for (event, entry) in trace.iter().enumerate() {
            match entry.action {
                TraceAction::Alloc => {}
                TraceAction::Oom => failed.push(requests.len() as u32),
                _ => continue,
            }
            requests.push((u32::try_from(event).unwrap_or(u32::MAX), entry.size));
        }
        DeviceRequests {
            device,
            requests,
            failed,
        }
    }

    /// The request at position `index`, as a [`FailedRequest`].
    fn request(&self, index: u32) -> FailedRequest {
        let (event, size) = self.requests[index as usize];
        FailedRequest {
            device: self.device,
            event: event as usize,
            size,
        }
    }
}

/// Per device (in a run's device order), the requests of the replay that failed, by position among
/// its requests; `None` where the replay made another number of requests than the trace records.
type FailedRequests = Vec<Option<Vec<u32>>>;

/// How to run a matrix.
#[derive(Clone, Copy, Default)]
pub struct MatrixOptions<'a> {
    /// The simulated device's memory in bytes, for every run ([`RunOptions::capacity`]); `None`:
    /// what the trace implies, else [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY).
    pub capacity: Option<u64>,
    /// How many runs go at once; `0`: one per available CPU.
    pub threads: usize,
    /// Called after each run with the runs done and the runs in all.
    pub progress: Option<&'a (dyn Fn(usize, usize) + Sync)>,
}

impl std::fmt::Debug for MatrixOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MatrixOptions")
            .field("capacity", &self.capacity)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// A request of the trace, named by where the trace records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailedRequest {
    /// The device.
    pub device: usize,
    /// Its event in the device's trace (an `alloc` or an `oom`).
    pub event: usize,
    /// The bytes asked for.
    pub size: u64,
}

/// One configuration's replay, with what it means for the program.
#[derive(Clone, Debug)]
pub struct MatrixRow {
    /// The configuration and its `--config` string.
    pub point: GridPoint,
    /// Whether this is the recorded configuration (its run is checked against the record, as
    /// [`Replay::run_recorded`] checks it).
    pub recorded: bool,
    /// The replay.
    pub run: ReplayRun,
    /// How many of the four settings differ from the recorded configuration.
    pub changes: usize,
    /// Requests that fail here although the recorded run served them: the program would have run
    /// out of memory. Any disqualifies the row.
    pub new_ooms: u64,
    /// Requests that failed in the recorded run and are served here: the program caught those
    /// errors, and would have gone on differently.
    pub served_ooms: u64,
    /// The first request of [`new_ooms`](Self::new_ooms), when the requests were compared one by
    /// one.
    pub first_new_oom: Option<FailedRequest>,
    /// The first request of [`served_ooms`](Self::served_ooms), when the requests were compared
    /// one by one.
    pub first_served_oom: Option<FailedRequest>,
    /// Whether the failed requests were compared one by one (else by their number on each device:
    /// the replay made another number of requests than the trace records, as it does when it
    /// restores a CUDA graph pool's checkpoint instead of repeating its allocations).
    pub by_request: bool,
}

impl MatrixRow {
    /// A figure of `torch.cuda.memory_stats()` summed over the devices
    /// ([`ReplayRun::total_stats`]), 0 when absent.
    #[must_use]
    pub fn figure(&self, key: &str) -> i64 {
        self.run.total_stats().get(key).copied().unwrap_or(0)
    }

    /// Peak reserved bytes (`reserved_bytes.all.peak`; over several devices, the sum of each
    /// device's peak).
    #[must_use]
    pub fn peak_reserved(&self) -> u64 {
        self.figure("reserved_bytes.all.peak").max(0) as u64
    }

    /// Peak allocated bytes (`allocated_bytes.all.peak`; summed over devices likewise).
    #[must_use]
    pub fn peak_allocated(&self) -> u64 {
        self.figure("allocated_bytes.all.peak").max(0) as u64
    }

    /// Peak reserved over peak allocated bytes; `None` when nothing was allocated.
    #[must_use]
    pub fn ratio(&self) -> Option<f64> {
        let allocated = self.peak_allocated();
        (allocated > 0).then(|| self.peak_reserved() as f64 / allocated as f64)
    }

    /// Whether the program would have run out of memory under this configuration where the
    /// recorded run did not.
    #[must_use]
    pub fn disqualified(&self) -> bool {
        self.new_ooms > 0
    }

    /// Why the row is disqualified, if it is.
    #[must_use]
    pub fn reason(&self) -> Option<String> {
        if !self.disqualified() {
            return None;
        }
        let what = if self.new_ooms == 1 {
            "1 request the recorded run served fails".to_owned()
        } else {
            format!("{} requests the recorded run served fail", self.new_ooms)
        };
        Some(match self.first_new_oom {
            Some(first) => format!(
                "out of memory: {what} (the first: {} bytes at event {} of cuda:{})",
                first.size, first.event, first.device
            ),
            None => format!("out of memory: {what}"),
        })
    }

    /// Whether every request fails or succeeds as in the recorded run, so that the program would
    /// have made the same requests: the row's figures are then those of the program's own run.
    #[must_use]
    pub fn same_path(&self) -> bool {
        self.new_ooms == 0 && self.served_ooms == 0
    }

    /// What the row means for the program's sequence of requests, in a sentence.
    #[must_use]
    pub fn path(&self) -> String {
        let compared = if self.by_request {
            ""
        } else {
            " (compared by count: the replay made another number of requests than the trace)"
        };
        if self.disqualified() {
            return format!(
                "differs: the program gets an out-of-memory error where the recorded run went on; \
                 the rest is replayed as recorded{compared}"
            );
        }
        if self.served_ooms > 0 {
            let first = self
                .first_served_oom
                .map(|r| format!(" (the first: event {} of cuda:{})", r.event, r.device))
                .unwrap_or_default();
            return format!(
                "differs: {} request{} that failed in the recorded run {} served{first}; the \
                 program caught those errors and would have gone on differently, the replay goes \
                 on as recorded{compared}",
                self.served_ooms,
                if self.served_ooms == 1 { "" } else { "s" },
                if self.served_ooms == 1 { "is" } else { "are" },
            );
        }
        format!("as recorded: every request fails or succeeds as in the recorded run{compared}")
    }
}

/// The runs of a matrix, ranked.
#[derive(Clone, Debug)]
pub struct MatrixResult {
    /// Best first: rows that fit the device by peak reserved bytes (ties: the recorded
    /// configuration first, then fewer settings changed), then the disqualified rows by the number
    /// of requests that fail, then peak reserved bytes.
    pub rows: Vec<MatrixRow>,
    /// Combinations of the grid left out because they replay exactly as a row kept
    /// ([`Grid::points`]).
    pub left_out: usize,
    /// The grid's notes: settings not varied, and why.
    pub notes: Vec<String>,
    /// The memory fraction the program set with `torch.cuda.set_per_process_memory_fraction()`, as
    /// the replay infers it from the trace, when the recorded settings do not name one.
    pub program_fraction: Option<f64>,
    /// Wall-clock seconds for all the runs.
    pub seconds: f64,
}

/// The configuration a matrix recommends.
#[derive(Clone, Debug, PartialEq)]
pub struct Recommendation {
    /// The `PYTORCH_CUDA_ALLOC_CONF` value that gives it (the configuration's canonical string,
    /// without a memory fraction the program sets itself: see
    /// [`program_fraction`](Self::program_fraction)); empty for PyTorch's defaults.
    pub env: String,
    /// The `--config` string of its row ([`GridPoint::what_if`]).
    pub what_if: String,
    /// The configuration, as replayed.
    pub config: AllocatorConfig,
    /// The memory fraction the program sets through `torch.cuda.set_per_process_memory_fraction()`
    /// (inferred from the trace), which the replay applied beside [`env`](Self::env).
    pub program_fraction: Option<f64>,
    /// Its peak reserved bytes.
    pub peak_reserved: u64,
    /// Whether it is the recorded configuration.
    pub recorded: bool,
}

impl MatrixResult {
    /// The recorded configuration's row.
    ///
    /// # Panics
    /// Never for a result [`SettingsMatrix::run`] made: it always runs the recorded
    /// configuration.
    #[must_use]
    pub fn recorded(&self) -> &MatrixRow {
        self.rows
            .iter()
            .find(|r| r.recorded)
            .expect("a matrix always runs the recorded configuration")
    }

    /// The best row that fits the device; `None` when every configuration runs out of memory
    /// where the recorded run did not.
    #[must_use]
    pub fn best(&self) -> Option<&MatrixRow> {
        self.rows.first().filter(|r| !r.disqualified())
    }

    /// The best row as a `PYTORCH_CUDA_ALLOC_CONF` value.
    #[must_use]
    pub fn recommendation(&self) -> Option<Recommendation> {
        let best = self.best()?;
        let mut env = best.point.config.clone();
        if self.program_fraction.is_some() {
            env.per_process_memory_fraction = 1.0;
        }
        Some(Recommendation {
            env: env.to_string(),
            what_if: best.point.what_if.clone(),
            config: best.point.config.clone(),
            program_fraction: self.program_fraction,
            peak_reserved: best.peak_reserved(),
            recorded: best.recorded,
        })
    }

    /// `row`'s peak reserved bytes minus the recorded configuration's.
    #[must_use]
    pub fn delta_reserved(&self, row: &MatrixRow) -> i64 {
        row.peak_reserved() as i64 - self.recorded().peak_reserved() as i64
    }
}

impl<'r> SettingsMatrix<'r> {
    /// Prepares `replay` (made from `snapshot`) for a matrix: reads the trace's requests (the
    /// sizes the grid's `max_split_size_mb` values come from, and which requests failed).
    #[must_use]
    pub fn new(replay: &'r Replay, snapshot: &Snapshot) -> SettingsMatrix<'r> {
        let requests: Vec<DeviceRequests> = snapshot
            .traces()
            .filter(|(_, trace)| !trace.is_empty())
            .map(|(device, trace)| DeviceRequests::read(device, trace))
            .collect();
        let largest_request = requests
            .iter()
            .flat_map(|d| d.requests.iter().map(|&(_, size)| size))
            .max()
            .unwrap_or(0);
        SettingsMatrix {
            replay,
            largest_request,
            requests,
        }
    }

    /// The grid that varies `settings` over their values for this trace (see [`Setting`]); the
    /// others keep their recorded values.
    #[must_use]
    pub fn grid(&self, settings: &[Setting]) -> Grid {
        Grid::for_trace(
            self.replay.recorded_config(),
            self.largest_request,
            settings,
        )
    }

    /// The largest request of the trace, in bytes.
    #[must_use]
    pub fn largest_request(&self) -> u64 {
        self.largest_request
    }

    /// Replays every configuration of `grid` (in parallel: each run has its own allocators and
    /// simulated devices) and ranks them.
    ///
    /// # Errors
    /// The first run's error, as [`Replay::run`].
    pub fn run(&self, grid: &Grid, options: &MatrixOptions<'_>) -> Result<MatrixResult> {
        let started = Instant::now();
        let (points, left_out) = grid.points();
        let runs = self.run_points(&points, options)?;
        let recorded_config = self.replay.recorded_config();
        let mut rows: Vec<MatrixRow> = points
            .into_iter()
            .zip(runs)
            .enumerate()
            .map(|(index, (point, (run, failed)))| {
                let changes = changes(&point.config, recorded_config);
                let mut row = MatrixRow {
                    point,
                    recorded: index == 0,
                    run,
                    changes,
                    new_ooms: 0,
                    served_ooms: 0,
                    first_new_oom: None,
                    first_served_oom: None,
                    by_request: true,
                };
                self.compare_failures(&mut row, &failed);
                row
            })
            .collect();
        rows.sort_by(rank);
        let program_fraction = self
            .replay
            .devices()
            .into_iter()
            .filter_map(|d| self.replay.capacity_inference(d))
            .any(|c| c.fraction_implied)
            .then_some(recorded_config.per_process_memory_fraction);
        Ok(MatrixResult {
            rows,
            left_out,
            notes: grid.notes.clone(),
            program_fraction,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Runs `points` on up to `options.threads` threads; per point its run and, per device, the
    /// replay's requests that failed (`None`: the replay made another number of requests than the
    /// trace).
    fn run_points(
        &self,
        points: &[GridPoint],
        options: &MatrixOptions<'_>,
    ) -> Result<Vec<(ReplayRun, FailedRequests)>> {
        type Slot = Option<Result<(ReplayRun, FailedRequests)>>;
        let total = points.len();
        let threads = match options.threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        }
        .clamp(1, total.max(1));
        let next = AtomicUsize::new(0);
        let done = AtomicUsize::new(0);
        let slots: Mutex<Vec<Slot>> = Mutex::new((0..total).map(|_| None).collect());
        let work = || loop {
            let index = next.fetch_add(1, Relaxed);
            if index >= total {
                break;
            }
            let result = self.run_point(&points[index], index == 0, options.capacity);
            let failed = result.is_err();
            slots.lock()[index] = Some(result);
            let finished = done.fetch_add(1, Relaxed) + 1;
            if let Some(progress) = options.progress {
                progress(finished, total);
            }
            if failed {
                // No point in the rest: the first error is returned.
                next.store(total, Relaxed);
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(work);
            }
            work();
        });
        let mut runs = Vec::with_capacity(total);
        for slot in slots.into_inner() {
            match slot {
                Some(result) => runs.push(result?),
                // Left undone after another run failed; that error comes first.
                None => continue,
            }
        }
        Ok(runs)
    }

    /// One configuration's run (checked against the record when `recorded`), with each device's
    /// failed requests read from the replaying allocator's own trace, which is then dropped.
    fn run_point(
        &self,
        point: &GridPoint,
        recorded: bool,
        capacity: Option<u64>,
    ) -> Result<(ReplayRun, FailedRequests)> {
        let mut options = RunOptions::new(point.config.clone());
        options.check = recorded;
        options.capacity = capacity;
        options.timeline_points = 1;
        options.record_history = true;
        options.snapshot = true;
        let mut run = self.replay.run(&options)?;
        let failed = run
            .devices
            .iter_mut()
            .map(|device| {
                let history = device.snapshot.take()?;
                let replayed = DeviceRequests::read(device.device, history.trace(0));
                let traced = self.requests.iter().find(|r| r.device == device.device)?;
                (replayed.requests.len() == traced.requests.len()).then_some(replayed.failed)
            })
            .collect();
        Ok((run, failed))
    }

    /// Fills `row`'s comparison of its failed requests with the trace's: `failed` per device
    /// (in the run's device order), `None` where only the numbers can be compared.
    fn compare_failures(&self, row: &mut MatrixRow, failed: &[Option<Vec<u32>>]) {
        for (device, failed) in row.run.devices.iter().zip(failed) {
            let Some(traced) = self.requests.iter().find(|r| r.device == device.device) else {
                continue;
            };
            let Some(failed) = failed else {
                row.by_request = false;
                let recorded = traced.failed.len() as u64;
                row.new_ooms += device.refused.saturating_sub(recorded);
                row.served_ooms += recorded.saturating_sub(device.refused);
                continue;
            };
            // Both lists are ascending.
            let (new, served) = differences(failed, &traced.failed);
            row.new_ooms += new.len() as u64;
            row.served_ooms += served.len() as u64;
            if row.first_new_oom.is_none() {
                row.first_new_oom = new.first().map(|&i| traced.request(i));
            }
            if row.first_served_oom.is_none() {
                row.first_served_oom = served.first().map(|&i| traced.request(i));
            }
        }
    }
}

/// The entries of ascending `a` missing from ascending `b`, and those of `b` missing from `a`.
fn differences(a: &[u32], b: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => (i, j) = (i + 1, j + 1),
            (Some(x), Some(y)) if x < y => {
                only_a.push(*x);
                i += 1;
            }
            (Some(x), None) => {
                only_a.push(*x);
                i += 1;
            }
            (_, Some(y)) => {
                only_b.push(*y);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (only_a, only_b)
}

/// How many of the matrix's four settings differ between `config` and `recorded`.
fn changes(config: &AllocatorConfig, recorded: &AllocatorConfig) -> usize {
    [
        config.expandable_segments != recorded.expandable_segments,
        config.max_split_size != recorded.max_split_size,
        config.roundup_power2_divisions != recorded.roundup_power2_divisions,
        config.garbage_collection_threshold != recorded.garbage_collection_threshold,
    ]
    .into_iter()
    .filter(|&changed| changed)
    .count()
}

/// The ranking of [`MatrixResult::rows`].
fn rank(a: &MatrixRow, b: &MatrixRow) -> Ordering {
    let failing = |r: &MatrixRow| r.disqualified().then_some(r.new_ooms);
    failing(a)
        .cmp(&failing(b))
        .then(a.peak_reserved().cmp(&b.peak_reserved()))
        .then(b.recorded.cmp(&a.recorded))
        .then(a.changes.cmp(&b.changes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_split_both_ways() {
        assert_eq!(differences(&[1, 3, 5], &[3, 4]), (vec![1, 5], vec![4]));
        assert_eq!(differences(&[], &[2]), (vec![], vec![2]));
        assert_eq!(differences(&[7], &[7]), (vec![], vec![]));
    }

    #[test]
    fn changes_count_the_four_settings_only() {
        let recorded = AllocatorConfig::parse("per_process_memory_fraction:0.5").unwrap();
        let mut config = recorded.clone();
        config.expandable_segments = true;
        config.garbage_collection_threshold = 0.6;
        config.release_lock_on_cudamalloc = true;
        assert_eq!(changes(&config, &recorded), 2);
    }
}
