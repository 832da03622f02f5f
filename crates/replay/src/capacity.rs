//! How much memory the recorded allocator could obtain, inferred from its recorded decisions.
//!
//! A trace does not record the device's size, but every decision that depended on it bounds it:
//!
//! - every new segment (or mapping) succeeded, so the allocator was allowed at least the bytes
//!   reserved right after it: the **lower** end;
//! - an `oom` event under a memory fraction, for a request the device itself had room for
//!   (`device_free` at least the segment it needed), failed the fraction's check: the bytes still
//!   reserved plus the segment exceeded `fraction x total`, an **upper** end;
//! - a run of cache releases followed by a new segment that did not fit under the lower end was the
//!   allocator's own retry (the segment was refused, the cache released, the retry succeeded), so
//!   the bytes reserved before the run plus the segment exceeded what was allowed: another upper end.
//!   (A run that fits under the lower end was `torch.cuda.empty_cache()`.)
//! - with garbage collection (a fraction and `garbage_collection_threshold`), such a run can also
//!   be the collector's, which releases old cached segments only while the bytes reserved exceed
//!   `threshold x allowed`: either way, the bytes reserved before the run exceeded
//!   `threshold x allowed` or, with the segment, what was allowed; the larger of the two upper ends
//!   holds. (One below the lower end was `torch.cuda.empty_cache()`.)
//!
//! Under a fraction the interval is on `fraction x total`, and the simulated device gets a total
//! whose fraction lies inside it; otherwise it is on the device's memory itself. Expandable segments
//! add an upper end on the device's memory (their reservations are sized after it; see
//! [`DevicePlan`](crate::plan::DevicePlan)). The device gets the largest value inside the interval,
//! or, when no value fits, the upper end (the recorded out-of-memory errors are reproduced) and the
//! conflict is reported.
//!
//! Without a fraction, an `oom` event tells the device's free memory at that moment: the replay sets
//! the device to the bytes reserved plus that from then on (other processes may have taken memory);
//! those events are not part of the interval.

use crate::settings_phases::SettingsPhase;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::size::allocation_size;

/// What the trace says about one `oom` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OomFact {
    /// Bytes reserved when it was raised (after the allocator released what it could).
    pub(crate) reserved: u64,
    /// The rounded size of the failed request.
    pub(crate) size: u64,
    /// Free memory the device reported.
    pub(crate) device_free: u64,
}

impl OomFact {
    /// The size of the segment the request needed.
    pub(crate) fn segment(&self) -> u64 {
        usize::try_from(self.size).map_or(u64::MAX, |s| allocation_size(s) as u64)
    }

    /// Whether the device had room for the segment: the failure was the memory fraction's.
    pub(crate) fn device_had_room(&self) -> bool {
        self.segment() <= self.device_free
    }
}

/// One recorded decision that bounds the bytes the allocator was allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// A new segment or mapping succeeded, leaving this many bytes reserved.
    Reached(u64),
    /// A run of releases followed by a new segment of `size` bytes, `before` bytes reserved
    /// before the run.
    Retry { before: u64, size: u64 },
    /// An `oom` event.
    Oom(OomFact),
}

/// The recorded decisions that bound the allocator's memory, gathered while a trace is read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CapacityFacts {
    /// The most bytes reserved right after a new segment or mapping.
    pub(crate) reached: u64,
    /// The `oom` events.
    pub(crate) ooms: Vec<OomFact>,
    /// The most device memory the layout of expandable reservations allows.
    pub(crate) layout_bound: Option<u64>,
    /// Every decision above with the trace event it was made at, in order.
    pub(crate) decisions: Vec<(u32, Decision)>,
}

impl CapacityFacts {
    /// A new segment or mapping at `event` left `reserved` bytes reserved.
    pub(crate) fn reach(&mut self, event: u32, reserved: u64) {
        self.reached = self.reached.max(reserved);
        self.decisions.push((event, Decision::Reached(reserved)));
    }

    /// The run of releases starting at `event` (with `before` bytes reserved) was followed by a
    /// new segment of `size` bytes.
    pub(crate) fn retry(&mut self, event: u32, before: u64, size: u64) {
        self.decisions
            .push((event, Decision::Retry { before, size }));
    }

