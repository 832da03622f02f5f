//! PyTorch's decisions (`c10/cuda/CUDACachingAllocator.cpp`), each a small pure function defined
//! once here and called by every path that makes it: the plain path (best fit, split, merge,
//! garbage collection) and the fast path (a parked block handed out again) alike. Changing one of
//! PyTorch's rules is an edit of one function here. The numbers they use are in [`crate::size`].

use crate::block::Block;
use crate::settings::Settings;
use crate::size::{
    align_up, roundup_power2_next_division, LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC,
    ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};

/// PyTorch's `round_size`: the size a request of `size` bytes occupies: at least 512 bytes,
/// rounded up to a multiple of 512, or to a power-of-two division when `roundup_power2_divisions`
/// asks for one at this size.
#[inline]
#[must_use]
pub(crate) fn round_size(size: usize, settings: &Settings) -> usize {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = settings.roundup_divisions_for(size);
    // PyTorch computes `kMinBlockSize * divisions` in `size_t`: from 2^55 divisions on it wraps
    // (to 0), and every size takes the power-of-two rounding. The same arithmetic, without the
    // debug build's overflow panic.
    if divisions > 1 && size > MIN_BLOCK_SIZE.wrapping_mul(divisions) {
        roundup_power2_next_division(size, divisions)
    } else {
        align_up(size, MIN_BLOCK_SIZE)
    }
}

/// PyTorch's pool choice (`get_pool`, by size): whether a rounded request belongs to the small
/// pool (at most 1 MiB). Which pool family (default or a capture's private pool) is decided by
/// the capture underway, not by size.
#[inline]
#[must_use]
pub(crate) const fn small_pool(size: usize) -> bool {
    size <= SMALL_SIZE
}

/// PyTorch's `get_allocation_size`: the size of a new segment for a rounded request: 2 MiB for
/// small requests, 20 MiB for requests up to 10 MiB, the request rounded up to 2 MiB beyond.
#[inline]
#[must_use]
pub const fn allocation_size(size: usize) -> usize {
    if small_pool(size) {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        align_up(size, ROUND_LARGE)
    }
}

/// PyTorch's `should_split`: whether handing out `size` bytes of a free block leaves a `remaining`
/// part worth splitting off. Never in a `no_split` pool; in a pool of the small class
/// (`small_pool`) or one growing expandable segments (`expandable`, see
/// [`Pool::expandable`](crate::pool::Pool::expandable)) any remainder of at least the minimum block
/// size; else only for requests below `max_split_size` with more than a small allocation left.
#[inline(always)]
pub(crate) fn should_split(
    no_split: bool,
    small_pool: bool,
    expandable: bool,
    max_split: usize,
    size: usize,
    remaining: usize,
) -> bool {
    if no_split {
        std::hint::cold_path();
        return false;
    }
    if small_pool | expandable {
        remaining >= MIN_BLOCK_SIZE
    } else {
        size < max_split && remaining > SMALL_SIZE
    }
}

/// The oversize rules of best fit (PyTorch's `get_free_block`): whether a free block of `block_size`
/// bytes may serve a request of `size` bytes. A request below `max_split_size` never takes an
/// oversize block (one of `max_split_size` or more), and an oversize request takes one only if it
/// wastes less than `max_non_split_rounding_size`.
#[inline(always)]
pub(crate) fn best_fit_allows(settings: &Settings, size: usize, block_size: usize) -> bool {
    let max_split = settings.max_split_size();
    if size < max_split {
        block_size < max_split
    } else {
        block_size < size.saturating_add(settings.max_non_split_rounding_size())
    }
}

/// Whether a block (or segment) of `size` bytes is oversize: `max_split_size` or more. Oversize
/// blocks are never split and are counted apart (`oversize_allocations`, `oversize_segments`).
#[inline(always)]
#[must_use]
pub(crate) fn is_oversize(size: usize, max_split: usize) -> bool {
    size >= max_split
}

/// PyTorch's `try_merge_blocks` condition: whether `neighbour` may merge into a block being freed
/// whose `mapped` is `mapped`: it is not in use (allocated, or waiting for other streams' events)
/// and is mapped alike (a mapped and an unmapped part of an expandable segment never merge).
/// Without short-circuits: a free asks it of both neighbours before it branches on either.
#[inline(always)]
#[must_use]
pub(crate) fn may_merge(neighbour: &Block, mapped: bool) -> bool {
    !neighbour.is_active() & (neighbour.mapped == mapped)
}

/// PyTorch's `garbage_collect_cached_blocks`: the bytes to reclaim, if reserved memory is above
/// `threshold` (the `garbage_collection_threshold` fraction) of the `allowed` maximum.
#[must_use]
pub(crate) fn gc_target(threshold: f64, allowed: u64, reserved: u64) -> Option<u64> {
    let limit = (threshold * allowed as f64) as u64;
    (reserved > limit).then(|| reserved - limit)
}

/// Whether a free block of the large pool counts in garbage collection's average age: a whole
/// segment (not split).
#[inline]
#[must_use]
pub(crate) fn gc_counts(block: &Block) -> bool {
    !block.is_split()
}

/// Whether garbage collection releases a free block of the large pool `age` clock ticks old when
/// the average is `average`: a whole segment, not expandable, at least as old as the average.
#[inline]
#[must_use]
pub(crate) fn gc_releases(block: &Block, age: u64, average: f64) -> bool {
    !block.is_split() && !block.is_expandable() && age as f64 >= average
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_free_blocks_mapped_alike_may_merge() {
        let free = Block::new(0, 512, 0);
        let mut allocated = Block::new(512, 512, 0);
        allocated.allocated = true;
        let mut pending = Block::new(1024, 512, 0);
        pending.event_count = 1;
        let mut unmapped = Block::new(1536, 512, 0);
        unmapped.mapped = false;
        assert!(may_merge(&free, true));
        assert!(!may_merge(&free, false));
        assert!(!may_merge(&allocated, true));
        assert!(!may_merge(&pending, true));
        assert!(!may_merge(&unmapped, true));
        assert!(may_merge(&unmapped, false));
    }
}
