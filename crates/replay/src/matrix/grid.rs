//! The configurations a [`SettingsMatrix`](super::SettingsMatrix) replays: values for four of the
//! allocator's settings, combined over the recorded configuration, with the combinations that
//! cannot behave differently left out.

use std::fmt;

use tensormem_cuda_alloc::config::{AllocatorConfig, ConfigError, MB, ROUNDUP_POWER2_INTERVALS};
use tensormem_cuda_alloc::size::{allocation_size, LARGE_BUFFER};

/// One `roundup_power2_divisions` table: divisions per power-of-two size interval.
type Divisions = [usize; ROUNDUP_POWER2_INTERVALS];

/// The smallest `max_split_size_mb` value a default grid tries: the first power of two PyTorch
/// accepts (it refuses values under 20 MiB). At 20 MiB itself the 20 MiB segments that hold
/// requests of 1 to 10 MiB would be oversize and never serve such a request whole again.
pub const MIN_GRID_SPLIT_SIZE: usize = 32 * MB;

// PyTorch refuses `max_split_size_mb` values under the large segment size.
const _: () = assert!(MIN_GRID_SPLIT_SIZE >= LARGE_BUFFER);

/// The `roundup_power2_divisions` values a default grid tries (one value for every size interval;
/// `0` is off). `1` is left out: PyTorch's `round_size` rounds to divisions only when there are
/// more than one, so `1` behaves as `0`.
pub const GRID_ROUNDUP_DIVISIONS: [usize; 5] = [0, 2, 4, 8, 16];

/// The `garbage_collection_threshold` values a default grid tries under a memory fraction (`0.0`
/// is off).
pub const GRID_GC_THRESHOLDS: [f64; 3] = [0.0, 0.6, 0.8];

/// A setting a matrix can vary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Setting {
    /// `expandable_segments`: `False`, `True`.
    ExpandableSegments,
    /// `max_split_size_mb`: unlimited, and powers of two from [`MIN_GRID_SPLIT_SIZE`] up to the
    /// largest segment a request of the trace makes.
    MaxSplitSize,
    /// `roundup_power2_divisions`: [`GRID_ROUNDUP_DIVISIONS`].
    RoundupPower2Divisions,
    /// `garbage_collection_threshold`: [`GRID_GC_THRESHOLDS`], under a memory fraction only.
    GarbageCollectionThreshold,
}

impl Setting {
    /// Every setting, in the order the matrix combines them.
    pub const ALL: [Setting; 4] = [
        Setting::ExpandableSegments,
        Setting::MaxSplitSize,
        Setting::RoundupPower2Divisions,
        Setting::GarbageCollectionThreshold,
    ];

    /// The key `PYTORCH_CUDA_ALLOC_CONF` names it by.
    #[must_use]
    pub const fn key(self) -> &'static str {
        match self {
            Setting::ExpandableSegments => "expandable_segments",
            Setting::MaxSplitSize => "max_split_size_mb",
            Setting::RoundupPower2Divisions => "roundup_power2_divisions",
            Setting::GarbageCollectionThreshold => "garbage_collection_threshold",
        }
    }

    /// The setting named by `key` (as [`key`](Self::key) writes it).
    #[must_use]
    pub fn from_key(key: &str) -> Option<Setting> {
        Setting::ALL.into_iter().find(|s| s.key() == key.trim())
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// Why a grid cannot be built as asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GridError {
    /// A name that is not one of [`Setting::ALL`]'s keys.
    #[error(
        "'{name}' is not a setting the matrix varies; use expandable_segments, max_split_size_mb, \
         roundup_power2_divisions or garbage_collection_threshold"
    )]
    UnknownSetting {
        /// The name given.
        name: String,
    },
    /// A value the setting does not take.
    #[error("invalid value '{value}' for {setting}: {source}")]
    Value {
        /// The setting.
        setting: Setting,
        /// The value as written.
        value: String,
        /// The configuration parser's error.
        #[source]
        source: ConfigError,
    },
    /// No value given.
    #[error("no value given for {setting}")]
    NoValues {
        /// The setting.
        setting: Setting,
    },
    /// `garbage_collection_threshold` asked for under no memory fraction, where it does nothing.
    #[error(
        "garbage_collection_threshold acts only under a memory fraction (per_process_memory_fraction \
         or torch.cuda.set_per_process_memory_fraction), and the recorded run has none: every value \
         would replay alike"
    )]
    GcWithoutFraction,
}

