//! The inactive-split figures of parking a block and handing it back, shared by the usual and the
//! express lanes.

use crate::allocator::Locked;
use crate::device::Device;
use crate::stats::peaks::Kind;

impl<D: Device> Locked<'_, D> {
    /// The inactive-split figures of a parked block of `size` bytes, part of a split segment, as
    /// freeing it makes them: its bytes join the split free blocks', and with no free neighbour
    /// (`whole`) it is one more of them (merged into its free next neighbour, it replaces one).
    #[inline(always)]
    pub(super) fn parked_split_freed(&self, small: bool, size: u64, whole: bool) {
        if whole {
            self.inc(Kind::InactiveSplit, small, 1);
        }
        self.inc(Kind::InactiveSplitBytes, small, size);
    }

    /// The reverse of [`parked_split_freed`](Self::parked_split_freed), for the parked block handed
    /// back. `COVERED`: the caller covers the look at the book's list of loose shards (the express
    /// lane, see [`Locked::dec_covered`]).
    #[inline(always)]
    pub(super) fn parked_split_taken<const COVERED: bool>(
        &self,
        small: bool,
        size: u64,
        whole: bool,
    ) {
        if COVERED {
            self.dec_covered(Kind::InactiveSplitBytes, small, size);
            if whole {
                self.dec_covered(Kind::InactiveSplit, small, 1);
            }
        } else {
            self.dec(Kind::InactiveSplitBytes, small, size);
            if whole {
                self.dec(Kind::InactiveSplit, small, 1);
            }
        }
    }
}
