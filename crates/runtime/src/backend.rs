//! Which allocator serves the process: its backend, decided once.
//!
//! PyTorch reads `backend:native|cudaMallocAsync` from its allocator configuration when CUDA is
//! loaded and never changes it afterwards: every `torch.cuda` memory function then goes to the
//! caching allocator or to `CudaMallocAsyncAllocator`, and what the latter cannot do is refused with
//! its own errors. The runtime does the same: the first call that needs an allocator reads the
//! configuration ([`AllocatorConfig::read_env`]: `TENSORMEM_ALLOC_CONF`, else PyTorch's variables as
//! PyTorch reads them, the backend from `PYTORCH_CUDA_ALLOC_CONF` or else `PYTORCH_ALLOC_CONF`), and
//! its `backend` serves the process from
//! then on: each device's [`DeviceAllocator`](crate::DeviceAllocator) is the caching allocator or the
//! device's [`AsyncAllocator`](tensormem_cuda_alloc::AsyncAllocator), and [`AsyncUnsupported`] names
//! what the async backend refuses.

use std::sync::OnceLock;

use tensormem_cuda_alloc::config::{AllocatorConfig, Backend, ConfigResult};

use crate::error::{Error, Result};
use crate::unsupported::AsyncUnsupported;

/// The process's backend and the configuration it was read from.
#[derive(Debug)]
pub(crate) struct Choice {
    /// The configuration the environment holds (either backend).
    pub(crate) config: AllocatorConfig,
}

impl Choice {
    /// The backend that serves the process.
    pub(crate) fn backend(&self) -> Backend {
        self.config.backend
    }
}

/// Reads the choice from an environment given as a lookup function (the decision, without
/// remembering it).
pub(crate) fn decide<F>(lookup: F) -> ConfigResult<Choice>
where
    F: FnMut(&'static str) -> Option<std::ffi::OsString>,
{
    Ok(Choice {
        config: AllocatorConfig::read_env_from(lookup)?,
    })
}

/// The process's choice, read from the environment by the first call that needs it and kept for the
/// life of the process. A malformed configuration is an error each time (nothing is chosen then).
pub(crate) fn choice() -> Result<&'static Choice> {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    if let Some(choice) = CHOICE.get() {
        return Ok(choice);
    }
    let decided = decide(std::env::var_os)?;
    let choice = CHOICE.get_or_init(|| decided);
    tracing::debug!(target: "tensormem_runtime", backend = %choice.backend(), "the process's allocator backend");
    Ok(choice)
}

/// The name of the allocator backend that serves device memory in this process
/// (`torch.cuda.get_allocator_backend()`): [`Backend::Native`] (`"native"`, tensormem's caching
/// allocator) or [`Backend::CudaMallocAsync`] (`"cudaMallocAsync"`,
/// [`AsyncAllocator`](tensormem_cuda_alloc::AsyncAllocator)), as the
/// allocator configuration in the environment asks; [`Backend::name`] is PyTorch's spelling. Read
/// once, by the first call that needs an allocator (or this one), as PyTorch reads it once; it
/// cannot change afterwards ([`apply_settings`](crate::apply_settings) refuses another backend).
/// Needs no driver.
///
/// # Errors
///
/// [`Error::Alloc`] with the configuration error when the variable holds a malformed configuration.
pub fn get_allocator_backend() -> Result<Backend> {
    Ok(choice()?.backend())
}

/// The backend the environment's allocator configuration asks for now (`TENSORMEM_ALLOC_CONF`, else
/// PyTorch's variables; `backend:native` when none names one), read again at each call. The backend
/// the process runs is [`get_allocator_backend`], read once.
///
/// # Errors
///
/// [`Error::Alloc`] when the variable holds a malformed configuration.
pub fn configured_backend() -> Result<Backend> {
    Ok(AllocatorConfig::read_env()?.backend)
}

/// `Ok` when the process's backend supports `what`; [`Error::AsyncUnsupported`] when the process
/// runs `backend:cudaMallocAsync`, which refuses it. Reads no device: a refusal needs no driver.
///
/// # Errors
///
/// As said; the configuration's error when it is malformed.
pub fn backend_supports(what: AsyncUnsupported) -> Result<()> {
    match choice()?.backend() {
        Backend::Native => Ok(()),
        Backend::CudaMallocAsync => Err(Error::AsyncUnsupported(what)),
    }
}

/// `Ok` when `config` (a run-time configuration string) keeps the process's backend, which it may
/// name again or leave out; [`Error::BackendChanged`] when it names the other one (PyTorch: the
/// backend parsed at run time must be the one parsed at load time).
///
/// # Errors
///
/// As said; the string's configuration error when it is malformed.
pub fn check_unchanged(running: Backend, config: &str) -> Result<AllocatorConfig> {
    let mut probe = AllocatorConfig {
        backend: running,
        ..AllocatorConfig::default()
    };
    probe.apply(config)?;
    if probe.backend == running {
        Ok(probe)
    } else {
        Err(Error::BackendChanged {
            asked: probe.backend,
            running,
        })
    }
}

#[cfg(test)]
mod tests;