/// The values of each varied setting; settings not varied keep the recorded configuration's value.
///
/// Built for a trace by [`SettingsMatrix::grid`](super::SettingsMatrix::grid); values can be
/// replaced with [`set_values`](Self::set_values). Each setting's values are kept sorted (off or
/// unlimited first) and always include the recorded value, so that the recorded configuration is
/// one of the grid's points.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    recorded: AllocatorConfig,
    expandable_segments: Vec<bool>,
    max_split_size: Vec<usize>,
    roundup_power2_divisions: Vec<Divisions>,
    garbage_collection_threshold: Vec<f64>,
    /// Why a setting asked for is not varied, or which values were left out and why.
    pub notes: Vec<String>,
}

/// One configuration of a grid.
#[derive(Clone, Debug, PartialEq)]
pub struct GridPoint {
    /// The whole configuration replayed.
    pub config: AllocatorConfig,
    /// The `--config` string (`PYTORCH_CUDA_ALLOC_CONF` syntax) that, applied over the recorded
    /// configuration as [`Replay::what_if_config`](crate::Replay::what_if_config) applies it, gives
    /// [`config`](Self::config): it names the four settings wherever they differ from PyTorch's
    /// defaults (applying a string resets three of them), and `expandable_segments:False` when the
    /// recorded configuration has them on.
    pub what_if: String,
}

impl Grid {
    /// The grid of `settings` for a trace whose recorded configuration is `recorded` (memory
    /// fraction included, implied or not) and whose largest request is `largest_request` bytes.
    pub(super) fn for_trace(
        recorded: &AllocatorConfig,
        largest_request: u64,
        settings: &[Setting],
    ) -> Grid {
        let mut grid = Grid {
            recorded: recorded.clone(),
            expandable_segments: vec![recorded.expandable_segments],
            max_split_size: vec![recorded.max_split_size],
            roundup_power2_divisions: vec![recorded.roundup_power2_divisions],
            garbage_collection_threshold: vec![recorded.garbage_collection_threshold],
            notes: Vec::new(),
        };
        for &setting in settings {
            match setting {
                Setting::ExpandableSegments => grid.expandable_segments = vec![false, true],
                Setting::MaxSplitSize => {
                    let largest = largest_segment(largest_request);
                    grid.max_split_size = split_sizes(largest);
                    if grid.max_split_size.len() == 1 {
                        grid.notes.push(format!(
                            "max_split_size_mb not varied: the trace's largest request makes a \
                             segment of {} MiB, below the smallest value tried ({} MiB), so every \
                             value would replay as unlimited",
                            largest / MB,
                            MIN_GRID_SPLIT_SIZE / MB
                        ));
                    }
                }
                Setting::RoundupPower2Divisions => {
                    grid.roundup_power2_divisions = GRID_ROUNDUP_DIVISIONS
                        .iter()
                        .map(|&d| [d; ROUNDUP_POWER2_INTERVALS])
                        .collect();
                }
                Setting::GarbageCollectionThreshold => {
                    if has_fraction(recorded) {
                        grid.garbage_collection_threshold = GRID_GC_THRESHOLDS.to_vec();
                    } else {
                        grid.notes.push(
                            "garbage_collection_threshold not varied: it acts only under a memory \
                             fraction, and the recorded run has none"
                                .to_owned(),
                        );
                    }
                }
            }
        }
        grid.normalize();
        grid
    }

