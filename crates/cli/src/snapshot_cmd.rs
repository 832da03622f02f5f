//! `tensormem snapshot summary FILE`: what a memory snapshot (PyTorch's or tensormem's) holds, and
//! how fragmented its cache is.
//!
//! Two kinds of waste are told apart:
//! - **internal fragmentation**: bytes inside allocated blocks that nobody asked for (the block sizes
//!   rounded up from the requests): `allocated - requested`;
//! - **external fragmentation**: bytes reserved from the device but not allocated: `reserved -
//!   allocated`, held in free pieces (cached blocks, and blocks waiting for other streams). The
//!   largest free piece says how big a request the cache can still serve without a new segment.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::Subcommand;
use tensormem_cuda_alloc::size::format_size;
use tensormem_cuda_alloc::snapshot::{BlockState, Segment, SegmentType, Snapshot, TraceAction};

/// `tensormem snapshot ...`
#[derive(Debug, Subcommand)]
pub(crate) enum SnapshotCommand {
    /// Segments, reserved / allocated / active bytes, the largest free block, internal and external
    /// fragmentation, per stream; and the trace's events.
    Summary {
        /// A snapshot: torch.cuda.memory._dump_snapshot's pickle (gzip-compressed or not), or
        /// tensormem's (pickle or JSON).
        file: PathBuf,
    },
}

/// Runs `tensormem snapshot ...`.
pub(crate) fn run(command: SnapshotCommand) -> Result<()> {
    match command {
        SnapshotCommand::Summary { file } => {
            let snapshot = Snapshot::read_file(&file).map_err(|e| anyhow!("{e}"))?;
            let mut out = std::io::stdout().lock();
            crate::quiet_broken_pipe(
                write_summary(&mut out, &file.display().to_string(), &snapshot)
                    .and_then(|()| out.flush()),
            )
        }
    }
}

/// Byte and block counts of a group of segments.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) segments: usize,
    pub(crate) small: usize,
    pub(crate) expandable: usize,
    pub(crate) reserved: u64,
    pub(crate) allocated: u64,
    pub(crate) allocated_blocks: usize,
    /// Requested bytes of the allocated blocks.
    pub(crate) requested: u64,
    pub(crate) active: u64,
    pub(crate) pending_blocks: usize,
    pub(crate) pending: u64,
    pub(crate) free_blocks: usize,
    pub(crate) free: u64,
    pub(crate) largest_free: u64,
}

impl Tally {
    fn add(&mut self, segment: &Segment) {
        self.segments += 1;
        self.small += usize::from(segment.segment_type == SegmentType::Small);
        self.expandable += usize::from(segment.is_expandable);
        self.reserved += segment.total_size;
        for block in &segment.blocks {
            match block.state {
                BlockState::ActiveAllocated => {
                    self.allocated += block.size;
                    self.allocated_blocks += 1;
                    self.requested += block.requested_size;
                    self.active += block.size;
                }
                BlockState::ActivePendingFree => {
                    self.pending += block.size;
                    self.pending_blocks += 1;
                    self.active += block.size;
                }
                BlockState::Inactive => {
                    self.free += block.size;
                    self.free_blocks += 1;
                    self.largest_free = self.largest_free.max(block.size);
                }
            }
        }
    }

    /// `allocated - requested`.
    pub(crate) fn internal(&self) -> u64 {
        self.allocated.saturating_sub(self.requested)
    }

