//! PyTorch's decisions that more than one path of the allocator makes, each defined once.
//!
//! The plain path (best fit, then split) and the fast path (a parked block handed out again) must decide
//! exactly alike, so both call these functions; changing one of PyTorch's rules is an edit here.

use crate::settings::Settings;
use crate::size::{MIN_BLOCK_SIZE, SMALL_SIZE};

/// PyTorch's `should_split`: whether handing out `size` bytes of a free block leaves a `remaining`
/// part worth splitting off, in a pool of the small class (`small_pool`) or under expandable
/// segments (both split any remainder of at least the minimum block size), or else only for
/// requests below `max_split_size` with more than a small allocation left.
#[inline(always)]
pub(crate) fn should_split(
    small_pool: bool,
    expandable_segments: bool,
    max_split: usize,
    size: usize,
    remaining: usize,
) -> bool {
    if small_pool | expandable_segments {
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