    /// Replaces the values of `setting` with `values`: a comma-separated list in
    /// `PYTORCH_CUDA_ALLOC_CONF` syntax (`True,False`; `unlimited,64,128`; `0,4`; `off,0.7`). The
    /// setting is then varied over them (and the recorded value).
    ///
    /// # Errors
    /// [`GridError::Value`] for a value the configuration parser refuses;
    /// [`GridError::NoValues`] for an empty list; [`GridError::GcWithoutFraction`] for
    /// `garbage_collection_threshold` when the recorded run has no memory fraction.
    pub fn set_values(&mut self, setting: Setting, values: &str) -> Result<(), GridError> {
        let mut configs = Vec::new();
        for value in values.split(',').map(str::trim).filter(|v| !v.is_empty()) {
            let text = match (setting, value) {
                (Setting::MaxSplitSize, "unlimited") => String::new(),
                (Setting::GarbageCollectionThreshold, "off" | "0") => String::new(),
                // The parser refuses a single 0 (as PyTorch does); it is the default, off.
                (Setting::RoundupPower2Divisions, "off" | "0") => String::new(),
                _ => format!("{}:{value}", setting.key()),
            };
            let config = AllocatorConfig::parse(&text).map_err(|source| GridError::Value {
                setting,
                value: value.to_owned(),
                source,
            })?;
            configs.push(config);
        }
        if configs.is_empty() {
            return Err(GridError::NoValues { setting });
        }
        match setting {
            Setting::ExpandableSegments => {
                self.expandable_segments = configs.iter().map(|c| c.expandable_segments).collect();
            }
            Setting::MaxSplitSize => {
                self.max_split_size = configs.iter().map(|c| c.max_split_size).collect();
            }
            Setting::RoundupPower2Divisions => {
                self.roundup_power2_divisions =
                    configs.iter().map(|c| c.roundup_power2_divisions).collect();
            }
            Setting::GarbageCollectionThreshold => {
                if !has_fraction(&self.recorded) {
                    return Err(GridError::GcWithoutFraction);
                }
                self.garbage_collection_threshold = configs
                    .iter()
                    .map(|c| c.garbage_collection_threshold)
                    .collect();
            }
        }
        let key = setting.key();
        self.notes.retain(|n| !n.starts_with(key));
        self.normalize();
        Ok(())
    }

    /// The values of `setting`, as `PYTORCH_CUDA_ALLOC_CONF` writes them (`unlimited` for an
    /// unlimited `max_split_size_mb`, `off` for garbage collection off).
    #[must_use]
    pub fn values(&self, setting: Setting) -> Vec<String> {
        match setting {
            Setting::ExpandableSegments => self
                .expandable_segments
                .iter()
                .map(|&on| if on { "True" } else { "False" }.to_owned())
                .collect(),
            Setting::MaxSplitSize => self
                .max_split_size
                .iter()
                .map(|&s| {
                    if s == usize::MAX {
                        "unlimited".to_owned()
                    } else {
                        (s / MB).to_string()
                    }
                })
                .collect(),
            Setting::RoundupPower2Divisions => self
                .roundup_power2_divisions
                .iter()
                .map(divisions_text)
                .collect(),
            Setting::GarbageCollectionThreshold => self
                .garbage_collection_threshold
                .iter()
                .map(|&t| {
                    if t > 0.0 {
                        t.to_string()
                    } else {
                        "off".to_owned()
                    }
                })
                .collect(),
        }
    }

    /// Whether `setting` takes more than one value.
    #[must_use]
    pub fn varies(&self, setting: Setting) -> bool {
        self.values(setting).len() > 1
    }

    /// The grid's configurations, the recorded one first, and how many combinations were left out
    /// because they replay exactly as one kept: `roundup_power2_divisions` of 1 rounds as 0 does
    /// (PyTorch's `round_size` rounds to divisions only when there are more than one), and
    /// `garbage_collection_threshold` acts only under a memory fraction.
    #[must_use]
    pub fn points(&self) -> (Vec<GridPoint>, usize) {
        let mut points = vec![self.point(self.recorded.clone())];
        let mut effects = vec![effect(&self.recorded)];
        let mut left_out = 0;
        for &expandable in &self.expandable_segments {
            for &split in &self.max_split_size {
                for divisions in &self.roundup_power2_divisions {
                    for &gc in &self.garbage_collection_threshold {
                        let mut config = self.recorded.clone();
                        config.expandable_segments = expandable;
                        config.max_split_size = split;
                        config.roundup_power2_divisions = *divisions;
                        config.garbage_collection_threshold = gc;
                        let key = effect(&config);
                        if effects.contains(&key) {
                            if config != self.recorded {
                                left_out += 1;
                            }
                            continue;
                        }
                        effects.push(key);
                        points.push(self.point(config));
                    }
                }
            }
        }
        (points, left_out)
    }

