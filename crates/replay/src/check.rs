//! Checking a replay under the recorded configuration against what PyTorch recorded.
//!
//! Three records can be compared, each where the trace provides it:
//!
//! - **every allocation**: the trace says where PyTorch put each block and, through its segment
//!   events, how many bytes were reserved at that moment; the first allocation where the replay
//!   differs is reported as a [`Divergence`];
//! - **the final segments**: the snapshot's `segments` are the allocator's state when it was taken
//!   (addresses, sizes, streams, pools, and the state of every block);
//! - **the statistics**: `torch.cuda.memory_stats()` read after the run, when it was saved beside the
//!   trace ([`ExpectedStats`]); every integer figure present in both is compared.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

use super::{Error, Result};
use tensormem_cuda_alloc::device::StreamId;
use tensormem_cuda_alloc::size::format_size;
use tensormem_cuda_alloc::snapshot::{BlockState, Segment};

/// `torch.cuda.memory_stats()` as saved by the recording script: flat key names and values. Entries
/// that are not whole numbers (a string, `2.5`) are kept too: one under a key the replay produces
/// fails the check; others (the device name, a script's `wall_s`) are ignored.
///
/// The top level is `memory_stats()` with no argument (the current device, 0). A `"devices"` map
/// beside it (`{"0": {...}, "1": {...}}`, `memory_stats(d)` for every device `d`) gives each
/// device's figures; a device it does not list is checked against the top level only if it is
/// device 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpectedStats {
    /// The figures by flat key (`"reserved_bytes.all.peak"`, ...).
    pub figures: BTreeMap<String, i64>,
    /// Numbers that are not whole numbers in `i64`'s range (`1e30`, `0.117`), as JSON writes them
    /// (`1e+30`), by key.
    /// `memory_stats()` figures never are: one the replay produces is reported as a mismatch
    /// ([`StatsCheck::unreadable`]); others (a recording script's `wall_s`) are ignored like any
    /// key the replay does not produce.
    pub unreadable: BTreeMap<String, String>,
    /// Entries whose value is not a number at all (a string such as `"1024"`, a bool, `null`, a
    /// list), as JSON writes them, by key. One the replay produces is reported like a number that
    /// is not whole ([`StatsCheck::unreadable`]); others (the device name) are ignored, and they do
    /// not count as figures of the record.
    pub non_numbers: BTreeMap<String, String>,
    /// Per device, when the file has a `"devices"` map: each entry is that device's
    /// `memory_stats(d)` (its own `devices` map is empty).
    pub devices: BTreeMap<usize, ExpectedStats>,
}

impl ExpectedStats {
    /// Expected figures given directly (from another allocator's [`to_flat`] statistics, say).
    ///
    /// [`to_flat`]: tensormem_cuda_alloc::stats::MemoryStats::to_flat
    #[must_use]
    pub fn from_figures(figures: BTreeMap<String, i64>) -> ExpectedStats {
        ExpectedStats {
            figures,
            ..ExpectedStats::default()
        }
    }

    /// The largest `*.stats.json` read (PyTorch's are about 2 kB).
    pub const MAX_FILE_BYTES: u64 = 16 << 20;

