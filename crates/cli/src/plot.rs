//! The SVG timeline of `tensormem replay --plot`: allocated, reserved and requested bytes over the
//! trace, one panel per configuration, all on the same scale so that panels compare at a glance.
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

/// The figures drawn, with their colours.
/// The figures drawn: name, colour, line width (allocated and requested are often nearly equal:
/// the wider allocated line stays visible under requested), value.
type Series = (&'static str, &'static str, f64, fn(&TimelinePoint) -> u64);
const SERIES: [Series; 3] = [
    ("reserved", "#d62728", 1.5, |p| p.reserved),
    ("allocated", "#1f77b4", 3.0, |p| p.allocated),
    ("requested", "#2ca02c", 1.2, |p| p.requested),
];

/// Writes the timeline of `runs` (replays of the trace named `trace`) to `path`.
pub(crate) fn write_timeline(path: &Path, trace: &str, runs: &[ReplayRun]) -> std::io::Result<()> {
    std::fs::write(path, timeline_svg(trace, runs))
}

/// The timeline of `runs` as an SVG document.
pub(crate) fn timeline_svg(trace: &str, runs: &[ReplayRun]) -> String {
    let top = runs
        .iter()
        .flat_map(|r| &r.devices)
        .flat_map(|d| &d.timeline.points)
        .map(|p| p.reserved.max(p.allocated).max(p.requested))
        .max()
        .unwrap_or(0)
        .max(1);
    let y_max = nice_ceiling(top);
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
    for (name, colour, _, _) in SERIES {
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="34" width="14" height="4" fill="{colour}"/><text x="{}" y="40">{name} bytes</text>"#,
            x + 18.0
        );
        x += 130.0;
    }
    for (index, run) in runs.iter().enumerate() {
        panel(&mut svg, TOP + PANEL_HEIGHT * index as f64, run, y_max);
    }
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, top: f64, run: &ReplayRun, y_max: u64) {
    let stats = run.flat_stats();
    let peak = |key: &str| format_size(stats.get(key).copied().unwrap_or(0).max(0) as u64);
    let title = format!(
        "{}{}: peak reserved {}, peak allocated {}",
        run.label(),
        if run.recorded { " (recorded)" } else { "" },
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
    for tick in 0..=4u64 {
        let value = y_max / 4 * tick;
        let y = y1 - (y1 - y0) * tick as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            format_size(value)
        );
        let event = last_event / 4 * tick;
        let x = x0 + (x1 - x0) * event as f64 / last_event as f64;
        let _ = writeln!(
            svg,
            r##"<text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#555">{event}</text>"##,
            y1 + 16.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{x1}" y="{:.1}" text-anchor="end" fill="#555">trace event</text>"##,
        y1 + 30.0
    );
    for device in &run.devices {
        for (_, colour, width, value) in SERIES {
            let mut points = String::new();
            for p in &device.timeline.points {
                let x = x0 + (x1 - x0) * p.event as f64 / last_event as f64;
                let y = y1 - (y1 - y0) * value(p) as f64 / y_max as f64;
                let _ = write!(points, "{x:.1},{y:.1} ");
            }
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="{width}" points="{}"/>"#,
                points.trim_end()
            );
        }
    }
}

/// The smallest "round" number of bytes (1, 2 or 5 times a power of two of GiB/MiB/KiB scale) at or
/// above `bytes`, so axis ticks read well.
fn nice_ceiling(bytes: u64) -> u64 {
    let mut unit = 1u64;
    while unit.saturating_mul(1024) <= bytes {
        unit *= 1024;
    }
    for step in [
        1, 2, 4, 5, 8, 10, 20, 40, 50, 80, 100, 200, 400, 500, 800, 1000, 1024,
    ] {
        let candidate = unit.saturating_mul(step);
        if candidate >= bytes {
            return candidate;
        }
    }
    bytes
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

    #[test]
    fn axis_tops_are_round() {
        assert_eq!(nice_ceiling(6_079_643_648), 8 << 30);
        assert_eq!(nice_ceiling(92_274_688), 100 << 20);
        assert_eq!(nice_ceiling(1), 1);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
