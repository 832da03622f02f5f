//! Settings the program changed while it ran, searched for on one prepared device (see
//! [`crate::settings_phases`]): which settings were in force from the start, where they changed
//! (once or several times), and where within the window no allocation tells apart the statistics
//! put each switch.

use tensormem_cuda_alloc::config::AllocatorConfig;

use super::PreparedDevice;
use crate::capacity;
use crate::check::ExpectedStats;
use crate::settings_phases::{self, SettingsInference, SettingsPhase};

/// The most stretches of settings [`PreparedDevice::phases_forward`] looks for (the settings changed
/// this many times less one).
const MAX_STRETCHES: usize = 6;

/// The most other earlier settings [`PreparedDevice::settle_switch`] tries on the statistics.
const MAX_ALTERNATIVES: usize = 8;

/// The most points before the first event the earlier settings cannot explain that
/// [`PreparedDevice::switch_window`] tries one by one when halving finds none.
const MAX_SCAN_BEFORE_UNTIL: usize = 64;

/// The most switch points [`PreparedDevice::settle_switch`] tries, one replay each.
const MAX_SWITCH_TRIALS: usize = 64;

/// The figures that move one way as a switch of settings moves, by which
/// [`PreparedDevice::settle_switch`] halves: the bytes allocated (every allocation between two
/// points is rounded under the one or the other settings), then the retries (garbage collection
/// in force longer releases cached blocks before a request would fail and retry).
const SWITCH_FIGURES: [&str; 2] = ["allocated_bytes.all.allocated", "num_alloc_retries"];

/// How a replay with the settings switched at one event compares with the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    /// It agrees.
    Fits,
    /// It departs before the switch: the switch came earlier.
    TooLate,
    /// It departs after: the switch came later.
    TooEarly,
    /// It fails otherwise.
    Fails,
}

/// The settings of `before` (phases from event 0), then `to` from event `at`.
fn switched(before: &[SettingsPhase], to: &AllocatorConfig, at: usize) -> Vec<SettingsPhase> {
    let mut phases = before.to_vec();
    phases.push(SettingsPhase {
        from_event: at,
        config: to.clone(),
    });
    phases
}

/// `earlier` from event 0 alone.
fn from_start(earlier: &AllocatorConfig) -> [SettingsPhase; 1] {
    [SettingsPhase {
        from_event: 0,
        config: earlier.clone(),
    }]
}

impl PreparedDevice {
    /// Whether garbage collection can act in this trace's replays (a memory fraction is in force):
    /// only then are its thresholds among the candidates.
    fn collects(&self) -> bool {
        self.recorded.per_process_memory_fraction < 1.0 || !self.capacity.phases.is_empty()
    }