    /// `reserved - allocated`.
    pub(crate) fn external(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

/// Tallies of all segments, and per (device, stream).
pub(crate) fn tally(snapshot: &Snapshot) -> (Tally, BTreeMap<(i64, u64), Tally>) {
    let mut all = Tally::default();
    let mut per_stream: BTreeMap<(i64, u64), Tally> = BTreeMap::new();
    for segment in &snapshot.segments {
        all.add(segment);
        per_stream
            .entry((segment.device, segment.stream))
            .or_default()
            .add(segment);
    }
    (all, per_stream)
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".to_owned()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

/// Writes the summary of `snapshot` (read from `name`).
pub(crate) fn write_summary(
    out: &mut impl Write,
    name: &str,
    snapshot: &Snapshot,
) -> std::io::Result<()> {
    let (all, per_stream) = tally(snapshot);
    writeln!(out, "snapshot: {name}")?;
    if let Some(settings) = &snapshot.allocator_settings {
        let text = match settings.to_config() {
            Ok(config) if config.to_string().is_empty() => "(defaults)".to_owned(),
            Ok(config) => config.to_string(),
            Err(_) => settings.config_string.clone().unwrap_or_default(),
        };
        writeln!(out, "allocator settings: {text}")?;
    }
    writeln!(
        out,
        "segments: {} ({} small, {} large; {} expandable)",
        all.segments,
        all.small,
        all.segments - all.small,
        all.expandable
    )?;
    writeln!(out, "reserved:  {}", format_size(all.reserved))?;
    writeln!(
        out,
        "allocated: {} in {} (requested {})",
        format_size(all.allocated),
        crate::count(all.allocated_blocks as u64, "block", "blocks"),
        format_size(all.requested)
    )?;
    writeln!(
        out,
        "active:    {} (allocated, plus {} in {} waiting for other streams)",
        format_size(all.active),
        format_size(all.pending),
        crate::count(all.pending_blocks as u64, "block", "blocks")
    )?;
    writeln!(out, "largest free block: {}", format_size(all.largest_free))?;
    writeln!(
        out,
        "internal fragmentation (allocated - requested): {} ({} of allocated)",
        format_size(all.internal()),
        percent(all.internal(), all.allocated)
    )?;
    writeln!(
        out,
        "external fragmentation (reserved - allocated): {} ({} of reserved): {} free in {}, {} \
         waiting for other streams",
        format_size(all.external()),
        percent(all.external(), all.reserved),
        format_size(all.free),
        crate::count(all.free_blocks as u64, "piece", "pieces"),
        format_size(all.pending)
    )?;
    if !per_stream.is_empty() {
        writeln!(out, "per stream:")?;
        let mut rows = vec![[
            "device".to_owned(),
            "stream".to_owned(),
            "segments".to_owned(),
            "reserved".to_owned(),
            "allocated".to_owned(),
            "active".to_owned(),
            "free pieces".to_owned(),
            "largest free".to_owned(),
        ]];
        for ((device, stream), t) in &per_stream {
            rows.push([
                device.to_string(),
                format!("{stream:#x}"),
                t.segments.to_string(),
                format_size(t.reserved),
                format_size(t.allocated),
                format_size(t.active),
                t.free_blocks.to_string(),
                format_size(t.largest_free),
            ]);
        }
        let widths: Vec<usize> = (0..8)
            .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        for row in &rows {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(cell, &w)| format!("{cell:>w$}"))
                .collect();
            writeln!(out, "  {}", cells.join("  "))?;
        }
    }
    for (device, trace) in snapshot.traces() {
        if trace.is_empty() {
            continue;
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for e in trace {
            *counts.entry(e.action.to_string()).or_default() += 1;
        }
        let order = |name: &str| {
            [
                TraceAction::Alloc,
                TraceAction::FreeRequested,
                TraceAction::FreeCompleted,
                TraceAction::SegmentAlloc,
                TraceAction::SegmentFree,
                TraceAction::SegmentMap,
                TraceAction::SegmentUnmap,
                TraceAction::Oom,
            ]
            .iter()
            .position(|a| a.as_str() == name)
            .unwrap_or(usize::MAX)
        };
        let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
        counts.sort_by_key(|(name, _)| order(name));
        let listed: Vec<String> = counts.iter().map(|(n, c)| format!("{c} {n}")).collect();
        writeln!(
            out,
            "trace: device {device}: {} events ({})",
            trace.len(),
            listed.join(", ")
        )?;
    }
    if snapshot.event_count() == 0 {
        writeln!(out, "trace: none recorded")?;
    }
    Ok(())
}