    /// Reads the JSON object `json.dumps(torch.cuda.memory_stats())` writes.
    ///
    /// # Errors
    /// [`Error::ExpectedStats`] when the text is not a JSON object, or holds no number at all.
    pub fn from_json(text: &str) -> Result<ExpectedStats> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::ExpectedStats {
                reason: e.to_string(),
            })?;
        let object = value.as_object().ok_or_else(|| Error::ExpectedStats {
            reason: "expected a JSON object of memory_stats() keys".to_owned(),
        })?;
        let expected = ExpectedStats::from_object(object)?;
        if expected.figures.is_empty()
            && expected.unreadable.is_empty()
            && expected.devices.is_empty()
        {
            return Err(Error::ExpectedStats {
                reason: "no memory_stats() figure in it (expected what \
                         json.dumps(torch.cuda.memory_stats()) writes)"
                    .to_owned(),
            });
        }
        Ok(expected)
    }

    /// The numbers of one `memory_stats()` object, and its `"devices"` map if it has one.
    fn from_object(object: &serde_json::Map<String, serde_json::Value>) -> Result<ExpectedStats> {
        let mut expected = ExpectedStats::default();
        for (key, value) in object {
            let serde_json::Value::Number(number) = value else {
                if key != "devices" {
                    expected.non_numbers.insert(key.clone(), value.to_string());
                }
                continue;
            };
            if let Some(figure) = number.as_i64() {
                expected.figures.insert(key.clone(), figure);
            } else {
                expected.unreadable.insert(key.clone(), number.to_string());
            }
        }
        if let Some(map) = object.get("devices") {
            let map = map.as_object().ok_or_else(|| Error::ExpectedStats {
                reason: "\"devices\" must map device indices to memory_stats(d) objects".to_owned(),
            })?;
            for (key, value) in map {
                let device: usize = key.parse().map_err(|_| Error::ExpectedStats {
                    reason: format!("\"devices\" has key '{key}', not a device index"),
                })?;
                let stats = value
                    .as_object()
                    .filter(|stats| !stats.contains_key("devices"))
                    .ok_or_else(|| Error::ExpectedStats {
                        reason: format!("\"devices\".\"{key}\" is not a memory_stats() object"),
                    })?;
                expected
                    .devices
                    .insert(device, ExpectedStats::from_object(stats)?);
            }
        }
        Ok(expected)
    }

    /// The figures to check device `device` against: its entry of the `"devices"` map, else the top
    /// level for device 0 (what `memory_stats()` with no argument reports), else nothing.
    #[must_use]
    pub fn for_device(&self, device: usize) -> Option<&ExpectedStats> {
        match self.devices.get(&device) {
            Some(figures) => Some(figures),
            None if device == 0 && !(self.figures.is_empty() && self.unreadable.is_empty()) => {
                Some(self)
            }
            None => None,
        }
    }

    /// Reads a `*.stats.json` file (see [`from_json`](Self::from_json)).
    ///
    /// # Errors
    /// [`Error::ExpectedStats`] when the file cannot be read, is larger than
    /// [`MAX_FILE_BYTES`](Self::MAX_FILE_BYTES) (a file that never ends, such as `/dev/zero`, is
    /// refused, not read forever), or as [`from_json`](Self::from_json).
    pub fn read_file(path: impl AsRef<Path>) -> Result<ExpectedStats> {
        let path = path.as_ref();
        let cannot_read = |e: std::io::Error| Error::ExpectedStats {
            reason: format!("cannot read {}: {e}", path.display()),
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|file| {
                file.take(Self::MAX_FILE_BYTES + 1)
                    .read_to_string(&mut text)
            })
            .map_err(cannot_read)?;
        if text.len() as u64 > Self::MAX_FILE_BYTES {
            return Err(Error::ExpectedStats {
                reason: format!(
                    "{} is larger than {} MiB; memory_stats() files are a few kB",
                    path.display(),
                    Self::MAX_FILE_BYTES >> 20
                ),
            });
        }
        Self::from_json(&text).map_err(|e| match e {
            Error::ExpectedStats { reason } => Error::ExpectedStats {
                reason: format!("{}: {reason}", path.display()),
            },
            other => other,
        })
    }
}

/// A statistic whose replayed value differs from the recorded one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatMismatch {
    /// The flat key.
    pub key: String,
    /// The replay's value.
    pub replayed: i64,
    /// PyTorch's value.
    pub recorded: i64,
}

/// The comparison of the final statistics with [`ExpectedStats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsCheck {
    /// Figures in the record.
    pub recorded: usize,
    /// Figures compared (those both sides have). Zero means the record confirmed nothing: the
    /// check then fails (see [`Check::matches`]).
    pub compared: usize,
    /// Figures that differ, by key.
    pub mismatches: Vec<StatMismatch>,
    /// Figures the replay produces whose recorded value is not a whole number in `i64`'s range, or
    /// not a number at all (a string): `(key, recorded value as written)`. They cannot match.
    pub unreadable: Vec<(String, String)>,
    /// Figures that differ by what the trace cannot show, not counted as mismatches (see
    /// [`StatsCheck::UNDETERMINED`]): the replay reproduced what the trace records, and the rest
    /// rests on calls that left no event.
    pub undetermined: Vec<StatMismatch>,
}

