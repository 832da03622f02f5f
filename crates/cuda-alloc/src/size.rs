//! Size classes: the numbers by which a request is rounded, a pool chosen and a new segment sized
//! (the rules that use them are in `allocator/policy.rs`; [`allocation_size`] is public for
//! capacity planning).
//!
//! The numbers are PyTorch's (`c10/cuda/CUDACachingAllocator.cpp`):
//!
//! | constant | value | meaning |
//! | --- | --- | --- |
//! | `MIN_BLOCK_SIZE` | 512 B | every request is rounded up to a multiple of this |
//! | `SMALL_SIZE` | 1 MiB | the largest request served by the small pool |
//! | [`SMALL_BUFFER`] | 2 MiB | the segment size of the small pool |
//! | `MIN_LARGE_ALLOC` | 10 MiB | requests below this (and above 1 MiB) get a 20 MiB segment |
//! | [`LARGE_BUFFER`] | 20 MiB | the segment size for requests between 1 and 10 MiB |
//! | `ROUND_LARGE` | 2 MiB | larger requests get a segment of their size rounded up to this |

pub use crate::config::LARGE_BUFFER;

/// Every size is rounded up to a multiple of 512 bytes (`kMinBlockSize`).
pub(crate) const MIN_BLOCK_SIZE: usize = 512;
/// The largest request the small pool serves: 1 MiB (`kSmallSize`).
pub(crate) const SMALL_SIZE: usize = 1 << 20;
/// Small requests are packed in 2 MiB segments (`kSmallBuffer`).
pub const SMALL_BUFFER: usize = 2 << 20;
/// Requests between 1 MiB and this (10 MiB) are served from 20 MiB segments (`kMinLargeAlloc`).
pub(crate) const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Larger requests get segments of their own size rounded up to 2 MiB (`kRoundLarge`).
pub(crate) const ROUND_LARGE: usize = 2 << 20;
/// Requests of this size (one exabyte, 2^60 bytes) or more are refused outright.
pub const ONE_EXABYTE: usize = 1 << 60;

/// Rounds `size` up to the next multiple of `align` (a power of two).
#[inline]
pub(crate) const fn align_up(size: usize, align: usize) -> usize {
    (size + align - 1) & !(align - 1)
}

/// Rounds `size` up to the nearest power-of-two division: the interval between the powers of two
/// around `size` is cut into `divisions` equal steps and the next step boundary is returned.
///
/// For example 1200 with 4 divisions lies between 1024 and 2048, whose steps are 1024, 1280, 1536,
/// 1792, so the answer is 1280. Powers of two are returned unchanged; `divisions` below 2 is treated
/// as 2 would be for the step computation only through callers, which never pass it.
#[must_use]
pub(crate) fn roundup_power2_next_division(size: usize, divisions: usize) -> usize {
    if size.is_power_of_two() || size == 0 {
        return size;
    }
    debug_assert!(divisions >= 2, "only 2 or more divisions are supported");
    let floor = 1usize << size.ilog2();
    let step = floor >> divisions.ilog2();
    if step == 0 {
        return floor << 1;
    }
    let round_floor = size & !(step - 1);
    if round_floor == size {
        size
    } else {
        round_floor + step
    }
}

pub use crate::allocator::policy::allocation_size;

