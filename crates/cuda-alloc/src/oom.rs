//! Running out of memory: the callbacks that can free some, the observers told about it, and the error.
//!
//! When no cached block fits a request, the allocator first asks every registered
//! [`FreeMemoryCallback`] to free what it can (PyTorch's `FreeCudaMemoryCallbacksRegistry`; the CUDA
//! IPC layer registers one that drops blocks other processes no longer use) and looks again. If the
//! device then refuses a new segment, it releases cached blocks and retries; when all of that fails it
//! tells every [`OomObserver`] and returns [`OutOfMemory`], whose message is PyTorch's.

use std::fmt;

use crate::size::format_size;

/// Something that can free device memory when the allocator runs short (PyTorch's
/// `FreeMemoryCallback`).
///
/// Called without any allocator lock held, so it may free allocations of the allocator that calls it
/// (it must not allocate from it).
pub trait FreeMemoryCallback: Send + Sync {
    /// Frees what it can; returns whether anything was freed.
    fn free_memory(&self) -> bool;
}

impl<F: Fn() -> bool + Send + Sync> FreeMemoryCallback for F {
    fn free_memory(&self) -> bool {
        self()
    }
}

/// What an [`OomObserver`] is told (the arguments of PyTorch's `OutOfMemoryObserver`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OomEvent {
    /// The device ordinal.
    pub device: u32,
    /// The segment size that could not be allocated.
    pub alloc_size: u64,
    /// The allowed maximum when a memory fraction is set, else the device's total memory.
    pub device_total: u64,
    /// The device's free memory.
    pub device_free: u64,
}

/// A function told about every out-of-memory error, after the allocator's locks are released.
pub type OomObserver = Box<dyn Fn(&OomEvent) + Send + Sync>;

/// The out-of-memory error: the figures PyTorch reports, and its message naming tensormem and
/// `TENSORMEM_ALLOC_CONF` where PyTorch names itself and `PYTORCH_ALLOC_CONF`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// The device ordinal.
    pub device: u32,
    /// The segment size that could not be allocated ("Tried to allocate").
    pub alloc_size: u64,
    /// The device's total memory.
    pub device_total: u64,
    /// The device's free memory.
    pub device_free: u64,
    /// The allowed maximum, when a memory fraction is set.
    pub allowed: Option<u64>,
    /// Bytes allocated to callers.
    pub allocated: u64,
    /// Bytes reserved from the device.
    pub reserved: u64,
    /// Bytes cached in private pools (CUDA graphs), counted as allocated in the message.
    pub private_pools: u64,
    /// The message (built by [`OutOfMemory::finish`]).
    pub(crate) message: String,
}

impl OutOfMemory {
    /// Builds the message from the figures: PyTorch's sentences and figures, naming tensormem and
    /// its own configuration variable where PyTorch names itself and its variable.
    pub(crate) fn finish(mut self) -> Self {
        let OutOfMemory {
            device,
            alloc_size,
            device_total,
            device_free,
            allowed,
            allocated,
            reserved,
            private_pools,
            ..
        } = self;
        let mut message = format!(
            "CUDA out of memory. Tried to allocate {}. GPU {device} has a total capacity of {} of which {} is free. ",
            format_size(alloc_size),
            format_size(device_total),
            format_size(device_free),
        );
        if let Some(allowed) = allowed {
            message.push_str(&format!("{} allowed; ", format_size(allowed)));
        }
        message.push_str(&format!(
            "Of the allocated memory {} is allocated by tensormem, ",
            format_size(allocated + private_pools)
        ));
        if private_pools > 0 {
            message.push_str(&format!(
                "with {} allocated in private pools (e.g., CUDA Graphs), ",
                format_size(private_pools)
            ));
        }
        message.push_str(&format!(
            "and {} is reserved by tensormem but unallocated. If reserved but unallocated memory is large \
             try setting TENSORMEM_ALLOC_CONF=expandable_segments:True (or PYTORCH_CUDA_ALLOC_CONF, read \
             when TENSORMEM_ALLOC_CONF is unset) to avoid fragmentation.  See the allocator's settings \
             (https://docs.rs/tensormem-cuda-alloc/latest/tensormem_cuda_alloc/config/)",
            format_size(reserved.saturating_sub(allocated + private_pools))
        ));
        self.message = message;
        self
    }

    /// The message for this error (PyTorch's, naming tensormem).
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    fn figures(
        device: u32,
        alloc_size: u64,
        device_total: u64,
        device_free: u64,
        allowed: Option<u64>,
        allocated: u64,
        reserved: u64,
        private_pools: u64,
    ) -> OutOfMemory {
        OutOfMemory {
            device,
            alloc_size,
            device_total,
            device_free,
            allowed,
            allocated,
            reserved,
            private_pools,
            message: String::new(),
        }
        .finish()
    }

    #[test]
    fn message_is_pytorchs_naming_tensormem() {
        let oom = figures(0, 20 << 20, 80 << 30, 10 << 20, None, 3 << 29, 2 << 30, 0);
        assert_eq!(
            oom.message(),
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 80.00 GiB \
             of which 10.00 MiB is free. Of the allocated memory 1.50 GiB is allocated by tensormem, and \
             512.00 MiB is reserved by tensormem but unallocated. If reserved but unallocated memory is \
             large try setting TENSORMEM_ALLOC_CONF=expandable_segments:True (or \
             PYTORCH_CUDA_ALLOC_CONF, read when TENSORMEM_ALLOC_CONF is unset) to avoid fragmentation.  \
             See the allocator's settings \
             (https://docs.rs/tensormem-cuda-alloc/latest/tensormem_cuda_alloc/config/)"
        );
        let capped = figures(1, 512, 1 << 30, 0, Some(1 << 29), 0, 0, 2 << 20);
        assert!(capped
            .message()
            .contains("GPU 1 has a total capacity of 1024.00 MiB"));
        assert!(capped
            .message()
            .contains("is free. 512.00 MiB allowed; Of the allocated"));
        assert!(capped.message().contains(
            "2.00 MiB is allocated by tensormem, with 2.00 MiB allocated in private pools"
        ));
    }
}