    /// The `oom` event `event`.
    pub(crate) fn oom(&mut self, event: u32, fact: OomFact) {
        self.ooms.push(fact);
        self.decisions.push((event, Decision::Oom(fact)));
    }
}

/// A stretch of the trace under one limit on the bytes the allocator may reserve, when the program
/// changed its memory fraction while it ran (see [`CapacityInference::phases`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LimitPhase {
    /// The trace event from which the replay applies this limit: the first recorded decision
    /// that the limit before it contradicts (`0` for the first phase).
    pub from_event: usize,
    /// The last recorded decision under the limit before it: the program changed the limit
    /// between this event and [`from_event`](Self::from_event). `None` for the first phase.
    pub changed_after: Option<usize>,
    /// The least the limit allowed: the most bytes reserved right after a new segment in this
    /// stretch (0 when none was made).
    pub lower: u64,
    /// The most it allowed, when a recorded decision in this stretch bounds it.
    pub upper: Option<u64>,
    /// The bytes the replay allows in this stretch: the upper end, or the whole device when
    /// nothing bounds it from above.
    pub allowed: u64,
    /// The memory fraction that allows them on the device picked
    /// ([`CapacityInference::capacity`]).
    pub fraction: f64,
}

/// The device memory a replay infers from a trace, and why. How: `docs/replay.md`, "Device size".
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityInference {
    /// The memory fraction the interval is under (`None`: the interval is the device's memory).
    pub fraction: Option<f64>,
    /// Whether that fraction is not the recorded configuration's but implied by `oom` events the
    /// device had room for (`torch.cuda.set_per_process_memory_fraction()` is not recorded): its
    /// value is then a choice, only the bytes it allows are bounded by the trace.
    pub fraction_implied: bool,
    /// The least the allocator was allowed: the most bytes the trace reserved.
    pub lower: u64,
    /// The most it was allowed, when a recorded decision bounds it.
    pub upper: Option<u64>,
    /// Recorded `oom` events that bound it (failures of the fraction's check).
    pub oom_bounds: usize,
    /// Cache releases that made room for a new segment, bounding it.
    pub retry_bounds: usize,
    /// The most device memory the layout of expandable reservations allows, if they bound it.
    pub layout_bound: Option<u64>,
    /// The device memory picked: inside the interval (or the upper end when none fits); `None` when
    /// nothing bounds it from above (the replay then uses [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY),
    /// or more when the fraction of that would be below the lower end).
    pub capacity: Option<u64>,
    /// Whether some value satisfies every recorded decision (with [`phases`](Self::phases): some
    /// value per phase).
    pub consistent: bool,
    /// When no single limit satisfies every recorded decision under a memory fraction, the
    /// stretches of the trace under one limit each, found in event order (a program that calls
    /// `torch.cuda.set_per_process_memory_fraction` again while it runs, which the trace does not
    /// record): each phase lasts as long as one limit fits its decisions. The replay changes the
    /// limit at each phase's [`from_event`](LimitPhase::from_event). Empty when one limit fits
    /// (or no fraction is in force).
    pub phases: Vec<LimitPhase>,
}

impl CapacityInference {
    /// Infers the interval from `facts` under the recorded configuration.
    pub(crate) fn infer(facts: &CapacityFacts, recorded: &AllocatorConfig) -> Self {
        Self::infer_under(facts, recorded, &[])
    }

