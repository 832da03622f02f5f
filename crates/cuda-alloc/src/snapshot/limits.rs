//! [`ReadLimits`]: how much reading one snapshot may take, so that a hostile or broken file gets a
//! typed error instead of exhausting memory or reading forever.

/// Bounds on reading a snapshot (feature `snapshot-io`). Each exceeded bound is a
/// [`SnapshotError::TooLarge`](super::SnapshotError::TooLarge) naming it; raise a bound only for
/// files you trust.
///
/// The defaults admit snapshots far larger than PyTorch writes with its default
/// `_record_memory_history(max_entries=100000)` (such a pickle is tens of MB and builds about 0.3
/// values per byte). What reading takes at most is then the sum of three bounds: the input
/// ([`max_input_bytes`](Self::max_input_bytes)), its decompressed form when it is gzip
/// ([`max_decompressed_bytes`](Self::max_decompressed_bytes)), and what the pickle reader holds
/// ([`max_memory_bytes`](Self::max_memory_bytes)); the typed snapshot made from the values comes
/// on top, and is smaller than they are. Allocations the system refuses are
/// [`SnapshotError::OutOfMemory`](super::SnapshotError::OutOfMemory), never an abort.
///
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
    /// and strings and bytes count one more per 32 bytes of content. This bounds the work; the
    /// memory is [`max_memory_bytes`](Self::max_memory_bytes)'s.
    pub max_values: u64,
    /// The most bytes the pickle reader may hold at once (default 2 GiB): every heap block it makes
    /// counts at its size as the system allocator hands it out (containers' element buffers at
    /// their capacity, each element the size of a value, 32 bytes, or of a dict entry, 64; strings;
    /// dicts' key indexes; the reader's stack and memo), growth counting the old and the new
    /// block while both exist. The input and its decompressed form are not included (see the
    /// other limits).
    pub max_memory_bytes: u64,
}

impl ReadLimits {
    /// The default limits (see the fields).
    pub const DEFAULT: ReadLimits = ReadLimits {
        max_input_bytes: 1 << 30,
        max_decompressed_bytes: super::MAX_DECOMPRESSED_BYTES,
        max_values: 1 << 25,
        max_memory_bytes: 2 << 30,
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

    /// These limits with [`max_memory_bytes`](Self::max_memory_bytes) set to `bytes`.
    #[must_use]
    pub const fn with_max_memory_bytes(mut self, bytes: u64) -> ReadLimits {
        self.max_memory_bytes = bytes;
        self
    }

    /// No limits beyond the machine's memory: only for files you produced yourself.
    pub const UNLIMITED: ReadLimits = ReadLimits {
        max_input_bytes: u64::MAX,
        max_decompressed_bytes: u64::MAX,
        max_values: u64::MAX,
        max_memory_bytes: u64::MAX,
    };
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits::DEFAULT
    }
}
