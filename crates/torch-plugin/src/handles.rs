//! Opaque handles for C callers: numbers handed out once, never reused, looked up in a table of
//! the live ones on every call, so that a handle closed before (or one of another kind) is an
//! error naming it, never a use of freed memory.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

/// The next handle's number; shared by every table, so that no number names two things.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// `mutex`'s guard, also after a panic while it was held (the values it guards stay consistent:
/// the boundary stops panics, and no table update is left half done).
pub(crate) fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The live handles of one kind, by number.
pub(crate) struct Table<T> {
    /// What the handles stand for (`"weights publisher"`), for errors.
    kind: &'static str,
    /// The functions that hand them out, for errors.
    made_by: &'static str,
    live: Mutex<BTreeMap<u64, Arc<T>>>,
}

impl<T> Table<T> {
    /// An empty table of handles to `kind`s, which `made_by` hand out.
    pub(crate) const fn new(kind: &'static str, made_by: &'static str) -> Self {
        Self {
            kind,
            made_by,
            live: Mutex::new(BTreeMap::new()),
        }
    }

    /// Adds `value`; its handle.
    pub(crate) fn insert(&self, value: T) -> *mut c_void {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        locked(&self.live).insert(id, Arc::new(value));
        id as usize as *mut c_void
    }

    /// The live entry `handle` names.
    pub(crate) fn get(&self, handle: *mut c_void) -> Result<Arc<T>> {
        let id = handle as usize as u64;
        locked(&self.live)
            .get(&id)
            .cloned()
            .ok_or_else(|| self.unknown(id))
    }

    /// Takes the entry `handle` names out of the table (it is dropped once no call uses it).
    pub(crate) fn remove(&self, handle: *mut c_void) -> Result<Arc<T>> {
        let id = handle as usize as u64;
        locked(&self.live)
            .remove(&id)
            .ok_or_else(|| self.unknown(id))
    }

    fn unknown(&self, handle: u64) -> Error {
        Error::UnknownWeightsHandle {
            handle,
            kind: self.kind,
            made_by: self.made_by,
        }
    }
}