    /// Searches for settings the program changed while it ran (see [`crate::settings_phases`]),
    /// when the replay under the recorded settings departs from the record.
    pub(super) fn infer_settings(&self) -> SettingsInference {
        let recorded = &self.recorded;
        let mut found = SettingsInference::default();
        let Some((first, _)) = self.explains(&[]) else {
            return found;
        };
        found.replays += 1;
        let Some(first) = first else {
            return found;
        };
        found.first_departure = Some(first);
        let reach = |departure: Option<usize>| departure.unwrap_or(usize::MAX);
        let collects = self.collects();
        let budget = settings_phases::search_budget(self.plan.events);
        let mut best = (recorded.clone(), first);
        // Other settings of the last round that explain more of the trace than the recorded ones.
        let mut ties: Vec<(AllocatorConfig, usize)> = Vec::new();
        for _ in 0..settings_phases::MAX_ROUNDS {
            let mut improved: Option<(AllocatorConfig, usize)> = None;
            let mut round_ties = Vec::new();
            for candidate in settings_phases::candidates(&best.0, collects) {
                if settings_phases::same_settings(&candidate, recorded) {
                    continue;
                }
                if found.replays >= budget {
                    found.exhausted = true;
                    break;
                }
                let Some((departure, _)) = self.explains(&from_start(&candidate)) else {
                    continue;
                };
                found.replays += 1;
                let reached = reach(departure);
                let furthest = improved.as_ref().map_or(best.1, |b| b.1);
                if reached > furthest {
                    if let Some(passed) = improved.replace((candidate, reached)) {
                        round_ties.push(passed);
                    }
                } else if reached > first {
                    round_ties.push((candidate, reached));
                }
            }
            match improved {
                Some(better) => {
                    best = better;
                    ties = round_ties;
                }
                None => break,
            }
            if best.1 == usize::MAX {
                break;
            }
        }
        if settings_phases::same_settings(&best.0, recorded) {
            // Nothing explains more from the start than the recorded settings: they were in force
            // first, and changed and changed back?
            self.forward(recorded, first, &mut found);
            return found;
        }
        let (earlier, until) = best;
        found.explained_until = Some((earlier.clone(), (until != usize::MAX).then_some(until)));
        ties.sort_by_key(|(_, reached)| std::cmp::Reverse(*reached));
        ties.truncate(MAX_ALTERNATIVES);
        found.alternatives = ties.into_iter().map(|(config, _)| config).collect();
        let before = from_start(&earlier);
        let Some((earliest, latest)) = self.switch_window(&earlier, first, until, &mut found)
        else {
            // No single switch to the recorded settings explains it: changed more than once?
            self.forward(&earlier, until, &mut found);
            return found;
        };
        tracing::info!(
            device = self.plan.device,
            from = earliest,
            to = latest,
            earlier = %earlier,
            "the allocator settings changed while the program ran"
        );
        found.switch_window = Some((earliest, latest));
        found.phases = switched(&before, recorded, earliest);
        found
    }

    /// Where the program may have switched from `earlier` to the recorded settings: after the
    /// first event the recorded settings cannot explain (`first`) and no later than the first the
    /// earlier ones cannot (`until`). Any point that fits, found by halving, then the earliest and
    /// the latest that fit (no allocation between them tells them apart); `None` when none fits.
    fn switch_window(
        &self,
        earlier: &AllocatorConfig,
        first: usize,
        until: usize,
        found: &mut SettingsInference,
    ) -> Option<(usize, usize)> {
        let before = from_start(earlier);
        let (mut lo, mut hi) = (first + 1, until.min(self.plan.events));
        while lo <= hi {
            let at = lo + (hi - lo) / 2;
            found.replays += 1;
            match self.switch_at(&before, &self.recorded, at) {
                Switch::Fits => {
                    let phases = switched(&before, &self.recorded, at);
                    return Some(self.fit_window(
                        &phases,
                        1,
                        (first + 1, until),
                        &mut found.replays,
                    ));
                }
                Switch::TooLate => hi = at.checked_sub(1)?,
                Switch::TooEarly => lo = at + 1,
                Switch::Fails => return None,
            }
        }
        // A switch a little past the true one can still look too early: an allocation made
        // under the wrong settings in between may land where the record has it and depart only
        // later. The points just before `until` are tried one by one.
        let fits = ((first + 1)..=until.min(self.plan.events))
            .rev()
            .take(MAX_SCAN_BEFORE_UNTIL)
            .find(|&at| {
                found.replays += 1;
                self.switch_at(&before, &self.recorded, at) == Switch::Fits
            })?;
        let phases = switched(&before, &self.recorded, fits);
        Some(self.fit_window(&phases, 1, (first + 1, until), &mut found.replays))
    }