    /// `config` with its `--config` string.
    fn point(&self, config: AllocatorConfig) -> GridPoint {
        let what_if = what_if(&config, &self.recorded);
        GridPoint { config, what_if }
    }

    /// Sorts each setting's values (off first) and adds the recorded value where it is missing.
    fn normalize(&mut self) {
        let r = &self.recorded;
        self.expandable_segments.push(r.expandable_segments);
        self.expandable_segments.sort_unstable();
        self.expandable_segments.dedup();
        self.max_split_size.push(r.max_split_size);
        // Unlimited (usize::MAX) first, then ascending.
        self.max_split_size
            .sort_unstable_by_key(|&s| s.wrapping_add(1));
        self.max_split_size.dedup();
        self.roundup_power2_divisions
            .push(r.roundup_power2_divisions);
        self.roundup_power2_divisions
            .sort_unstable_by_key(|d| (d.iter().any(|&v| v != d[0]), d[0], *d));
        self.roundup_power2_divisions.dedup();
        self.garbage_collection_threshold
            .push(r.garbage_collection_threshold);
        self.garbage_collection_threshold.sort_by(f64::total_cmp);
        self.garbage_collection_threshold.dedup();
    }
}

/// Whether `config` limits the process to a memory fraction, which garbage collection needs.
fn has_fraction(config: &AllocatorConfig) -> bool {
    config.per_process_memory_fraction < 1.0
}

/// What a configuration does, for telling combinations apart: `config` with the settings that
/// cannot act written as off. Two configurations with the same effect replay alike:
///
/// - `roundup_power2_divisions` of 1 rounds as 0 does (PyTorch's `round_size` rounds to
///   divisions only when there are more than one);
/// - `garbage_collection_threshold` acts only under a memory fraction (PyTorch collects only when
///   `set_fraction`).
///
/// Under `expandable_segments` the collector has little to release (only whole segments that are
/// not expandable, those of pools with an allocator of their own), but the replay reads a recorded
/// run of releases followed by a new segment as the collector's own under a threshold and as
/// `empty_cache()` otherwise, so those combinations can replay differently and are kept.
fn effect(config: &AllocatorConfig) -> AllocatorConfig {
    let mut effect = config.clone();
    for divisions in &mut effect.roundup_power2_divisions {
        if *divisions == 1 {
            *divisions = 0;
        }
    }
    if !has_fraction(config) {
        effect.garbage_collection_threshold = 0.0;
    }
    effect
}

/// The string that, applied over `recorded` (which resets `max_split_size_mb`,
/// `roundup_power2_divisions` and `garbage_collection_threshold` to their defaults unless named),
/// gives `config`, whose other settings are `recorded`'s.
fn what_if(config: &AllocatorConfig, recorded: &AllocatorConfig) -> String {
    let named = AllocatorConfig {
        expandable_segments: config.expandable_segments,
        max_split_size: config.max_split_size,
        roundup_power2_divisions: config.roundup_power2_divisions,
        garbage_collection_threshold: config.garbage_collection_threshold,
        ..AllocatorConfig::default()
    };
    let mut text = named.to_string();
    if recorded.expandable_segments && !config.expandable_segments {
        if !text.is_empty() {
            text.push(',');
        }
        text.push_str("expandable_segments:False");
    }
    text
}

/// A `roundup_power2_divisions` table as `PYTORCH_CUDA_ALLOC_CONF` writes it (`0` when off).
fn divisions_text(divisions: &Divisions) -> String {
    let only = AllocatorConfig {
        roundup_power2_divisions: *divisions,
        ..AllocatorConfig::default()
    };
    only.to_string()
        .strip_prefix("roundup_power2_divisions:")
        .map_or_else(|| "0".to_owned(), str::to_owned)
}

/// The largest segment a request of `size` bytes makes (without `roundup_power2_divisions`).
fn largest_segment(size: u64) -> usize {
    let size = usize::try_from(size).unwrap_or(usize::MAX / 2);
    allocation_size(size.next_multiple_of(512))
}