    /// Infers the interval from `facts` under the recorded configuration, with the garbage
    /// collection of `settings` (the settings the program changed while it ran) in force where
    /// they were: a release run followed by a new segment bounds the limit as a collection where
    /// a threshold was in force, as a retry where none was.
    pub(crate) fn infer_under(
        facts: &CapacityFacts,
        recorded: &AllocatorConfig,
        settings: &[SettingsPhase],
    ) -> Self {
        let fraction = recorded.per_process_memory_fraction;
        let fraction = (fraction > 0.0 && fraction < 1.0).then_some(fraction);
        // With garbage collection the allocator also releases cached blocks on its own, once the
        // bytes reserved exceed the threshold's share of the limit.
        let threshold = recorded.garbage_collection_threshold;
        let collects = fraction.is_some() && threshold > 0.0;
        let threshold_at = |event: u32| {
            settings
                .iter()
                .rev()
                .find(|p| p.from_event <= event as usize)
                .map_or(threshold, |p| p.config.garbage_collection_threshold)
        };
        let lower = facts.reached;
        let mut upper: Option<u64> = None;
        let mut tighten = |bound: u64| upper = Some(upper.map_or(bound, |u| u.min(bound)));
        let mut retry_bounds = 0;
        let retries = facts.decisions.iter().filter_map(|&(event, d)| match d {
            Decision::Retry { before, size } => Some((event, before, size)),
            _ => None,
        });
        for (event, before, size) in retries {
            let needed = before + size;
            let threshold = threshold_at(event);
            let bound = if fraction.is_some() && threshold > 0.0 {
                (needed - 1).max(most_allowed_collecting_below(threshold, before))
            } else {
                needed - 1
            };
            if bound >= lower {
                retry_bounds += 1;
                tighten(bound);
            }
        }
        let mut oom_bounds = 0;
        if fraction.is_some() {
            for oom in facts.ooms.iter().filter(|o| o.device_had_room()) {
                oom_bounds += 1;
                tighten((oom.reserved + oom.segment()).saturating_sub(1));
            }
        }
        let consistent = upper.is_none_or(|u| u >= lower);
        let capacity = match fraction {
            None => {
                let picked = upper.map(|u| if consistent { u } else { u.max(1) });
                match (picked, facts.layout_bound) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
            Some(f) => {
                let picked = upper.map(|u| largest_total_with_allowed_at_most(f, u));
                let picked = match (picked, facts.layout_bound) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                picked.or_else(|| {
                    // Unbounded above: make sure the fraction of the default still allows what the
                    // trace reserved.
                    let least = smallest_total_with_allowed_at_least(f, lower);
                    (least > crate::DEFAULT_CAPACITY).then_some(least)
                })
            }
        };
        let consistent = consistent
            && capacity.is_none_or(|c| allowed(fraction, c) >= lower)
            && match (capacity, upper) {
                (Some(c), Some(u)) => allowed(fraction, c) <= u,
                _ => true,
            };
        let whole = CapacityInference {
            fraction,
            fraction_implied: false,
            lower,
            upper,
            oom_bounds,
            retry_bounds,
            layout_bound: facts.layout_bound,
            capacity,
            consistent,
            phases: Vec::new(),
        };
        if whole.consistent || fraction.is_none() {
            return whole;
        }
        let threshold = collects.then_some(threshold);
        match limit_phases(facts, threshold) {
            Some(phases) if phases.len() > 1 => whole.in_phases(facts, phases),
            _ => whole,
        }
    }

    /// The limits the program set while it ran, for a run whose configuration's memory fraction
    /// is `fraction`: [`phases`](Self::phases) when that is the one recorded (or implied), none
    /// when the run names a fraction of its own.
    pub(crate) fn phases_for(&self, fraction: f64) -> &[LimitPhase] {
        if self
            .fraction
            .is_some_and(|f| f.to_bits() == fraction.to_bits())
        {
            &self.phases
        } else {
            &[]
        }
    }

    /// This inference with the limit changing over `phases`: the device gets the memory the
    /// trace shows (the most of the bytes reserved plus the device's free memory at an `oom`
    /// event, else [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY)), at least every phase's limit;
    /// each phase allows its upper end, or the whole device when nothing bounds it.
    fn in_phases(self, facts: &CapacityFacts, phases: Vec<OpenPhase>) -> Self {
        let seen = facts
            .ooms
            .iter()
            .map(|o| o.reserved.saturating_add(o.device_free))
            .max()
            .filter(|&t| t > 0)
            .unwrap_or(crate::DEFAULT_CAPACITY);
        let total = phases
            .iter()
            .map(|p| p.upper.unwrap_or(p.lower))
            .fold(seen, u64::max);
        let phases = phases
            .into_iter()
            .map(|p| {
                let allowed = p.upper.unwrap_or(total);
                LimitPhase {
                    from_event: p.from as usize,
                    changed_after: p.after.map(|e| e as usize),
                    lower: p.lower,
                    upper: p.upper,
                    allowed,
                    fraction: fraction_allowing(allowed, total),
                }
            })
            .collect::<Vec<_>>();
        tracing::debug!(
            phases = phases.len(),
            "no single memory limit fits the trace: the limit changed while the program ran"
        );
        CapacityInference {
            oom_bounds: phases.iter().filter(|p| p.upper.is_some()).count(),
            capacity: Some(total),
            consistent: true,
            phases,
            ..self
        }
    }
}

/// A stretch of decisions under one limit, found by [`limit_phases`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OpenPhase {
    /// The trace event from which it holds.
    from: u32,
    /// The last decision's event of the phase before it.
    after: Option<u32>,
    /// The most bytes reserved after a new segment in it.
    lower: u64,
    /// The least upper end of its decisions.
    upper: Option<u64>,
}