    /// The earliest and the latest event switch `k` of `phases` may come at with every decision
    /// still the record's, within `(lo, hi)`, the other switches where they are; switch `k`'s
    /// event fits. By halving on each side of it (no allocation between the two tells them
    /// apart); the replays are counted in `replays`.
    fn fit_window(
        &self,
        phases: &[SettingsPhase],
        k: usize,
        (lo, hi): (usize, usize),
        replays: &mut usize,
    ) -> (usize, usize) {
        let mut fits = |at: usize| {
            *replays += 1;
            let mut trial = phases.to_vec();
            trial[k].from_event = at;
            matches!(self.explains(&trial), Some((None, true)))
        };
        let at = phases[k].from_event;
        let (mut low, mut high) = (lo.min(at), at);
        while low < high {
            let mid = low + (high - low) / 2;
            if fits(mid) {
                high = mid;
            } else {
                low = mid + 1;
            }
        }
        let earliest = low;
        let (mut low, mut high) = (at, hi.min(self.plan.events).max(at));
        while low < high {
            let mid = low + (high - low).div_ceil(2);
            if fits(mid) {
                low = mid;
            } else {
                high = mid - 1;
            }
        }
        (earliest, low)
    }

    /// [`phases_forward`](Self::phases_forward), its answer kept in `found`.
    fn forward(&self, earlier: &AllocatorConfig, until: usize, found: &mut SettingsInference) {
        if let Some(phases) = self.phases_forward(earlier, until, found) {
            tracing::info!(
                device = self.plan.device,
                stretches = phases.len(),
                "the allocator settings changed more than once while the program ran"
            );
            found.phases = phases;
        }
    }

    /// The settings in force over a trace in which the program changed them more than once: from
    /// `earlier` (which explains it until event `until`), each next stretch starts at the first
    /// event the last one's settings cannot explain, under whichever of the recorded settings and
    /// those one change away from the last stretch's or the recorded ones explains the trace
    /// furthest (the recorded ones first). A switch at that event always fits what came before:
    /// every decision up to it was the record's. `None` when no sequence of at most
    /// [`MAX_STRETCHES`] stretches explains the trace to its end, or the replay budget ran out.
    fn phases_forward(
        &self,
        earlier: &AllocatorConfig,
        until: usize,
        found: &mut SettingsInference,
    ) -> Option<Vec<SettingsPhase>> {
        let recorded = &self.recorded;
        let collects = self.collects();
        let budget = found.replays + settings_phases::forward_budget(self.plan.events);
        let mut phases = from_start(earlier).to_vec();
        // The earliest event the next switch may come at, and the first event the settings so
        // far cannot explain.
        let (mut after, mut reached) = (found.first_departure.unwrap_or(0) + 1, until);
        while phases.len() < MAX_STRETCHES && reached < self.plan.events {
            let last = phases.last().map(|p| p.config.clone())?;
            let mut tried: Vec<AllocatorConfig> = Vec::new();
            // (settings, switch, first event not explained)
            let mut best: Option<(AllocatorConfig, usize, usize)> = None;
            let choices = std::iter::once(recorded.clone())
                .chain(settings_phases::candidates(&last, collects))
                .chain(settings_phases::candidates(recorded, collects));
            for candidate in choices {
                if settings_phases::same_settings(&candidate, &last)
                    || tried
                        .iter()
                        .any(|t| settings_phases::same_settings(t, &candidate))
                {
                    continue;
                }
                tried.push(candidate.clone());
                // The switch by halving: a replay that departs before it switched too late; one
                // that departs after it may have switched too early, or departs where the
                // settings changed again: the furthest reach seen is kept.
                let (mut lo, mut hi) = (after.min(reached), reached);
                while lo <= hi {
                    if found.replays >= budget {
                        found.exhausted = true;
                        return None;
                    }
                    let at = lo + (hi - lo) / 2;
                    let mut trial = phases.clone();
                    trial.push(SettingsPhase {
                        from_event: at,
                        config: candidate.clone(),
                    });
                    found.replays += 1;
                    let Some((departure, matched)) = self.explains(&trial) else {
                        break;
                    };
                    if departure.is_none() && matched {
                        let k = trial.len() - 1;
                        let window =
                            self.fit_window(&trial, k, (after, reached), &mut found.replays);
                        found.switch_window = Some(window);
                        trial[k].from_event = window.0;
                        return Some(trial);
                    }
                    let reach = departure.unwrap_or(usize::MAX);
                    if reach > best.as_ref().map_or(reached, |b| b.2) {
                        best = Some((candidate.clone(), at, reach));
                    }
                    match departure {
                        Some(d) if d < at => hi = at - 1,
                        _ => lo = at + 1,
                    }
                }
            }
            let (config, at, reach) = best?;
            phases.push(SettingsPhase {
                from_event: at,
                config,
            });
            (after, reached) = (reached + 1, reach);
        }
        None
    }

