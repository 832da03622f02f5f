//! Allocator settings a program changed while it ran.
//!
//! `torch.cuda.memory._set_allocator_settings(...)` (or `torch._C._accelerator_setAllocatorSettings`)
//! called mid-run changes the rounding, splitting, garbage collection or expandable segments from
//! then on. The trace records no such call, and the snapshot's `allocator_settings` are the last
//! ones. A replay under them departs from the record at the first decision the earlier settings
//! made differently; the decisions before that point, and those the earlier settings cannot make,
//! tell which settings were in force and where they changed:
//!
//! 1. the earlier settings are searched for from the recorded ones, one setting at a time
//!    ([`candidates`]), keeping the change that explains the trace furthest (the replay under it
//!    departs from the record latest), until one explains it to the end or none explains more;
//! 2. the program changed to the recorded settings between the first event the recorded settings
//!    cannot explain and the first the earlier ones cannot: the point is searched for by halving
//!    that interval (a replay that departs before the switch switched too late, one that departs
//!    after it too early);
//! 3. when a replay with the switch matches the record, the trace is replayed that way
//!    ([`SettingsInference::phases`]); otherwise the first departure is reported with what the
//!    search found ([`SettingsInference::explained_until`]).

use tensormem_cuda_alloc::config::AllocatorConfig;

/// A stretch of the trace under one set of allocator settings (see
/// [`SettingsInference::phases`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SettingsPhase {
    /// The trace event from which the replay applies these settings (`0` for the first phase).
    pub from_event: usize,
    /// The settings in force (the recorded configuration with the settings of this phase).
    pub config: AllocatorConfig,
}

/// What the replay found about settings changed while the program ran, for one device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SettingsInference {
    /// The first trace event at which the replay under the recorded settings departs from the
    /// record (`None`: they explain every allocation).
    pub first_departure: Option<usize>,
    /// The settings in force over the trace, when a change explains it: the earlier settings from
    /// event 0, the recorded ones from the event the program changed them (between the first
    /// departure and that event, no recorded decision tells the two apart). Empty when the
    /// recorded settings explain the trace or no change found does.
    pub phases: Vec<SettingsPhase>,
    /// The events at which the program may have switched to the recorded settings (first, last):
    /// no recorded allocation tells them apart; the phases switch at the first, or where the
    /// statistics PyTorch reported agree too when they were given
    /// ([`Replay::with_expected_stats`](crate::Replay::with_expected_stats)).
    pub switch_window: Option<(usize, usize)>,
    /// The settings that explain the trace furthest from its start, when they differ from the
    /// recorded ones, and the first event they do not explain (`None`: the end).
    pub explained_until: Option<(AllocatorConfig, Option<usize>)>,
    /// Other settings that explain the trace from its start as far as the first phase's (no
    /// recorded allocation tells them apart); the statistics, when given, may
    /// ([`Replay::with_expected_stats`](crate::Replay::with_expected_stats)).
    pub alternatives: Vec<AllocatorConfig>,
    /// Replays the search ran.
    pub replays: usize,
    /// Whether the search stopped at its budget of replays (a long trace) before it had tried every
    /// candidate.
    pub exhausted: bool,
}

/// The most rounds of the search, each changing one setting.
pub(crate) const MAX_ROUNDS: usize = 4;

/// Events the search may replay in all (about a minute at the replay's speed on one core): a trace
/// of `events` events gets this many divided by its length replays, between 16 and
/// [`MAX_ROUNDS`] rounds of every candidate.
const SEARCH_EVENTS: usize = 100_000_000;

/// The most replays the search of settings for a trace of `events` events runs (see
/// [`SEARCH_EVENTS`]).
pub(crate) fn search_budget(events: usize) -> usize {
    (SEARCH_EVENTS / events.max(1)).clamp(16, MAX_ROUNDS * 40)
}

/// The most replays the search for settings changed more than once may add for a trace of `events`
/// events (see [`SEARCH_EVENTS`]): every candidate of each stretch needs a few to place its switch.
pub(crate) fn forward_budget(events: usize) -> usize {
    (SEARCH_EVENTS / events.max(1)).clamp(16, 4000)
}

