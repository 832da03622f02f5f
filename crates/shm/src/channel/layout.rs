//! Where everything lies in the channel's memfd, and the typed views of it.
//!
//! | bytes | what |
//! | --- | --- |
//! | 0..16 | header: magic `b"TMCH"`, version (1), slots, zero (`u32`s, little-endian), written by the creator |
//! | 64..68, 128..132 | side 0's (the creator's) and side 1's "closed" flag |
//! | 256..512 | ring 0's control words (side 0 sends, side 1 receives): head, tail, rx doorbell, tx doorbell, 64 bytes apart |
//! | 512..768 | ring 1's control words (side 1 sends) |
//! | 1024.. | ring 0's slots, then ring 1's: `slots` x 512 bytes each |

#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64};

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64};

use super::ring::{Ring, RingControl, SLOT_BYTES, SLOT_WORDS};
use crate::error::{Error, Result};
use crate::region::SharedRegion;
use crate::wire::WireFormat;

pub(crate) const VERSION: u32 = 1;
const CLOSED: [usize; 2] = [64, 128];
const CONTROL: [usize; 2] = [256, 512];
const SLOTS_START: usize = 1024;

#[cfg(not(loom))]
const _: () = {
    assert!(std::mem::size_of::<RingControl>() == 256);
    assert!(std::mem::align_of::<RingControl>() == 64);
    assert!(CONTROL[0] + 256 <= CONTROL[1] && CONTROL[1] + 256 <= SLOTS_START);
};

/// Bytes of a channel with `slots` slots per direction.
pub(crate) fn total_len(slots: u32) -> usize {
    SLOTS_START + 2 * slots as usize * SLOT_BYTES
}

/// The channel's mapping, checked to be large enough for its slots.
pub(crate) struct Memory {
    region: SharedRegion,
    slots: u32,
}

impl Memory {
    /// Wraps `region` for `slots` slots per direction.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] if the region is too small or could be truncated by the peer (not
    /// sealed against shrinking: a truncation would turn the next access into `SIGBUS`).
    pub(crate) fn new(region: SharedRegion, slots: u32) -> Result<Self> {
        if region.mapping().is_truncatable() {
            return Err(Error::Protocol {
                wire: WireFormat::Channel,
                problem: "the channel's memory is not sealed against shrinking; it must be a \
                          sealed memfd (memfd_create with sealing)"
                    .into(),
            });
        }
        if region.mapping().map_len() < total_len(slots)
            || region.mapping().as_ptr() != region.mapping().base_ptr().cast_const()
        {
            return Err(Error::Protocol {
                wire: WireFormat::Channel,
                problem: format!(
                    "the channel's memory has {} bytes, {slots} slots need {}",
                    region.mapping().map_len(),
                    total_len(slots)
                ),
            });
        }
        Ok(Self { region, slots })
    }

    fn at<T>(&self, offset: usize) -> *const T {
        // The base is page aligned and every offset used is a multiple of 64.
        self.region
            .mapping()
            .base_ptr()
            .wrapping_add(offset)
            .cast_const()
            .cast()
    }

    /// One of the header's four words.
    pub(crate) fn header_word(&self, index: usize) -> &AtomicU32 {
        assert!(index < 4, "the header has four words");
        // SAFETY: bytes 0..16 lie inside the mapping (checked in `new`: at least 1024 bytes),
        // aligned for `u32`; an atomic has its integer's layout and any bit pattern is valid;
        // the mapping lives as long as `&self`, and is never truncated (sealed, checked in `new`).
        unsafe { &*self.at::<AtomicU32>(index * 4) }
    }

    /// Side `side`'s closed flag.
    pub(crate) fn closed(&self, side: usize) -> &AtomicU32 {
        // SAFETY: as `header_word`: offset 64 or 128, inside the first 1024 bytes, aligned.
        unsafe { &*self.at::<AtomicU32>(CLOSED[side]) }
    }

    /// Ring `index` (0: side 0 sends; 1: side 1 sends).
    pub(crate) fn ring(&self, index: usize) -> Ring<'_> {
        let words = self.slots as usize * SLOT_WORDS;
        let start = SLOTS_START + index * self.slots as usize * SLOT_BYTES;
        // SAFETY: `RingControl` is 256 bytes of atomics (`repr(C)`, 64-aligned, asserted above)
        // at offset 256 or 512; the slot area `start..start + slots * 512` ends at most at
        // `total_len(slots)`, inside the mapping (checked in `new`), 8-aligned. Atomics accept
        // any bit pattern another process writes; the mapping is sealed against shrinking and
        // lives as long as `&self`.
        unsafe {
            Ring {
                control: &*self.at::<RingControl>(CONTROL[index]),
                words: std::slice::from_raw_parts(self.at::<AtomicU64>(start), words),
                slots: self.slots,
            }
        }
    }

    /// The memfd (the creator sends it).
    pub(crate) fn region(&self) -> &SharedRegion {
        &self.region
    }

    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }
}
