//! Running out of memory: the callbacks that can free some, the observers told about it, and the error.
//!
//! When no cached block fits a request, the allocator first asks every registered
//! [`FreeMemoryCallback`] to free what it can (PyTorch's `FreeCudaMemoryCallbacksRegistry`; the CUDA
//! IPC layer registers one that drops blocks other processes no longer use) and looks again. If the
//! device then refuses a new segment, it releases cached blocks and retries; when all of that fails it
//! tells every [`OomObserver`] and returns [`OutOfMemory`], whose message is PyTorch's: in tensormem's
//! wording for Rust programs, word for word PyTorch's for PyTorch programs ([`Reporter`]).

use std::borrow::Cow;
use std::fmt;

use crate::device::ProcessMemory;
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

/// Who reports an out-of-memory error, which decides the wording of [`OutOfMemory`]'s message (the
/// figures are the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reporter {
    /// tensormem's own wording, for Rust programs (what [`OutOfMemory`]'s `Display` and
    /// [`OutOfMemory::message`] give): PyTorch's sentences and figures, naming tensormem where
    /// PyTorch names itself, and tensormem's settings (`TENSORMEM_ALLOC_CONF`, its documentation)
    /// where PyTorch names its variable and its notes.
    Tensormem,
    /// PyTorch 2.11's message, word for word (`c10/cuda/CUDACachingAllocator.cpp`, the
    /// `OutOfMemoryError` of `malloc`): what a PyTorch program running on tensormem (the
    /// `tensormem_torch` plugin) reads in `torch.OutOfMemoryError`.
    PyTorch,
}

/// Which allocator met the error, which decides how its message is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The caching allocator: the message is built from the figures, in the reporter's wording.
    Caching,
    /// The `cudaMallocAsync` backend: PyTorch's message of that backend (which names neither
    /// allocator), the same for every reporter.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    AsyncBackend,
}

/// The out-of-memory error: the figures PyTorch reports, and its message in either wording
/// ([`Reporter`]); `Display` gives tensormem's.
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
    /// The processes using the device and the memory each held when the error was met (NVML, read
    /// through [`Device::process_memory`](crate::Device::process_memory)); empty where the device
    /// cannot tell, and the message then has no process sentences.
    pub processes: Vec<ProcessMemory>,
    /// How the message is built.
    pub(crate) source: Source,
    /// The message in tensormem's wording (built by [`OutOfMemory::finish`]).
    pub(crate) message: String,
}

impl OutOfMemory {
    /// Builds tensormem's message from the figures (see [`Reporter::Tensormem`]).
    pub(crate) fn finish(mut self) -> Self {
        self.message = self.caching_message(Reporter::Tensormem);
        self
    }

    /// The caching allocator's message in `reporter`'s wording: PyTorch's sentences in PyTorch's
    /// order (`reportProcessMemoryInfo`'s sentence per process, then the allowed maximum, then the
    /// allocator's figures and its advice).
    fn caching_message(&self, reporter: Reporter) -> String {
        let (name, itself, advice) = match reporter {
            Reporter::Tensormem => (
                "tensormem",
                "Including non-tensormem memory, this process",
                "TENSORMEM_ALLOC_CONF=expandable_segments:True (or PYTORCH_CUDA_ALLOC_CONF, read when \
                 TENSORMEM_ALLOC_CONF is unset) to avoid fragmentation.  See the allocator's settings \
                 (https://docs.rs/tensormem-cuda-alloc/latest/tensormem_cuda_alloc/config/)",
            ),
            Reporter::PyTorch => (
                "PyTorch",
                "Including non-PyTorch memory, this process",
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See \
                 documentation for Memory Management  \
                 (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
            ),
        };
        let mut message = format!(
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            format_size(self.alloc_size),
            self.device,
            format_size(self.device_total),
            format_size(self.device_free),
        );
        for process in &self.processes {
            if process.this_process {
                message.push_str(itself);
            } else {
                message.push_str(&format!("Process {}", process.pid));
            }
            message.push_str(&format!(
                " has {} memory in use. ",
                format_size(process.used_bytes)
            ));
        }
        if let Some(allowed) = self.allowed {
            message.push_str(&format!("{} allowed; ", format_size(allowed)));
        }
        message.push_str(&format!(
            "Of the allocated memory {} is allocated by {name}, ",
            format_size(self.allocated + self.private_pools)
        ));
        if self.private_pools > 0 {
            message.push_str(&format!(
                "with {} allocated in private pools (e.g., CUDA Graphs), ",
                format_size(self.private_pools)
            ));
        }
        message.push_str(&format!(
            "and {} is reserved by {name} but unallocated. If reserved but unallocated memory is large \
             try setting {advice}",
            format_size(
                self.reserved
                    .saturating_sub(self.allocated + self.private_pools)
            )
        ));
        message
    }

    /// The message in tensormem's wording ([`Reporter::Tensormem`]; what `Display` shows).
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message in `reporter`'s wording: [`Reporter::PyTorch`] gives PyTorch 2.11's message word
    /// for word, for a PyTorch program on tensormem. An error of the `cudaMallocAsync` backend has
    /// PyTorch's message of that backend for every reporter.
    #[must_use]
    pub fn message_for(&self, reporter: Reporter) -> Cow<'_, str> {
        match (self.source, reporter) {
            (Source::AsyncBackend, _) | (Source::Caching, Reporter::Tensormem) => {
                Cow::Borrowed(&self.message)
            }
            (Source::Caching, reporter) => Cow::Owned(self.caching_message(reporter)),
        }
    }