/// A byte count the way PyTorch prints it in messages: `"512 bytes"`, `"1.50 KiB"`, `"20.00 MiB"`,
/// `"1.50 GiB"` (two decimals; a unit applies up to and including 1024 of the unit below it).
#[must_use]
pub fn format_size(size: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if size <= KIB {
        format!("{size} bytes")
    } else if size <= MIB {
        format!("{:.2} KiB", size as f64 / KIB as f64)
    } else if size <= GIB {
        format!("{:.2} MiB", size as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", size as f64 / GIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::policy::{round_size, small_pool as is_small};
    use crate::config::AllocatorConfig;
    use crate::settings::Settings;

    fn settings(config: &str) -> Settings {
        Settings::new(&AllocatorConfig::parse(config).unwrap())
    }

    #[test]
    fn rounds_to_512_byte_multiples() {
        let s = settings("");
        assert_eq!(round_size(0, &s), 512);
        assert_eq!(round_size(1, &s), 512);
        assert_eq!(round_size(511, &s), 512);
        assert_eq!(round_size(512, &s), 512);
        assert_eq!(round_size(513, &s), 1024);
        assert_eq!(round_size((1 << 20) + 1, &s), (1 << 20) + 512);
    }

    #[test]
    fn power2_divisions_round_within_the_interval() {
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(roundup_power2_next_division(1024, 4), 1024);
        assert_eq!(roundup_power2_next_division(1025, 4), 1280);
        assert_eq!(roundup_power2_next_division(1280, 4), 1280);
        assert_eq!(roundup_power2_next_division(1281, 4), 1536);
        assert_eq!(roundup_power2_next_division(1793, 4), 2048);
        // More divisions than the interval has bytes: the next power of two.
        assert_eq!(roundup_power2_next_division(3, 4), 4);
    }

    #[test]
    fn divisions_apply_only_above_512_times_divisions() {
        let s = settings("roundup_power2_divisions:4");
        // 2048 = 512 * 4: not above, plain 512 rounding.
        assert_eq!(round_size(2047, &s), 2048);
        assert_eq!(round_size(2049, &s), 2560);
        // 3 MiB + 1 with 4 divisions: steps of 512 KiB between 2 and 4 MiB.
        assert_eq!(round_size((3 << 20) + 1, &s), (3 << 20) + (512 << 10));
        let list = settings("roundup_power2_divisions:[256:1,512:2,>:8]");
        // Below 256 MiB: 1 division, so 512 rounding.
        assert_eq!(round_size((100 << 20) + 1, &list), (100 << 20) + 512);
        // [512 MiB, 1 GiB) uses 2 divisions: 700 MiB -> 768 MiB.
        assert_eq!(round_size(700 << 20, &list), 768 << 20);
        // Above: 8 divisions: 1.1 GiB -> 1.125 GiB.
        assert_eq!(round_size(1_181_116_006, &list), 1_207_959_552);
    }

    #[test]
    fn huge_division_counts_round_as_pytorchs_release_build_does() {
        // 512 * 2^55 wraps to 0 in PyTorch's `size_t` arithmetic: every size above 512 then has
        // more divisions than its interval has bytes, and goes to the next power of two.
        for exponent in [55, 56, 63] {
            let s = settings(&format!("roundup_power2_divisions:{}", 1u64 << exponent));
            assert_eq!(round_size(511, &s), 512);
            assert_eq!(round_size(1000, &s), 1024);
            assert_eq!(round_size((3 << 20) + 1, &s), 4 << 20);
            assert_eq!(round_size(4 << 20, &s), 4 << 20);
        }
        // Below the wrap, plain 512 rounding as before.
        let s = settings(&format!("roundup_power2_divisions:{}", 1u64 << 54));
        assert_eq!(round_size(1000, &s), 1024);
        assert_eq!(round_size((3 << 20) + 1, &s), (3 << 20) + 512);
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(allocation_size(512), SMALL_BUFFER);
        assert_eq!(allocation_size(SMALL_SIZE), SMALL_BUFFER);
        assert_eq!(allocation_size(SMALL_SIZE + 512), LARGE_BUFFER);
        assert_eq!(allocation_size(MIN_LARGE_ALLOC - 512), LARGE_BUFFER);
        assert_eq!(allocation_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(allocation_size(MIN_LARGE_ALLOC + 512), 12 << 20);
        assert!(is_small(SMALL_SIZE));
        assert!(!is_small(SMALL_SIZE + 512));
    }

    #[test]
    fn sizes_print_like_pytorch() {
        assert_eq!(format_size(0), "0 bytes");
        assert_eq!(format_size(1024), "1024 bytes");
        assert_eq!(format_size(1025), "1.00 KiB");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(1 << 20), "1024.00 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(1 << 30), "1024.00 MiB");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
    }
}