/// `max_split_size` values for a trace whose largest segment is `largest` bytes: unlimited, and
/// the powers of two from [`MIN_GRID_SPLIT_SIZE`] up to `largest`. Without expandable segments
/// no block is larger than its segment, so a larger value acts as unlimited does.
fn split_sizes(largest: usize) -> Vec<usize> {
    let mut sizes = vec![usize::MAX];
    let mut size = MIN_GRID_SPLIT_SIZE;
    while size <= largest {
        sizes.push(size);
        size *= 2;
    }
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> AllocatorConfig {
        AllocatorConfig::parse(text).unwrap()
    }

    #[test]
    fn split_sizes_stop_at_the_largest_segment() {
        assert_eq!(split_sizes(20 * MB), vec![usize::MAX]);
        assert_eq!(split_sizes(100 * MB), vec![usize::MAX, 32 * MB, 64 * MB]);
        assert_eq!(largest_segment(5 << 20), LARGE_BUFFER);
        assert_eq!(largest_segment((300 << 20) + 1), 302 * MB);
    }

    #[test]
    fn every_point_is_its_what_if_string_over_the_recorded_configuration() {
        for recorded in [
            "",
            "expandable_segments:True",
            "max_split_size_mb:32,per_process_memory_fraction:0.5",
            "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,per_process_memory_fraction:0.5",
        ] {
            let recorded = config(recorded);
            let grid = Grid::for_trace(&recorded, 200 << 20, &Setting::ALL);
            let (points, _) = grid.points();
            assert_eq!(points[0].config, recorded);
            for point in &points {
                let mut applied = recorded.clone();
                applied.apply(&point.what_if).unwrap();
                assert_eq!(applied, point.config, "{}", point.what_if);
            }
        }
    }

    #[test]
    fn combinations_that_cannot_differ_are_left_out() {
        let no_fraction = Grid::for_trace(&config(""), 40 << 20, &Setting::ALL);
        assert!(!no_fraction.varies(Setting::GarbageCollectionThreshold));
        assert!(no_fraction.notes[0].starts_with("garbage_collection_threshold"));
        // expandable x split (unlimited, 32) x divisions (0, 2, 4, 8, 16).
        let (points, left_out) = no_fraction.points();
        assert_eq!((points.len(), left_out), (2 * 2 * 5, 0));

        let fraction = config("per_process_memory_fraction:0.5");
        let mut grid = Grid::for_trace(&fraction, 40 << 20, &Setting::ALL);
        let (points, left_out) = grid.points();
        assert_eq!((points.len(), left_out), (2 * 2 * 5 * 3, 0));
        grid.set_values(Setting::RoundupPower2Divisions, "0,1")
            .unwrap();
        let (points, left_out) = grid.points();
        assert!(points
            .iter()
            .all(|p| p.config.roundup_power2_divisions[0] == 0));
        assert_eq!((points.len(), left_out), (2 * 2 * 3, 2 * 2 * 3));
    }

    #[test]
    fn values_are_read_as_the_configuration_parser_reads_them() {
        let mut grid = Grid::for_trace(&config("max_split_size_mb:32"), 1 << 30, &[]);
        assert!(!grid.varies(Setting::MaxSplitSize));
        grid.set_values(Setting::MaxSplitSize, "unlimited, 128")
            .unwrap();
        assert_eq!(
            grid.values(Setting::MaxSplitSize),
            ["unlimited", "32", "128"]
        );
        assert!(matches!(
            grid.set_values(Setting::MaxSplitSize, "8"),
            Err(GridError::Value { .. })
        ));
        assert!(matches!(
            grid.set_values(Setting::ExpandableSegments, ""),
            Err(GridError::NoValues { .. })
        ));
        assert_eq!(
            grid.set_values(Setting::GarbageCollectionThreshold, "0.7"),
            Err(GridError::GcWithoutFraction)
        );
        grid.set_values(Setting::RoundupPower2Divisions, "off,4")
            .unwrap();
        assert_eq!(grid.values(Setting::RoundupPower2Divisions), ["0", "4"]);
    }
}