impl StatsCheck {
    /// Figures the trace only bounds from below, with why. `num_sync_all_streams` counts every
    /// synchronization of `release_cached_blocks`: the trace shows those that released a segment
    /// (or ended in an `oom`), but `torch.cuda.empty_cache()` that finds nothing to release (as the
    /// one `torch.cuda.graph` makes when a capture begins often does) records no event. A replay
    /// that synchronized at most as often as PyTorch agrees with the trace.
    pub const UNDETERMINED: [(&'static str, &'static str); 1] = [(
        "num_sync_all_streams",
        "torch.cuda.empty_cache() calls (one per CUDA graph capture) that released nothing leave \
         no event in the trace",
    )];

    /// Why `key` is undetermined, if it is one of [`UNDETERMINED`](Self::UNDETERMINED).
    #[must_use]
    pub fn undetermined_reason(key: &str) -> Option<&'static str> {
        Self::UNDETERMINED
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, why)| *why)
    }

    pub(crate) fn compare(replayed: &BTreeMap<String, i64>, expected: &ExpectedStats) -> Self {
        let mut check = StatsCheck {
            recorded: expected.figures.len() + expected.unreadable.len(),
            ..StatsCheck::default()
        };
        for (key, written) in &expected.unreadable {
            if replayed.contains_key(key) {
                check.compared += 1;
                check.unreadable.push((key.clone(), written.clone()));
            }
        }
        for (key, written) in &expected.non_numbers {
            if replayed.contains_key(key) {
                check.recorded += 1;
                check.compared += 1;
                check.unreadable.push((key.clone(), written.clone()));
            }
        }
        for (key, &recorded) in &expected.figures {
            if let Some(&value) = replayed.get(key) {
                check.compared += 1;
                if value < recorded && Self::undetermined_reason(key).is_some() {
                    check.undetermined.push(StatMismatch {
                        key: key.clone(),
                        replayed: value,
                        recorded,
                    });
                } else if value != recorded {
                    check.mismatches.push(StatMismatch {
                        key: key.clone(),
                        replayed: value,
                        recorded,
                    });
                }
            }
        }
        check
    }
}

/// The comparison of the final segments with the snapshot's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SegmentCheck {
    /// Segments in the snapshot.
    pub recorded: usize,
    /// Blocks in the snapshot.
    pub blocks: usize,
    /// What differs, one line each (at most [`SegmentCheck::MAX_REPORTED`]).
    pub mismatches: Vec<String>,
}

impl SegmentCheck {
    /// The most differences listed.
    pub const MAX_REPORTED: usize = 20;

    /// Compares `replayed` with `recorded` (both sorted by address): addresses, sizes, streams,
    /// pools, expandability, and each block's address, size and state; requested sizes of active
    /// blocks (a free block's requested size is stale in PyTorch's snapshots).
    pub(crate) fn compare(replayed: &[Segment], recorded: &[Segment]) -> Self {
        let mut check = SegmentCheck {
            recorded: recorded.len(),
            blocks: recorded.iter().map(|s| s.blocks.len()).sum(),
            mismatches: Vec::new(),
        };
        let mut note = |line: String| {
            if check.mismatches.len() < Self::MAX_REPORTED {
                check.mismatches.push(line);
            }
        };
        if replayed.len() != recorded.len() {
            note(format!(
                "{} segments replayed, {} recorded",
                replayed.len(),
                recorded.len()
            ));
        }
        let by_addr: BTreeMap<u64, &Segment> = replayed.iter().map(|s| (s.address, s)).collect();
        for want in recorded {
            let Some(have) = by_addr.get(&want.address) else {
                note(format!(
                    "segment {:#x} ({}) recorded, not replayed",
                    want.address,
                    format_size(want.total_size)
                ));
                continue;
            };
            let shape = |s: &Segment| {
                (
                    s.total_size,
                    s.stream,
                    s.segment_type,
                    s.is_expandable,
                    s.allocated_size,
                    s.active_size,
                    s.segment_pool_id,
                )
            };
            if shape(have) != shape(want) {
                note(format!(
                    "segment {:#x}: replayed (size, stream, pool, expandable, allocated, active, \
                     pool id) {:?}, recorded {:?}",
                    want.address,
                    shape(have),
                    shape(want)
                ));
                continue;
            }
            let blocks = |s: &Segment| -> Vec<(u64, u64, BlockState, Option<u64>)> {
                s.blocks
                    .iter()
                    .map(|b| {
                        let requested =
                            (b.state != BlockState::Inactive).then_some(b.requested_size);
                        (b.address, b.size, b.state, requested)
                    })
                    .collect()
            };
            let (have_blocks, want_blocks) = (blocks(have), blocks(want));
            if have_blocks != want_blocks {
                let first = have_blocks
                    .iter()
                    .zip(&want_blocks)
                    .position(|(h, w)| h != w)
                    .unwrap_or(have_blocks.len().min(want_blocks.len()));
                note(format!(
                    "segment {:#x}: block {first} replayed {:?}, recorded {:?}",
                    want.address,
                    have_blocks.get(first),
                    want_blocks.get(first)
                ));
            }
        }
        check
    }
}

