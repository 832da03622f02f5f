//! The SVG timeline of `tensormem replay --plot`: allocated, reserved and requested bytes over the
//! trace, one panel per configuration, all on the same scale so that panels compare at a glance, with
//! the device's capacity as a dashed line when `--capacity` set it.
//!
//! Written by hand (a few hundred points and some text need no plotting library).

use std::fmt::Write as _;
use std::path::Path;

use tensormem_cuda_alloc::size::format_size;
use tensormem_replay::{ReplayRun, TimelinePoint};

const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 230.0;
const TOP: f64 = 56.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const PLOT_TOP: f64 = 30.0;
const PLOT_BOTTOM: f64 = 34.0;

/// The figures drawn, in drawing order: name, colour, line width, opacity, value. Requested bytes
/// are never above allocated ones and often nearly equal to them, so requested is drawn first, wide
/// and pale, and allocated over it, thin and solid: both stay visible where they coincide.
type Series = (
    &'static str,
    &'static str,
    f64,
    f64,
    fn(&TimelinePoint) -> u64,
);
const SERIES: [Series; 3] = [
    ("requested", "#2ca02c", 5.0, 0.45, |p| p.requested),
    ("allocated", "#1f77b4", 1.5, 1.0, |p| p.allocated),
    ("reserved", "#d62728", 1.5, 1.0, |p| p.reserved),
];

/// The colour of the capacity line.
const CAPACITY_COLOUR: &str = "#555";

/// Writes the timeline of `runs` (replays of the trace named `trace`, on a device of `capacity`
/// bytes when `--capacity` gave it) to `path`.
pub(crate) fn write_timeline(
    path: &Path,
    trace: &str,
    runs: &[ReplayRun],
    capacity: Option<u64>,
) -> std::io::Result<()> {
    std::fs::write(path, timeline_svg(trace, runs, capacity))
}

/// The timeline of `runs` as an SVG document.
pub(crate) fn timeline_svg(trace: &str, runs: &[ReplayRun], capacity: Option<u64>) -> String {
    let top = runs
        .iter()
        .flat_map(|r| &r.devices)
        .flat_map(|d| &d.timeline.points)
        .map(|p| p.reserved.max(p.allocated).max(p.requested))
        .chain(capacity)
        .max()
        .unwrap_or(0)
        .max(1);
    let y_axis = Axis::bytes(top);
    let height = TOP + PANEL_HEIGHT * runs.len() as f64 + 8.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="22" font-size="15" font-weight="bold">tensormem replay: {}</text>"#,
        escape(trace)
    );
    let mut x = LEFT;
    for (name, colour, width, opacity, _) in SERIES {
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="36" x2="{}" y2="36" stroke="{colour}" stroke-width="{width}" stroke-opacity="{opacity}"/><text x="{}" y="40">{name} bytes</text>"#,
            x + 14.0,
            x + 18.0
        );
        x += 130.0;
    }
    if let Some(capacity) = capacity {
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="36" x2="{}" y2="36" stroke="{CAPACITY_COLOUR}" stroke-dasharray="4 3"/><text x="{}" y="40">capacity ({})</text>"#,
            x + 14.0,
            x + 18.0,
            format_size(capacity)
        );
    }
    for (index, run) in runs.iter().enumerate() {
        panel(
            &mut svg,
            TOP + PANEL_HEIGHT * index as f64,
            run,
            &y_axis,
            capacity,
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, top: f64, run: &ReplayRun, y_axis: &Axis, capacity: Option<u64>) {
    let y_max = y_axis.max;
    let stats = run.flat_stats();
    let peak = |key: &str| format_size(stats.get(key).copied().unwrap_or(0).max(0) as u64);
    // A run under the model of `backend:cudaMallocAsync` has its reserved bytes as a lower bound.
    let at_least = if run.lower_bounds().contains(&"reserved_bytes.all.peak") {
        ">= "
    } else {
        ""
    };
    let title = format!(
        "{}{}: peak reserved {at_least}{}, peak allocated {}",
        run.label(),
        if run.recorded { " [recorded]" } else { "" },
        peak("reserved_bytes.all.peak"),
        peak("allocated_bytes.all.peak")
    );
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (y0, y1) = (top + PLOT_TOP, top + PANEL_HEIGHT - PLOT_BOTTOM);
    let _ = writeln!(
        svg,
        r#"<text x="{x0}" y="{}" font-weight="bold">{}</text>"#,
        top + 18.0,
        escape(&title)
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{x0}" y="{y0}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        x1 - x0,
        y1 - y0
    );
    let last_event = run
        .devices
        .iter()
        .flat_map(|d| d.timeline.points.last())
        .map(|p| p.event)
        .max()
        .unwrap_or(0)
        .max(1);
    for value in y_axis.ticks() {
        let y = y1 - (y1 - y0) * value as f64 / y_max as f64;
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            format_size(value)
        );
    }
    for event in Axis::events(last_event).ticks() {
        let x = x0 + (x1 - x0) * event as f64 / last_event as f64;
        let _ = writeln!(
            svg,
            r##"<text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#555">{event}</text>"##,
            y1 + 16.0
        );
    }
    if let Some(capacity) = capacity {
        let y = y1 - (y1 - y0) * capacity as f64 / y_max as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="{CAPACITY_COLOUR}" stroke-dasharray="4 3"/>"#
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{x1}" y="{:.1}" text-anchor="end" fill="#555">trace event</text>"##,
        y1 + 30.0
    );
    for device in &run.devices {
        for (_, colour, width, opacity, value) in SERIES {
            let mut points = String::new();
            for p in &device.timeline.points {
                let x = x0 + (x1 - x0) * p.event as f64 / last_event as f64;
                let y = y1 - (y1 - y0) * value(p) as f64 / y_max as f64;
                let _ = write!(points, "{x:.1},{y:.1} ");
            }
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="{width}" stroke-opacity="{opacity}" stroke-linejoin="round" points="{}"/>"#,
                points.trim_end()
            );
        }
    }
}

