//! Under `cfg(loom)`: loom's mutex with `parking_lot`'s interface, so that the structures checked by
//! loom models (see `docs/reliability.md`) compile against either unchanged.

/// A [`loom::sync::Mutex`] whose `lock` returns the guard directly (no poisoning), as
/// `parking_lot::Mutex` does.
#[derive(Debug)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A mutex around `value`.
    pub(crate) fn new(value: T) -> Self {
        Mutex(loom::sync::Mutex::new(value))
    }

    /// Takes the lock.
    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0
            .lock()
            .expect("no thread panics while holding a model's lock")
    }
}