/// The bound a decision puts on the limit: bytes reserved it needed (a lower end), or an upper
/// end; `threshold` is the garbage collection threshold when the allocator collects.
fn bound_of(decision: Decision, threshold: Option<f64>) -> Bound {
    match decision {
        Decision::Reached(reserved) => Bound::Lower(reserved),
        Decision::Retry { before, size } => {
            let needed = before + size;
            Bound::Release(match threshold {
                Some(t) => (needed - 1).max(most_allowed_collecting_below(t, before)),
                None => needed - 1,
            })
        }
        Decision::Oom(oom) if oom.device_had_room() => {
            Bound::Upper((oom.reserved + oom.segment()).saturating_sub(1))
        }
        Decision::Oom(_) => Bound::None,
    }
}

/// What one decision says about the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bound {
    /// At least this many bytes.
    Lower(u64),
    /// At most this many.
    Upper(u64),
    /// At most this many, unless the release was `empty_cache()` (a bound under what the same
    /// limit allowed elsewhere).
    Release(u64),
    /// Nothing (the device itself was full).
    None,
}

/// The interval a set of decisions allows, whatever their order, gathered one decision at a time:
/// at least the most bytes reserved after a new segment, at most the least upper end (release runs
/// bounding under the lower end were `empty_cache()`, and drop out as it rises).
#[derive(Debug, Default)]
struct Interval {
    lower: u64,
    /// The least upper end of the failures.
    failures: Option<u64>,
    /// The upper ends of release runs at or above `lower`, least first.
    releases: std::collections::BinaryHeap<std::cmp::Reverse<u64>>,
}

impl Interval {
    /// Whether one limit still fits once `bound` is added.
    fn fits(&self, bound: Bound) -> bool {
        match bound {
            Bound::Lower(l) => self.failures.is_none_or(|u| u >= self.lower.max(l)),
            Bound::Upper(u) => u >= self.lower,
            Bound::Release(_) | Bound::None => true,
        }
    }

    fn add(&mut self, bound: Bound) {
        match bound {
            Bound::Lower(l) => {
                self.lower = self.lower.max(l);
                while self
                    .releases
                    .peek()
                    .is_some_and(|&std::cmp::Reverse(u)| u < self.lower)
                {
                    self.releases.pop();
                }
            }
            Bound::Upper(u) => self.failures = Some(self.failures.map_or(u, |v| v.min(u))),
            Bound::Release(u) if u >= self.lower => self.releases.push(std::cmp::Reverse(u)),
            Bound::Release(_) | Bound::None => {}
        }
    }

    /// The interval of `bounds` (which one limit fits).
    fn of(bounds: &[Bound]) -> Self {
        let mut interval = Self::default();
        for &b in bounds {
            interval.add(b);
        }
        interval
    }

