//! The settings the allocator reads on every call, kept as atomics so that reading them takes no lock.
//!
//! [`AllocatorConfig`] is the parsed configuration; [`Settings`] holds the values the policy code
//! consults (split limits, rounding, garbage collection, expandable segments) in relaxed atomics that
//! are written only when the configuration changes, plus the whole configuration under a mutex for
//! snapshots. A change takes effect for calls that start after it, as in PyTorch.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::config::{roundup_interval, AllocatorConfig, Backend, ROUNDUP_POWER2_INTERVALS};

/// The configuration as the allocator reads it.
#[derive(Debug)]
pub(crate) struct Settings {
    max_split_size: AtomicUsize,
    max_non_split_rounding_size: AtomicUsize,
    roundup_power2_divisions: [AtomicUsize; ROUNDUP_POWER2_INTERVALS],
    /// Whether any interval has divisions (else rounding skips the table).
    any_divisions: AtomicBool,
    /// `garbage_collection_threshold` as `f64` bits.
    garbage_collection_threshold: AtomicU64,
    expandable_segments: AtomicBool,
    release_lock_on_cudamalloc: AtomicBool,
    /// Every allocation straight to the device (`PYTORCH_NO_CUDA_MEMORY_CACHING`); not part of the
    /// configuration string.
    uncached: AtomicBool,
    /// Bumped after every change of the values above: what a decision cached against the settings
    /// (`allocator/parked.rs`) compares.
    version: AtomicU64,
    /// Whether `max_split_size` changed since the allocator was made: the oversize counts were then
    /// kept against several limits (as PyTorch keeps them) and no longer equal what the blocks
    /// add up to under the current one.
    max_split_changed: AtomicBool,
    /// The configuration these values came from.
    config: Mutex<AllocatorConfig>,
}

impl Settings {
    pub(crate) fn new(config: &AllocatorConfig) -> Self {
        let settings = Settings {
            max_split_size: AtomicUsize::new(0),
            max_non_split_rounding_size: AtomicUsize::new(0),
            roundup_power2_divisions: std::array::from_fn(|_| AtomicUsize::new(0)),
            any_divisions: AtomicBool::new(false),
            garbage_collection_threshold: AtomicU64::new(0),
            expandable_segments: AtomicBool::new(false),
            release_lock_on_cudamalloc: AtomicBool::new(false),
            uncached: AtomicBool::new(false),
            version: AtomicU64::new(0),
            max_split_changed: AtomicBool::new(false),
            config: Mutex::new(served(config)),
        };
        settings.store(config);
        settings
    }

    /// Replaces the configuration.
    pub(crate) fn set(&self, config: &AllocatorConfig) {
        let mut current = self.config.lock();
        *current = served(config);
        if self.max_split_size() != config.max_split_size {
            self.max_split_changed.store(true, Relaxed);
        }
        self.store(config);
    }

    /// The limit the oversize counts were all kept against: `max_split_size`, unless it changed
    /// since the allocator was made.
    pub(crate) fn oversize_limit(&self) -> Option<usize> {
        (!self.max_split_changed.load(Relaxed)).then(|| self.max_split_size())
    }

    fn store(&self, config: &AllocatorConfig) {
        self.max_split_size.store(config.max_split_size, Relaxed);
        self.max_non_split_rounding_size
            .store(config.max_non_split_rounding_size, Relaxed);
        for (slot, &value) in self
            .roundup_power2_divisions
            .iter()
            .zip(&config.roundup_power2_divisions)
        {
            slot.store(value, Relaxed);
        }
        self.any_divisions.store(
            config.roundup_power2_divisions.iter().any(|&d| d > 1),
            Relaxed,
        );
        self.garbage_collection_threshold
            .store(config.garbage_collection_threshold.to_bits(), Relaxed);
        self.expandable_segments
            .store(config.expandable_segments, Relaxed);
        self.release_lock_on_cudamalloc
            .store(config.release_lock_on_cudamalloc, Relaxed);
        self.version.fetch_add(1, Relaxed);
    }

    /// The number of changes so far (see the field).
    #[inline]
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Relaxed)
    }

    /// A copy of the whole configuration (its `backend` is always [`Backend::Native`]: the one that
    /// serves).
    pub(crate) fn config(&self) -> AllocatorConfig {
        self.config.lock().clone()
    }

    /// Blocks at least this large are never split (`usize::MAX`: unlimited).
    #[inline]
    pub(crate) fn max_split_size(&self) -> usize {
        self.max_split_size.load(Relaxed)
    }

    /// How much larger than a request an unsplittable block may be and still serve it.
    #[inline]
    pub(crate) fn max_non_split_rounding_size(&self) -> usize {
        self.max_non_split_rounding_size.load(Relaxed)
    }

    /// `roundup_power2_divisions` for a request of `size` bytes.
    #[inline]
    pub(crate) fn roundup_divisions_for(&self, size: usize) -> usize {
        if self.any_divisions.load(Relaxed) {
            std::hint::cold_path();
            return self.roundup_power2_divisions[roundup_interval(size)].load(Relaxed);
        }
        0
    }

    /// The garbage-collection threshold (0: off).
    #[inline]
    pub(crate) fn garbage_collection_threshold(&self) -> f64 {
        f64::from_bits(self.garbage_collection_threshold.load(Relaxed))
    }

    /// Whether new segments are expandable (never while caching is off: every allocation is then
    /// its own device allocation).
    #[inline]
    pub(crate) fn expandable_segments(&self) -> bool {
        self.expandable_segments.load(Relaxed) & !self.uncached()
    }

    /// Whether the stream's lock is let go while the device allocates a new segment.
    #[inline]
    pub(crate) fn release_lock_on_cudamalloc(&self) -> bool {
        self.release_lock_on_cudamalloc.load(Relaxed)
    }

    /// Whether caching is off: every allocation is a device allocation of its own, returned to the
    /// device when freed.
    #[inline]
    pub(crate) fn uncached(&self) -> bool {
        self.uncached.load(Relaxed)
    }

    /// Turns caching off (`true`) or on.
    pub(crate) fn set_uncached(&self, uncached: bool) {
        self.uncached.store(uncached, Relaxed);
        self.version.fetch_add(1, Relaxed);
    }
}

/// `config` as this allocator serves it: with the native backend, whatever it asked for. The fallible
/// ways in (`from_env`, `apply_settings`) refuse another backend with
/// [`ConfigError::UnsupportedBackend`](crate::config::ConfigError::UnsupportedBackend); a configuration
/// built by hand and handed to `with_config` or `set_config` gets a warning, and the settings then say
/// `native`, which is what runs.
fn served(config: &AllocatorConfig) -> AllocatorConfig {
    let mut served = config.clone();
    if served.backend != Backend::Native {
        tracing::warn!(
            backend = %served.backend,
            "this allocator is the native caching allocator; backend:{} is not implemented, the \
             native backend serves",
            served.backend
        );
        served.backend = Backend::Native;
    }
    served
}