    /// Whether the plan replayed under the phases `before` until event `at`, the settings `to` from
    /// there, agrees with the record.
    fn switch_at(&self, before: &[SettingsPhase], to: &AllocatorConfig, at: usize) -> Switch {
        let phases = switched(before, to, at);
        match self.explains(&phases) {
            None => Switch::Fails,
            Some((None, true)) => Switch::Fits,
            Some((None, false)) => Switch::Fails,
            // Departed before the switch: the recorded settings were in force earlier.
            Some((Some(d), _)) if d < at => Switch::TooLate,
            Some(_) => Switch::TooEarly,
        }
    }

    /// Within the window of switch points no allocation tells apart, the one at which the
    /// statistics PyTorch reported (`expected`) agree too: some count each block against the
    /// settings in force when it was allocated (its rounded size) or freed (the oversize counts).
    /// The bytes allocated over the run (or, where those agree, the retries) move one way as a
    /// switch moves ([`SWITCH_FIGURES`]), so each switch is searched for by halving on them: the switches between earlier stretches first (each within the points
    /// that keep every decision), then the last one, whose points around the halving's answer are
    /// tried too. At most [`MAX_SWITCH_TRIALS`] replays a switch (fewer for a long trace).
    pub(crate) fn settle_switch(&mut self, expected: &ExpectedStats) {
        if self.settings.first_departure.is_none() {
            self.split_changed_unseen(expected);
            if self.settings.phases.is_empty() && self.collection_changed_unseen(expected) {
                return;
            }
        }
        let Some(last_window) = self.settings.switch_window else {
            return;
        };
        let mut phases = self.settings.phases.clone();
        let last = phases.len().saturating_sub(1);
        if last == 0 {
            return;
        }
        // `max_split_size` is the one the allocator was made with (PyTorch reads it once): the
        // first settings had it, whatever the allocations could tell.
        if let Some(&figure) = expected.figures.get("max_split_size") {
            phases[0].config.max_split_size =
                usize::try_from(figure).unwrap_or(AllocatorConfig::default().max_split_size);
        }
        // Fewer for a long trace (each trial is a whole replay).
        let most = MAX_SWITCH_TRIALS.min(settings_phases::search_budget(self.plan.events));
        for k in 1..=last {
            let window = if k == last {
                last_window
            } else {
                let bounds = (phases[k - 1].from_event + 1, phases[k + 1].from_event);
                self.fit_window(&phases, k, bounds, &mut 0)
            };
            if self.settle_one(&mut phases, k, window, expected, most) {
                self.settings.phases = phases;
                return;
            }
        }
        // Settings that explain the trace nearly as far from its start: the statistics may say
        // which were in force (the allocations could not), when the program switched once.
        let (Some(first), 1) = (self.settings.first_departure, last) else {
            return;
        };
        let mut scratch = SettingsInference::default();
        for alternative in self.settings.alternatives.clone() {
            let mut earlier = alternative;
            earlier.max_split_size = phases[0].config.max_split_size;
            let Some((departure, _)) = self.explains(&from_start(&earlier)) else {
                continue;
            };
            let until = departure.unwrap_or(usize::MAX);
            let Some(window) = self.switch_window(&earlier, first, until, &mut scratch) else {
                continue;
            };
            let mut phases = switched(&from_start(&earlier), &self.recorded, window.0);
            if self.settle_one(&mut phases, 1, window, expected, most) {
                tracing::info!(
                    device = self.plan.device,
                    earlier = %earlier,
                    "the statistics tell which earlier settings were in force"
                );
                self.settings.phases = phases;
                self.settings.switch_window = Some(window);
                return;
            }
        }
    }