/// The first point where a replay under the recorded configuration left PyTorch's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// The device.
    pub device: usize,
    /// Index of the trace event (in `device_traces[device]`).
    pub event: usize,
    /// What differed.
    pub kind: DivergenceKind,
}

/// What differed at a [`Divergence`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DivergenceKind {
    /// An allocation landed elsewhere.
    Address {
        /// The size asked for.
        size: u64,
        /// The stream.
        stream: StreamId,
        /// Where PyTorch put it.
        recorded: u64,
        /// Where the replay put it (0 when the replay could not allocate it).
        replayed: u64,
    },
    /// After an allocation, the bytes reserved from the device differ.
    Reserved {
        /// PyTorch's figure (from the trace's segment events).
        recorded: u64,
        /// The replay's.
        replayed: u64,
    },
    /// The recorded run ran out of memory here; the replay did not.
    OomNotReproduced {
        /// The size asked for.
        size: u64,
    },
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} event {}: ", self.device, self.event)?;
        match &self.kind {
            DivergenceKind::Address {
                size,
                stream,
                recorded,
                replayed,
            } => write!(
                f,
                "allocation of {size} bytes on stream {stream}: PyTorch at {recorded:#x}, replay at \
                 {replayed:#x}"
            ),
            DivergenceKind::Reserved { recorded, replayed } => write!(
                f,
                "reserved bytes after the allocation: PyTorch {recorded}, replay {replayed}"
            ),
            DivergenceKind::OomNotReproduced { size } => write!(
                f,
                "PyTorch ran out of memory allocating {size} bytes, the replay did not"
            ),
        }
    }
}

/// How a replay under the recorded configuration compares with the record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Check {
    /// Allocations whose address and reserved bytes were compared.
    pub allocations: u64,
    /// Allocations that landed at another address than PyTorch's.
    pub address_mismatches: u64,
    /// Allocations after which the reserved bytes differed.
    pub reserved_mismatches: u64,
    /// The first divergence, if any.
    pub divergence: Option<Divergence>,
    /// The final segments against the snapshot's (when the snapshot has segments for the device).
    pub segments: Option<SegmentCheck>,
    /// The final statistics against [`ExpectedStats`], when given.
    pub stats: Option<StatsCheck>,
}

impl Check {
    /// Whether everything compared matched. Statistics that were given but of which no figure
    /// could be compared do not match: a record that confirms nothing is not a match.
    #[must_use]
    pub fn matches(&self) -> bool {
        self.divergence.is_none()
            && self
                .segments
                .as_ref()
                .is_none_or(|s| s.mismatches.is_empty())
            && self.stats.as_ref().is_none_or(|s| {
                s.mismatches.is_empty() && s.unreadable.is_empty() && s.compared > 0
            })
    }

    pub(crate) fn diverged(&mut self, device: usize, event: usize, kind: DivergenceKind) {
        if self.divergence.is_none() {
            self.divergence = Some(Divergence {
                device,
                event,
                kind,
            });
        }
    }
}