/// `max_split_size_mb` values tried (`None`: unlimited).
const SPLIT_MB: [Option<usize>; 11] = [
    None,
    Some(20),
    Some(32),
    Some(40),
    Some(64),
    Some(100),
    Some(128),
    Some(200),
    Some(256),
    Some(512),
    Some(1024),
];

/// `roundup_power2_divisions` values tried (0: off, PyTorch's default; 1 rounds as 0 does, and is
/// tried after it so that the default is reported when either fits).
const DIVISIONS: [usize; 8] = [0, 1, 2, 4, 8, 16, 32, 64];

/// `garbage_collection_threshold` values tried (0: off); they act only under a memory fraction.
pub(crate) const THRESHOLDS: [f64; 7] = [0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95];

/// The settings one change away from `from`: each of `max_split_size_mb`,
/// `roundup_power2_divisions`, `garbage_collection_threshold` (only when `collects`: a memory
/// fraction is in force) and `expandable_segments` set to another of the values PyTorch programs
/// use; never `from` itself.
pub(crate) fn candidates(from: &AllocatorConfig, collects: bool) -> Vec<AllocatorConfig> {
    let parsed = |text: String| AllocatorConfig::parse(&text).ok();
    let mut out = Vec::new();
    for mb in SPLIT_MB {
        let Some(c) = parsed(mb.map_or_else(String::new, |m| format!("max_split_size_mb:{m}")))
        else {
            continue;
        };
        let mut next = from.clone();
        next.max_split_size = c.max_split_size;
        out.push(next);
    }
    for divisions in DIVISIONS {
        let c = if divisions == 0 {
            AllocatorConfig::default()
        } else {
            let Some(c) = parsed(format!("roundup_power2_divisions:{divisions}")) else {
                continue;
            };
            c
        };
        let mut next = from.clone();
        next.roundup_power2_divisions = c.roundup_power2_divisions;
        out.push(next);
    }
    if collects {
        for threshold in THRESHOLDS {
            let mut next = from.clone();
            next.garbage_collection_threshold = threshold;
            out.push(next);
        }
    }
    let mut toggled = from.clone();
    toggled.expandable_segments = !from.expandable_segments;
    out.push(toggled);
    out.retain(|c| !same_settings(c, from));
    out
}

/// Whether `a` and `b` have the same settings a program can change while it runs (the memory
/// fraction aside).
pub(crate) fn same_settings(a: &AllocatorConfig, b: &AllocatorConfig) -> bool {
    a.max_split_size == b.max_split_size
        && a.roundup_power2_divisions == b.roundup_power2_divisions
        && a.garbage_collection_threshold.to_bits() == b.garbage_collection_threshold.to_bits()
        && a.expandable_segments == b.expandable_segments
}

impl SettingsInference {
    /// The settings phases for a run under `config`: [`phases`](Self::phases) when `config` has
    /// the recorded settings (`recorded`), none when the run names settings of its own.
    pub(crate) fn phases_for(
        &self,
        config: &AllocatorConfig,
        recorded: &AllocatorConfig,
    ) -> &[SettingsPhase] {
        if same_settings(config, recorded) {
            &self.phases
        } else {
            &[]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_change_one_setting_and_never_repeat_the_start() {
        let from = AllocatorConfig::parse("max_split_size_mb:64").unwrap();
        let all = candidates(&from, false);
        assert!(all.iter().all(|c| !same_settings(c, &from)));
        // Every candidate differs from the start in exactly one setting.
        for c in &all {
            let changed = [
                c.max_split_size != from.max_split_size,
                c.roundup_power2_divisions != from.roundup_power2_divisions,
                c.garbage_collection_threshold != from.garbage_collection_threshold,
                c.expandable_segments != from.expandable_segments,
            ];
            assert_eq!(changed.iter().filter(|&&x| x).count(), 1, "{c}");
        }
        assert!(all
            .iter()
            .any(|c| c.max_split_size == AllocatorConfig::default().max_split_size));
        assert!(!all.iter().any(|c| c.garbage_collection_threshold > 0.0));
        assert!(candidates(&from, true)
            .iter()
            .any(|c| c.garbage_collection_threshold == 0.6));
    }
}
