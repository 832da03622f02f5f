//! The memory timeline of a replay: allocated, reserved and requested bytes over the trace, for plots.
//!
//! A trace has from thousands to millions of events; a plot needs a few hundred points. The events
//! are cut into equal windows and each point holds the *highest* value of each figure in its window,
//! so that no peak falls between two points.

/// One point of a [`Timeline`]: the highest figures over a window of events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TimelinePoint {
    /// The trace event that ends the window (index into the device's trace).
    pub event: u64,
    /// Bytes in allocated blocks (`allocated_bytes.all`).
    pub allocated: u64,
    /// Bytes reserved from the device (`reserved_bytes.all`).
    pub reserved: u64,
    /// Bytes callers asked for, in active blocks (`requested_bytes.all`).
    pub requested: u64,
}

/// Allocated, reserved and requested bytes over one device's trace, as window maxima.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// The points, in event order.
    pub points: Vec<TimelinePoint>,
}

/// Collects a [`Timeline`] one observation per replayed operation.
#[derive(Debug)]
pub(crate) struct Sampler {
    window: u64,
    seen: u64,
    current: TimelinePoint,
    points: Vec<TimelinePoint>,
}

impl Sampler {
    /// A sampler for `operations` observations making about `points` points.
    pub(crate) fn new(operations: usize, points: usize) -> Self {
        let window = (operations as u64).div_ceil(points.max(1) as u64).max(1);
        Sampler {
            window,
            seen: 0,
            current: TimelinePoint::default(),
            points: Vec::with_capacity(points.min(operations) + 1),
        }
    }

    /// Records the figures after the operation of trace event `event`.
    #[inline]
    pub(crate) fn observe(&mut self, event: u64, allocated: u64, reserved: u64, requested: u64) {
        let c = &mut self.current;
        c.event = event;
        c.allocated = c.allocated.max(allocated);
        c.reserved = c.reserved.max(reserved);
        c.requested = c.requested.max(requested);
        self.seen += 1;
        if self.seen == self.window {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.points.push(self.current);
        self.current = TimelinePoint::default();
        self.seen = 0;
    }

    /// The timeline so far.
    pub(crate) fn finish(mut self) -> Timeline {
        if self.seen > 0 {
            self.flush();
        }
        Timeline {
            points: self.points,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_keep_the_peaks_of_their_windows() {
        let mut s = Sampler::new(10, 3);
        for i in 0..10u64 {
            let spike = if i == 5 { 100 } else { i };
            s.observe(i, spike, 2 * i, i / 2);
        }
        let t = s.finish();
        assert_eq!(t.points.len(), 3);
        assert_eq!(t.points[1].event, 7);
        assert_eq!(t.points[1].allocated, 100);
        assert_eq!(t.points[2].reserved, 18);
        assert_eq!(t.points[2].requested, 4);
    }
}