    fn upper(&self) -> Option<u64> {
        let release = self.releases.peek().map(|&std::cmp::Reverse(u)| u);
        match (self.failures, release) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The stretches of the trace under one limit each, in event order: the fewest such stretches
/// (each as long as one limit fits its decisions, read forwards), each then started as early as
/// its limit still fits the decisions before it (read backwards), so that a limit changed between
/// two decisions is in force for every decision that allows it. `threshold` is the garbage
/// collection threshold when the allocator collects (its release runs bound the limit
/// differently). `None` when there is no decision. Each decision is added once per direction (the
/// interval of a set does not depend on the order of its decisions).
pub(crate) fn limit_phases(
    facts: &CapacityFacts,
    threshold: Option<f64>,
) -> Option<Vec<OpenPhase>> {
    let bounds: Vec<Bound> = facts
        .decisions
        .iter()
        .map(|&(_, d)| bound_of(d, threshold))
        .collect();
    if bounds.is_empty() {
        return None;
    }
    // Forwards: each stretch as long as one limit fits it; `starts` are decision indices.
    let mut starts = vec![0];
    let mut current = Interval::default();
    for (i, &b) in bounds.iter().enumerate() {
        if !current.fits(b) {
            starts.push(i);
            current = Interval::default();
        }
        current.add(b);
    }
    // Backwards: each stretch from the earliest decision its limit still fits, never emptying
    // the one before.
    for k in (1..starts.len()).rev() {
        let end = starts.get(k + 1).copied().unwrap_or(bounds.len());
        let mut later = Interval::of(&bounds[starts[k]..end]);
        while starts[k] - 1 > starts[k - 1] && later.fits(bounds[starts[k] - 1]) {
            starts[k] -= 1;
            later.add(bounds[starts[k]]);
        }
    }
    let phases = starts
        .iter()
        .enumerate()
        .map(|(k, &start)| {
            let end = starts.get(k + 1).copied().unwrap_or(bounds.len());
            let interval = Interval::of(&bounds[start..end]);
            let event = |i: usize| facts.decisions[i].0;
            OpenPhase {
                from: if k == 0 { 0 } else { event(start) },
                after: (k > 0).then(|| event(start - 1)),
                lower: interval.lower,
                upper: interval.upper(),
            }
        })
        .collect();
    Some(phases)
}

/// The memory fraction whose share of `total` is exactly `allowed` bytes (PyTorch's
/// `allowed_memory_maximum`, `fraction x total` rounded down), or the nearest above.
fn fraction_allowing(allowed: u64, total: u64) -> f64 {
    if total == 0 || allowed >= total {
        return 1.0;
    }
    let mut fraction = allowed as f64 / total as f64;
    while fraction > 0.0 && (fraction * total as f64) as u64 > allowed {
        fraction = fraction.next_down();
    }
    while ((fraction * total as f64) as u64) < allowed {
        fraction = fraction.next_up();
    }
    fraction
}

/// The memory fraction a trace recorded without one implies, if any: PyTorch's snapshot records the
/// `PYTORCH_CUDA_ALLOC_CONF` settings but not `torch.cuda.set_per_process_memory_fraction()`, so a
/// request that failed although the device had room for its segment (`device_free` at least that)
/// failed a fraction's check. The fraction itself is not in the trace, only the bytes it allowed
/// (the interval of [`CapacityInference`]); the one returned makes a device as large as the trace
/// shows (the most of `reserved + device_free` over those events) allow the least upper end they
/// give, so that the simulated device keeps the recorded room and the allowed bytes fall inside the
/// interval. `None` when no `oom` event failed with room on the device.
pub(crate) fn implied_fraction<'a>(
    facts: impl IntoIterator<Item = &'a CapacityFacts>,
) -> Option<f64> {
    let mut seen_total = 0u64;
    let mut upper: Option<u64> = None;
    for oom in facts
        .into_iter()
        .flat_map(|f| &f.ooms)
        .filter(|o| o.device_had_room())
    {
        seen_total = seen_total.max(oom.reserved.saturating_add(oom.device_free));
        let bound = (oom.reserved + oom.segment()).saturating_sub(1);
        upper = Some(upper.map_or(bound, |u| u.min(bound)));
    }
    let upper = upper?;
    if seen_total == 0 {
        return None;
    }
    let fraction = upper as f64 / seen_total as f64;
    (fraction > 0.0 && fraction < 1.0).then_some(fraction)
}

/// The bytes the allocator may reserve on a device of `total` bytes (PyTorch's
/// `allowed_memory_maximum`).
fn allowed(fraction: Option<f64>, total: u64) -> u64 {
    match fraction {
        Some(f) => (f * total as f64) as u64,
        None => total,
    }
}

/// The most allowed bytes under which garbage collection with `threshold` still collects with
/// `reserved` bytes reserved (`threshold x allowed`, rounded down, below `reserved`).
fn most_allowed_collecting_below(threshold: f64, reserved: u64) -> u64 {
    let collects = |allowed: u64| ((threshold * allowed as f64) as u64) < reserved;
    if reserved == 0 {
        return 0;
    }
    let mut allowed = (reserved as f64 / threshold) as u64;
    while allowed > 0 && !collects(allowed) {
        allowed -= 1;
    }
    while collects(allowed + 1) {
        allowed += 1;
    }
    allowed
}

/// The largest device size whose `fraction` is at most `bytes`.
pub(crate) fn largest_total_with_allowed_at_most(fraction: f64, bytes: u64) -> u64 {
    let mut total = ((bytes as f64 + 1.0) / fraction) as u64;
    while total > 0 && allowed(Some(fraction), total) > bytes {
        total -= 1 + total / (1 << 40);
    }
    while allowed(Some(fraction), total + 1) <= bytes {
        total += 1;
    }
    total
}

/// The smallest device size whose `fraction` is at least `bytes`.
fn smallest_total_with_allowed_at_least(fraction: f64, bytes: u64) -> u64 {
    let mut total = (bytes as f64 / fraction) as u64;
    while allowed(Some(fraction), total) < bytes {
        total += 1 + total / (1 << 40);
    }
    while total > 0 && allowed(Some(fraction), total - 1) >= bytes {
        total -= 1;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> AllocatorConfig {
        let mut c = AllocatorConfig::default();
        c.apply(text).unwrap();
        c
    }

    #[test]
    fn fraction_ooms_and_segments_bound_the_allowed_bytes() {
        let facts = CapacityFacts {
            reached: 2_829_058_048,
            ooms: vec![
                OomFact {
                    reserved: 1_583_349_760,
                    size: 1_358_949_376,
                    device_free: 147 << 30,
                },
                // The device itself refused this one: no bound on the fraction.
                OomFact {
                    reserved: 1 << 30,
                    size: 4 << 30,
                    device_free: 1 << 30,
                },
            ],
            ..CapacityFacts::default()
        };
        let inference =
            CapacityInference::infer(&facts, &config("per_process_memory_fraction:0.019"));
        assert_eq!(inference.oom_bounds, 1);
        let upper = inference.upper.unwrap();
        assert_eq!(upper, 1_583_349_760 + 1_358_954_496 - 1);
        assert!(inference.consistent);
        let total = inference.capacity.unwrap();
        let allowed = (0.019 * total as f64) as u64;
        assert!(allowed >= facts.reached && allowed <= upper, "{allowed}");
        assert!((0.019 * (total + 1) as f64) as u64 > upper);
    }

    #[test]
    fn a_fraction_set_in_the_program_is_implied_by_ooms_the_device_had_room_for() {
        let room = OomFact {
            reserved: 300 << 20,
            size: 40 << 20,
            device_free: 80 << 30,
        };
        let full = OomFact {
            reserved: 300 << 20,
            size: 40 << 20,
            device_free: 1 << 20,
        };
        let facts = CapacityFacts {
            reached: 320 << 20,
            ooms: vec![room],
            ..CapacityFacts::default()
        };
        let fraction = implied_fraction([&facts]).unwrap();
        let inference = CapacityInference::infer(
            &facts,
            &config(&format!("per_process_memory_fraction:{fraction}")),
        );
        assert!(inference.consistent);
        let total = inference.capacity.unwrap();
        let allowed = (fraction * total as f64) as u64;
        assert!((320 << 20..340 << 20).contains(&allowed), "{allowed}");
        assert!(
            total >= room.reserved + room.device_free - (1 << 20),
            "{total}"
        );
        // A device that was full says nothing about a fraction.
        let facts = CapacityFacts {
            ooms: vec![full],
            ..facts
        };
        assert_eq!(implied_fraction([&facts]), None);
    }

    #[test]
    fn garbage_collection_releases_bound_the_allowed_bytes() {
        let base = CapacityFacts {
            reached: 322 << 20,
            ooms: vec![OomFact {
                reserved: 294 << 20,
                size: 36 << 20,
                device_free: 80 << 30,
            }],
            ..CapacityFacts::default()
        };
        // Segments released before a new one with 196 MiB reserved: the collector's.
        let mut facts = base.clone();
        facts.retry(10, 196 << 20, 42 << 20);
        let collecting =
            config("per_process_memory_fraction:0.004,garbage_collection_threshold:0.6");
        let inference = CapacityInference::infer(&facts, &collecting);
        let upper = inference.upper.unwrap();
        assert_eq!(inference.retry_bounds, 1);
        assert!(((0.6 * upper as f64) as u64) < 196 << 20);
        assert!(((0.6 * (upper + 1) as f64) as u64) >= 196 << 20);
        let allowed = (0.004 * inference.capacity.unwrap() as f64) as u64;
        assert!((322 << 20..=upper).contains(&allowed), "{allowed}");
        // A release with little reserved was `empty_cache`: no bound.
        let mut facts = base;
        facts.retry(10, 20 << 20, 2 << 20);
        let inference = CapacityInference::infer(&facts, &collecting);
        assert_eq!(inference.retry_bounds, 0);
        assert_eq!(inference.upper, Some((330 << 20) - 1));
    }

    #[test]
    fn conflicting_decisions_are_reported() {
        let facts = CapacityFacts {
            reached: 3 << 30,
            ooms: vec![OomFact {
                reserved: 1 << 30,
                size: 1 << 30,
                device_free: 100 << 30,
            }],
            ..CapacityFacts::default()
        };
        let inference =
            CapacityInference::infer(&facts, &config("per_process_memory_fraction:0.5"));
        assert!(!inference.consistent);
        assert_eq!(inference.upper, Some((2 << 30) - 1));
    }

    /// Two limits: the second starts as early as its limit fits (the small segment after the last
    /// failure could have been made under either), and each stretch keeps its own interval.
    #[test]
    fn stretches_under_one_limit_each_start_as_early_as_their_limit_allows() {
        let mib = 1u64 << 20;
        let mut facts = CapacityFacts::default();
        facts.reach(1, 60 * mib);
        facts.oom(
            2,
            OomFact {
                reserved: 60 * mib,
                size: 20 * mib,
                device_free: 1 << 40,
            },
        );
        facts.reach(3, 40 * mib);
        facts.reach(4, 300 * mib);
        facts.retry(5, 300 * mib, 40 * mib);
        let phases = limit_phases(&facts, None).unwrap();
        assert_eq!(phases.len(), 2, "{phases:?}");
        assert_eq!((phases[0].from, phases[0].after), (0, None));
        assert_eq!(
            (phases[0].lower, phases[0].upper),
            (60 * mib, Some(80 * mib - 1))
        );
        assert_eq!((phases[1].from, phases[1].after), (3, Some(2)));
        assert_eq!(
            (phases[1].lower, phases[1].upper),
            (300 * mib, Some(340 * mib - 1))
        );
        // One limit fits the whole trace once the last segment is gone: no second stretch.
        let mut one = CapacityFacts::default();
        one.reach(1, 60 * mib);
        one.oom(
            2,
            OomFact {
                reserved: 60 * mib,
                size: 20 * mib,
                device_free: 1 << 40,
            },
        );
        assert_eq!(limit_phases(&one, None).unwrap().len(), 1);
    }

    #[test]
    fn a_tiny_fraction_still_allows_what_the_trace_reserved() {
        let facts = CapacityFacts {
            reached: 4 << 30,
            ..CapacityFacts::default()
        };
        let inference =
            CapacityInference::infer(&facts, &config("per_process_memory_fraction:0.001"));
        let total = inference.capacity.unwrap();
        assert!((0.001 * total as f64) as u64 >= 4 << 30);
        assert!(inference.consistent);
        // Without a fraction nothing bounds it: the default is used.
        let free = CapacityInference::infer(&facts, &AllocatorConfig::default());
        assert_eq!(free.capacity, None);
    }
}
