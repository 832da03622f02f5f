//! Call stacks recorded with memory history: where memory came from (the `frames` of snapshots and
//! traces that PyTorch's `_memory_viz` shows).
//!
//! Capturing must be cheap, since it happens on every allocation while recording: a [`Stack`] walks
//! the stack and keeps only the instruction addresses (`backtrace::Backtrace::new_unresolved`, a few
//! microseconds); turning them into file, line and function names (reading debug information, the
//! expensive part) happens at most once per stack, when a snapshot or the trace is read.
//!
//! Without the `stacks` feature nothing is captured and frames stay empty.

use std::sync::{Arc, OnceLock};

use crate::snapshot::Frame;

/// [`RecordContext`]: which events keep a call stack while memory history is recorded (PyTorch's
/// `_record_memory_history(context=...)`, `RecordContext`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum RecordContext {
    /// No stacks (what [`record_history`](crate::CachingAllocator::record_history) records).
    #[default]
    Never,
    /// `"state"`: the stack of each live allocation, shown with its block in snapshots; trace entries
    /// carry no frames.
    State,
    /// `"alloc"`: also the allocation's stack on its trace entries (`alloc`, `free_requested`,
    /// `free_completed`, `segment_alloc`).
    Alloc,
    /// `"all"`: also the stack of each free on its `free_requested` and `free_completed` entries.
    All,
}

impl RecordContext {
    /// The level as stored in an atomic.
    pub(crate) const fn as_u8(self) -> u8 {
        match self {
            RecordContext::Never => 0,
            RecordContext::State => 1,
            RecordContext::Alloc => 2,
            RecordContext::All => 3,
        }
    }

    /// The level stored by [`as_u8`](Self::as_u8).
    pub(crate) const fn from_u8(level: u8) -> Self {
        match level {
            0 => RecordContext::Never,
            1 => RecordContext::State,
            2 => RecordContext::Alloc,
            _ => RecordContext::All,
        }
    }

    /// PyTorch's name of the level (`None` for [`Never`](Self::Never)).
    #[must_use]
    pub const fn name(self) -> Option<&'static str> {
        match self {
            RecordContext::Never => None,
            RecordContext::State => Some("state"),
            RecordContext::Alloc => Some("alloc"),
            RecordContext::All => Some("all"),
        }
    }
}

/// A call stack captured unresolved, symbolized on first use. Cheap to clone (shared).
#[derive(Clone)]
pub(crate) struct Stack(Arc<StackInner>);

struct StackInner {
    #[cfg(feature = "stacks")]
    raw: parking_lot::Mutex<Option<backtrace::Backtrace>>,
    frames: OnceLock<Arc<[Frame]>>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("resolved", &self.0.frames.get().is_some())
            .finish()
    }
}

/// Two stacks are equal when they are the same capture.
impl PartialEq for Stack {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Stack {}

impl Stack {
    /// The caller's stack, unresolved; `None` without the `stacks` feature.
    #[inline(never)]
    pub(crate) fn capture() -> Option<Stack> {
        #[cfg(feature = "stacks")]
        {
            Some(Stack(Arc::new(StackInner {
                raw: parking_lot::Mutex::new(Some(backtrace::Backtrace::new_unresolved())),
                frames: OnceLock::new(),
            })))
        }
        #[cfg(not(feature = "stacks"))]
        {
            None
        }
    }

    /// The frames, innermost first, without the allocator's own and the capturing machinery's
    /// (symbolized on the first call).
    pub(crate) fn frames(&self) -> Arc<[Frame]> {
        Arc::clone(self.0.frames.get_or_init(|| self.resolve()))
    }

    #[cfg(feature = "stacks")]
    fn resolve(&self) -> Arc<[Frame]> {
        let Some(mut raw) = self.0.raw.lock().take() else {
            return Arc::from(Vec::new());
        };
        raw.resolve();
        let mut frames = Vec::new();
        for frame in raw.frames() {
            for symbol in frame.symbols() {
                let name = symbol
                    .name()
                    .map_or_else(|| "??".to_owned(), |n| format!("{n:#}"));
                frames.push(Frame {
                    filename: symbol
                        .filename()
                        .map_or_else(|| "??".to_owned(), |p| p.display().to_string()),
                    line: symbol.lineno().map_or(0, i64::from),
                    name,
                    other: Vec::new(),
                });
            }
            if frame.symbols().is_empty() {
                frames.push(Frame {
                    filename: "??".to_owned(),
                    line: 0,
                    name: format!("{:?}", frame.ip()),
                    other: Vec::new(),
                });
            }
        }
        Arc::from(skip_internal(frames))
    }

    #[cfg(not(feature = "stacks"))]
    fn resolve(&self) -> Arc<[Frame]> {
        Arc::from(Vec::new())
    }
}

/// Drops the innermost frames that belong to the capture itself (the `backtrace` crate) or to the
/// allocator's own code, so that the first frame is the caller's, as PyTorch's frames start at the
/// Python code that allocated.
#[cfg_attr(not(feature = "stacks"), allow(dead_code))]
fn skip_internal(frames: Vec<Frame>) -> Vec<Frame> {
    let internal = |f: &Frame| {
        f.name.starts_with("backtrace::")
            || f.name.contains("tensormem_cuda_alloc::allocator::")
            || f.name.contains("tensormem_cuda_alloc::stack::Stack")
            || f.name.contains("tensormem_cuda_alloc::trace::")
    };
    let first_outside = frames.iter().position(|f| !internal(f)).unwrap_or(0);
    frames.into_iter().skip(first_outside).collect()
}

#[cfg(all(test, feature = "stacks"))]
mod tests {
    use super::*;

    #[inline(never)]
    fn a_recognisable_caller() -> Stack {
        Stack::capture().expect("the stacks feature is on")
    }

    #[test]
    fn a_stack_is_symbolized_once_and_starts_outside_the_capture() {
        let stack = a_recognisable_caller();
        let frames = stack.frames();
        assert!(
            frames
                .iter()
                .any(|f| f.name.contains("a_recognisable_caller")),
            "{frames:?}"
        );
        assert!(
            !frames[0].name.starts_with("backtrace::"),
            "{:?}",
            frames[0]
        );
        assert!(Arc::ptr_eq(&frames, &stack.frames()), "resolved once");
    }
}