    /// Moves switch `k` of `phases` within `(from, to)` to where the bytes allocated over the run
    /// agree with `expected`, at most `most` replays: `true` when a point makes everything agree
    /// (`phases` then hold it). Otherwise switch `k` is left where the figure changes sides (or
    /// where it was).
    fn settle_one(
        &self,
        phases: &mut [SettingsPhase],
        k: usize,
        (from, to): (usize, usize),
        expected: &ExpectedStats,
        most: usize,
    ) -> bool {
        let trials = std::cell::Cell::new(0);
        // `None`: everything agrees with the switch at `at` (kept); else how far the bytes are off.
        let settle = |phases: &mut [SettingsPhase], at: usize| -> Option<Option<i64>> {
            trials.set(trials.get() + 1);
            let before = phases[k].from_event;
            phases[k].from_event = at;
            match self.stats_of(phases, expected) {
                Some((true, _)) => None,
                found => {
                    phases[k].from_event = before;
                    Some(found.map(|(_, off)| off))
                }
            }
        };
        let (Some(off_from), Some(off_to)) = (settle(phases, from), settle(phases, to)) else {
            return true;
        };
        let mut start = from;
        if let (Some(a), Some(b)) = (off_from, off_to) {
            if a.signum() * b.signum() < 0 {
                // The first point whose figure is no longer on the side of `from`'s.
                let (mut lo, mut hi) = (from, to);
                while lo < hi && trials.get() < most / 2 {
                    let mid = lo + (hi - lo) / 2;
                    match settle(phases, mid) {
                        None => return true,
                        Some(Some(off)) if off.signum() == a.signum() => lo = mid + 1,
                        Some(_) => hi = mid,
                    }
                }
                start = lo;
                phases[k].from_event = lo;
            }
        }
        if k + 1 < phases.len() {
            // A switch between earlier stretches: the later ones settle with it where it is.
            return false;
        }
        let left = most.saturating_sub(trials.get()).max(1);
        let step = (to.saturating_sub(start)) / left + 1;
        for at in (start..=to).step_by(step) {
            if settle(phases, at).is_none() {
                return true;
            }
        }
        false
    }

    /// A program made with another `max_split_size_mb` than the recorded one, which it changed at a
    /// point no allocation tells (no block was as large as either limit): the `max_split_size`
    /// figure, which PyTorch keeps from the allocator's creation, says so. The switch may be
    /// anywhere in the trace; [`settle_switch`](Self::settle_switch) settles it on the statistics
    /// (the oversize counts follow the limit in force).
    fn split_changed_unseen(&mut self, expected: &ExpectedStats) {
        let Some(&figure) = expected.figures.get("max_split_size") else {
            return;
        };
        let made_with =
            usize::try_from(figure).unwrap_or(AllocatorConfig::default().max_split_size);
        if made_with == self.recorded.max_split_size {
            return;
        }
        let mut earlier = self.recorded.clone();
        earlier.max_split_size = made_with;
        tracing::info!(
            device = self.plan.device,
            earlier = %earlier,
            "the allocator was made with another max_split_size_mb than the snapshot records"
        );
        self.settings.switch_window = Some((0, self.plan.events));
        self.settings.phases = switched(&from_start(&earlier), &self.recorded, 0);
    }

    /// A program that turned garbage collection on, off or to another threshold where no
    /// allocation tells (every block lands where the recorded settings put it): the retries and
    /// synchronizations say so. Each other threshold is tried as the earlier one, its switch to
    /// the recorded settings settled on the statistics; the first that makes everything agree is
    /// kept. Whether one did.
    fn collection_changed_unseen(&mut self, expected: &ExpectedStats) -> bool {
        if !self.collects() || matches!(self.stats_of(&[], expected), None | Some((true, _))) {
            return false;
        }
        let events = self.plan.events;
        let most = MAX_SWITCH_TRIALS.min(settings_phases::search_budget(events));
        for threshold in settings_phases::THRESHOLDS {
            if threshold == self.recorded.garbage_collection_threshold {
                continue;
            }
            let mut earlier = self.recorded.clone();
            earlier.garbage_collection_threshold = threshold;
            let mut phases = switched(&from_start(&earlier), &self.recorded, 0);
            if self.settle_one(&mut phases, 1, (0, events), expected, most) {
                tracing::info!(
                    device = self.plan.device,
                    earlier = %earlier,
                    "the statistics tell garbage collection changed while the program ran"
                );
                self.settings.switch_window = Some((0, events));
                self.settings.phases = phases;
                return true;
            }
        }
        false
    }

