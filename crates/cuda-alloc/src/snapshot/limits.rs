//! [`ReadLimits`]: how much reading one snapshot may take, so that a hostile or broken file gets a
//! typed error instead of exhausting memory or reading forever.

/// Bounds on reading a snapshot (feature `snapshot-io`). Each exceeded bound is a
/// [`SnapshotError::TooLarge`](super::SnapshotError::TooLarge) naming it; raise a bound only for
/// files you trust.
///
/// The defaults admit snapshots far larger than PyTorch writes with its default
/// `_record_memory_history(max_entries=100000)` (such a pickle is tens of MB and builds about 0.3
/// values per byte) while keeping the reader's memory near 2 GiB at worst:
///
/// ```
/// use tensormem_cuda_alloc::snapshot::{ReadLimits, Snapshot, SnapshotError};
///
/// // A pickle of 10 000 small ints in one list: 20 kB that builds 10 001 values.
/// let mut bomb = b"\x80\x04]\x94(".to_vec();
/// bomb.extend(std::iter::repeat_n(*b"K\x01", 10_000).flatten());
/// bomb.extend(b"e.");
/// let limits = ReadLimits::DEFAULT.with_max_values(1_000);
/// let e = Snapshot::from_pickle_bytes_with_limits(&bomb, &limits).unwrap_err();
/// assert!(matches!(e, SnapshotError::TooLarge { limit: "max_values", .. }), "{e}");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadLimits {
    /// The most bytes read from a file or stream (default 1 GiB). `/dev/zero` or a FIFO that never
    /// ends is refused once this many bytes came (or at once, when its first bytes are neither a
    /// pickle, gzip nor JSON).
    pub max_input_bytes: u64,
    /// The most bytes a gzip-compressed snapshot may expand to (default 1 GiB): decompression
    /// stops there, so a small "gzip bomb" costs at most this much memory.
    pub max_decompressed_bytes: u64,
    /// The most values the pickle may build (default 2^25, about 33.5 million): every number,
    /// string, `None` and container counts one, copies made through the pickle's memo count again,
    /// and strings and bytes count one more per 32 bytes of content. Each value takes 32 to 48
    /// bytes while being read, so this bounds the reader's memory whatever the pickle's opcodes.
    pub max_values: u64,
}

impl ReadLimits {
    /// The default limits (see the fields).
    pub const DEFAULT: ReadLimits = ReadLimits {
        max_input_bytes: 1 << 30,
        max_decompressed_bytes: super::MAX_DECOMPRESSED_BYTES,
        max_values: 1 << 25,
    };

    /// These limits with [`max_input_bytes`](Self::max_input_bytes) set to `bytes`.
    #[must_use]
    pub const fn with_max_input_bytes(mut self, bytes: u64) -> ReadLimits {
        self.max_input_bytes = bytes;
        self
    }

    /// These limits with [`max_decompressed_bytes`](Self::max_decompressed_bytes) set to `bytes`.
    #[must_use]
    pub const fn with_max_decompressed_bytes(mut self, bytes: u64) -> ReadLimits {
        self.max_decompressed_bytes = bytes;
        self
    }

    /// These limits with [`max_values`](Self::max_values) set to `values`.
    #[must_use]
    pub const fn with_max_values(mut self, values: u64) -> ReadLimits {
        self.max_values = values;
        self
    }

    /// No limits beyond the machine's memory: only for files you produced yourself.
    pub const UNLIMITED: ReadLimits = ReadLimits {
        max_input_bytes: u64::MAX,
        max_decompressed_bytes: u64::MAX,
        max_values: u64::MAX,
    };
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits::DEFAULT
    }
}
