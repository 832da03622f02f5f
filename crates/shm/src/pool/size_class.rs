//! Size classes: the capacity of the region the pool makes (and later reuses) for a request.
//!
//! A request is rounded up to a page (4 KiB); above that, each power-of-two interval
//! `[2^k, 2^(k+1))` is split into four classes (PyTorch's `roundup_power2_divisions = 4`), so a
//! region is never more than 25% larger than the request that made it. From 2 MiB up, classes
//! are also multiples of 2 MiB, so a region is made of whole transparent huge pages where the
//! kernel gives them. A data loader asking for the same batch size every step always lands in one
//! class, so its regions are reused exactly.

/// Smallest class: one page.
pub const PAGE: u64 = 4096;

/// Huge page size on x86-64 and arm64 (4 KiB base pages); classes from here on are multiples.
pub const HUGE_PAGE: u64 = 2 << 20;

/// The capacity of the region serving a request of `len` bytes (`len >= 1`), `None` if it
/// overflows.
pub fn class_for(len: u64) -> Option<u64> {
    let len = len.max(1).checked_next_multiple_of(PAGE)?;
    let floor = 1u64 << (63 - len.leading_zeros());
    let step = if len <= HUGE_PAGE {
        (floor / 4).max(PAGE)
    } else {
        (floor / 4).max(HUGE_PAGE)
    };
    len.checked_next_multiple_of(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_by_at_most_a_quarter() {
        assert_eq!(class_for(1), Some(PAGE));
        assert_eq!(class_for(4096), Some(4096));
        assert_eq!(class_for(4097), Some(8192));
        assert_eq!(class_for(1 << 20), Some(1 << 20));
        assert_eq!(class_for((1 << 20) + 1), Some(5 << 18));
        assert_eq!(class_for(64 << 20), Some(64 << 20));
        assert_eq!(class_for((64 << 20) - 5), Some(64 << 20));
        assert_eq!(class_for(1 << 30), Some(1 << 30));
        assert_eq!(class_for(3 << 20), Some(4 << 20));
        assert_eq!(class_for(u64::MAX), None);
        for len in (1..64u64).map(|i| i * 1_234_567) {
            let class = class_for(len).unwrap();
            assert!(
                class >= len && class.is_multiple_of(PAGE),
                "{len} -> {class}"
            );
            assert!(class - len <= (len / 4).max(HUGE_PAGE), "{len} -> {class}");
            if class > HUGE_PAGE {
                assert_eq!(class % HUGE_PAGE, 0, "{len} -> {class}");
            }
            // A request of the class's own size lands in the same class.
            assert_eq!(class_for(class), Some(class));
        }
    }
}