    /// Under garbage collection with a memory fraction the trace implies, where the replay still
    /// departs from the statistics: the bytes allowed are known only within an interval (the
    /// replay takes its upper end), and the collector acts at its threshold's share of them, so
    /// values down the interval, a 2 MiB step apart (segments' granularity), and its lower end
    /// are tried (with the last switch of settings settled again under each); the first that
    /// makes everything agree is kept.
    pub(crate) fn settle_allowed(&mut self, expected: &ExpectedStats) {
        const STEP: u64 = 2 << 20;
        const MOST: usize = 32;
        let collecting = self.recorded.garbage_collection_threshold > 0.0
            || self
                .settings
                .phases
                .iter()
                .any(|p| p.config.garbage_collection_threshold > 0.0);
        let (Some(fraction), Some(upper)) = (self.capacity.fraction, self.capacity.upper) else {
            return;
        };
        if !self.capacity.fraction_implied || !collecting || !self.capacity.phases.is_empty() {
            return;
        }
        let phases = self.settings.phases.clone();
        if !matches!(self.stats_of(&phases, expected), Some((false, _))) {
            return;
        }
        let kept = self.capacity.capacity;
        let lower = self.capacity.lower;
        let tries = (1..MOST as u64)
            .map(|k| upper.saturating_sub(k * STEP))
            .take_while(|&allowed| allowed > lower)
            .chain((lower < upper).then_some(lower));
        let last = phases.len().saturating_sub(1);
        let most = MAX_SWITCH_TRIALS.min(settings_phases::search_budget(self.plan.events));
        for allowed in tries {
            self.capacity.capacity = Some(capacity::largest_total_with_allowed_at_most(
                fraction, allowed,
            ));
            let mut settled = phases.clone();
            let agrees = matches!(self.stats_of(&phases, expected), Some((true, _)))
                || (last > 0
                    && self.settings.switch_window.is_some_and(|window| {
                        self.settle_one(&mut settled, last, window, expected, most)
                    }));
            if agrees {
                tracing::info!(
                    device = self.plan.device,
                    allowed,
                    "the statistics tell the bytes the memory fraction allowed"
                );
                self.settings.phases = settled;
                return;
            }
        }
        self.capacity.capacity = kept;
    }

    /// The plan replayed with the settings `phases` against `expected`: whether everything
    /// matched, and how far it is off (replayed minus recorded) in the first of
    /// [`SWITCH_FIGURES`] that differs (0 when none does). `None` when the replay fails.
    fn stats_of(&self, phases: &[SettingsPhase], expected: &ExpectedStats) -> Option<(bool, i64)> {
        let run = self.checked_run(phases, Some(expected))?;
        let flat = run.stats.to_flat();
        let off = SWITCH_FIGURES
            .iter()
            .map(|figure| {
                let replayed = flat.get(*figure).copied().unwrap_or(0);
                replayed - expected.figures.get(*figure).copied().unwrap_or(replayed)
            })
            .find(|&off| off != 0)
            .unwrap_or(0);
        let check = run.check?;
        Some((check.matches(), off))
    }

    /// How far the plan replayed with the settings `phases` (none: the recorded settings
    /// throughout) agrees with the record: the first event where it departs (`None`: no allocation
    /// departs) and whether everything matched. `None` when the replay fails.
    fn explains(&self, phases: &[SettingsPhase]) -> Option<(Option<usize>, bool)> {
        let check = self.checked_run(phases, None)?.check?;
        Some((check.divergence.as_ref().map(|d| d.event), check.matches()))
    }
}