/// An axis from 0 with ticks every `step`, a round number, up to `max` (a multiple of `step`).
struct Axis {
    step: u64,
    max: u64,
}

impl Axis {
    /// A byte axis that holds `top`: ticks 1, 2 or 5 times a power of ten of B, KiB, MiB, GiB or TiB
    /// (2 GiB, 500 MiB, ...), at most six of them, the axis ending on the first tick at or above
    /// `top`.
    fn bytes(top: u64) -> Self {
        let mut unit = 1u64;
        while unit < 1 << 40 && unit.saturating_mul(1024) <= top {
            unit *= 1024;
        }
        Self::round(top, unit)
    }

    /// An event axis over `0..=last`: ticks 1, 2 or 5 times a power of ten, at most six, none past
    /// `last`.
    fn events(last: u64) -> Self {
        let axis = Self::round(last, 1);
        Self {
            step: axis.step,
            max: last,
        }
    }

    fn round(top: u64, unit: u64) -> Self {
        let top = top.max(1);
        let mut decade = 1u64;
        loop {
            for m in [1, 2, 5] {
                let step = unit.saturating_mul(decade).saturating_mul(m);
                if top.div_ceil(step) <= 5 {
                    return Self {
                        step,
                        max: top.div_ceil(step) * step,
                    };
                }
            }
            decade = decade.saturating_mul(10);
        }
    }

    /// 0, step, 2 x step, ... up to `max`.
    fn ticks(&self) -> impl Iterator<Item = u64> + '_ {
        (0..=self.max / self.step).map(move |i| i * self.step)
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticks(axis: &Axis) -> Vec<u64> {
        axis.ticks().collect()
    }

    #[test]
    fn byte_ticks_are_round() {
        const MIB: u64 = 1 << 20;
        const GIB: u64 = 1 << 30;
        // 5.66 GiB reserved: ticks every 2 GiB up to 6 GiB.
        let axis = Axis::bytes(6_079_643_648);
        assert_eq!(ticks(&axis), [0, 2 * GIB, 4 * GIB, 6 * GIB]);
        // 88 MiB: every 20 MiB up to 100 MiB.
        assert_eq!(Axis::bytes(92_274_688).step, 20 * MIB);
        assert_eq!(Axis::bytes(92_274_688).max, 100 * MIB);
        assert_eq!(ticks(&Axis::bytes(1)), [0, 1]);
        for top in [1, 1000, 3 * MIB, 700 * MIB, 9 * GIB, 300 * GIB] {
            let axis = Axis::bytes(top);
            assert!(axis.max >= top && axis.max / axis.step <= 5, "{top}");
        }
    }

    #[test]
    fn event_ticks_are_round_and_stay_within_the_trace() {
        assert_eq!(ticks(&Axis::events(9679)), [0, 2000, 4000, 6000, 8000]);
        assert_eq!(ticks(&Axis::events(10)), [0, 2, 4, 6, 8, 10]);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