    /// PyTorch's message ([`message_for`](Self::message_for) with [`Reporter::PyTorch`]).
    #[must_use]
    pub fn message_for_pytorch(&self) -> Cow<'_, str> {
        self.message_for(Reporter::PyTorch)
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

    /// PyTorch 2.11's advice, the end of its message.
    const PYTORCH_ADVICE: &str = "If reserved but unallocated memory is large try setting \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation \
        for Memory Management  \
        (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

    /// An error of the caching allocator with these figures.
    fn figures(
        device: u32,
        alloc_size: u64,
        (device_total, device_free): (u64, u64),
        allowed: Option<u64>,
        (allocated, reserved, private_pools): (u64, u64, u64),
        processes: Vec<ProcessMemory>,
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
            processes,
            source: Source::Caching,
            message: String::new(),
        }
        .finish()
    }

    fn process(pid: u32, used_bytes: u64, this_process: bool) -> ProcessMemory {
        ProcessMemory {
            pid,
            used_bytes,
            this_process,
        }
    }

    #[test]
    fn tensormems_wording_names_tensormem_and_its_settings() {
        let oom = figures(
            0,
            20 << 20,
            (80 << 30, 10 << 20),
            None,
            (3 << 29, 2 << 30, 0),
            vec![],
        );
        let expected = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of \
             80.00 GiB of which 10.00 MiB is free. Of the allocated memory 1.50 GiB is allocated by \
             tensormem, and 512.00 MiB is reserved by tensormem but unallocated. If reserved but \
             unallocated memory is large try setting TENSORMEM_ALLOC_CONF=expandable_segments:True \
             (or PYTORCH_CUDA_ALLOC_CONF, read when TENSORMEM_ALLOC_CONF is unset) to avoid \
             fragmentation.  See the allocator's settings \
             (https://docs.rs/tensormem-cuda-alloc/latest/tensormem_cuda_alloc/config/)";
        assert_eq!(oom.message(), expected);
        assert_eq!(oom.to_string(), expected);
        assert_eq!(oom.message_for(Reporter::Tensormem), expected);
    }

    #[test]
    fn pytorchs_wording_is_pytorch_2_11s_message() {
        let oom = figures(
            0,
            20 << 20,
            (80 << 30, 10 << 20),
            None,
            (3 << 29, 2 << 30, 0),
            vec![],
        );
        assert_eq!(
            oom.message_for_pytorch(),
            format!(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 80.00 \
                 GiB of which 10.00 MiB is free. Of the allocated memory 1.50 GiB is allocated by \
                 PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated. {PYTORCH_ADVICE}"
            )
        );
        assert_eq!(
            oom.message_for(Reporter::PyTorch),
            oom.message_for_pytorch()
        );
    }

    #[test]
    fn pytorchs_wording_with_a_fraction_private_pools_and_processes() {
        let oom = figures(
            1,
            2 << 20,
            (1 << 30, 0),
            Some(1 << 29),
            (100 << 20, 300 << 20, 2 << 20),
            vec![
                process(4242, 700 << 20, false),
                process(77, 310 << 20, true),
                process(9, 512, false),
            ],
        );
        assert_eq!(
            oom.message_for_pytorch(),
            format!(
                "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 1 has a total capacity of \
                 1024.00 MiB of which 0 bytes is free. Process 4242 has 700.00 MiB memory in use. \
                 Including non-PyTorch memory, this process has 310.00 MiB memory in use. Process 9 \
                 has 512 bytes memory in use. 512.00 MiB allowed; Of the allocated memory 102.00 MiB \
                 is allocated by PyTorch, with 2.00 MiB allocated in private pools (e.g., CUDA \
                 Graphs), and 198.00 MiB is reserved by PyTorch but unallocated. {PYTORCH_ADVICE}"
            )
        );
        // The same figures and sentences in tensormem's wording.
        let ours = oom.message();
        assert!(
            ours.contains(
                "is free. Process 4242 has 700.00 MiB memory in use. Including non-tensormem \
                 memory, this process has 310.00 MiB memory in use. Process 9 has 512 bytes memory \
                 in use. 512.00 MiB allowed; Of the allocated memory 102.00 MiB is allocated by \
                 tensormem, with 2.00 MiB allocated in private pools (e.g., CUDA Graphs), and \
                 198.00 MiB is reserved by tensormem but unallocated."
            ),
            "{ours}"
        );
    }

    #[test]
    fn a_fraction_without_processes_or_private_pools() {
        let oom = figures(0, 512, (1 << 30, 3 << 20), Some(1 << 29), (0, 0, 0), vec![]);
        assert_eq!(
            oom.message_for_pytorch(),
            format!(
                "CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity of \
                 1024.00 MiB of which 3.00 MiB is free. 512.00 MiB allowed; Of the allocated memory 0 \
                 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. \
                 {PYTORCH_ADVICE}"
            )
        );
    }

    #[test]
    fn the_async_backends_message_is_the_same_for_every_reporter() {
        let mut oom = figures(0, 512, (1 << 30, 0), None, (0, 0, 0), vec![]);
        oom.source = Source::AsyncBackend;
        oom.message = "Allocation on device 0 would exceed allowed memory. (out of memory)".into();
        assert_eq!(oom.message_for_pytorch(), oom.message());
        assert_eq!(oom.message_for(Reporter::Tensormem), oom.message());
    }
}
