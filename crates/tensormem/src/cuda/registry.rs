//! The device API's table of devices: per device ordinal, the allocator that serves it as the
//! process's backend says ([`backend`](super::backend)): under `backend:native` the process's
//! caching allocator (the one `tensormem_ipc::registry::cuda()` keeps for every user of the device:
//! storages, IPC, the PyTorch plugin) with the device API's settings applied, under
//! `backend:cudaMallocAsync` the device's `AsyncAllocator`; and a pinned host allocator. Made on
//! first use, never dropped (like PyTorch's per-device allocators).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tensormem_cuda_alloc::backend::cuda::{self as backend, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend};
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::oom::OomEvent;
use tensormem_cuda_alloc::{CachingAllocator, RecordContext};
use tensormem_ipc::registry as process_devices;

use super::backend::{self as process_backend, DeviceAllocator};
use super::error::{Error, Result};
use super::fork;

/// All devices of the process.
#[derive(Debug)]
pub(crate) struct Registry {
    /// One slot per device ordinal, filled on the device's first use.
    devices: Box<[OnceLock<DeviceState>]>,
}

/// What the device API keeps per device: the allocator that serves it, which owns the
/// [`CudaBackend`].
#[derive(Debug)]
pub(crate) struct DeviceState {
    allocator: DeviceAllocator,
    /// The pinned host allocator whose blocks' reuse waits on this device's streams, made on first use.
    host: OnceLock<HostCachingAllocator<CudaBackend>>,
}

/// Settings made for all devices, including those not opened yet (PyTorch's allocator settings and
/// history recording are process-wide).
#[derive(Default)]
struct ProcessSettings {
    /// Configuration strings applied with `set_allocator_settings`, in order, after the environment's.
    applied: Vec<String>,
    /// History recording: (enabled, max entries, stack context), when set.
    history: Option<(bool, usize, RecordContext)>,
    /// Whether the pinned host allocators record their history too (`record_pinned_host_memory`).
    record_host: bool,
    /// Out-of-memory observers attached for every device, in order.
    oom_observers: Vec<SharedOomObserver>,
}

impl std::fmt::Debug for ProcessSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessSettings")
            .field("applied", &self.applied)
            .field("history", &self.history)
            .field("record_host", &self.record_host)
            .field("oom_observers", &self.oom_observers.len())
            .finish()
    }
}

/// An out-of-memory observer shared by every device's allocator.
pub(crate) type SharedOomObserver = Arc<dyn Fn(&OomEvent) + Send + Sync>;

/// Process-wide settings; also held while a device is opened, so that a device opened concurrently
/// with a settings change gets the change exactly once.
static SETTINGS: Mutex<ProcessSettings> = Mutex::new(ProcessSettings {
    applied: Vec::new(),
    history: None,
    record_host: false,
    oom_observers: Vec::new(),
});

fn settings() -> std::sync::MutexGuard<'static, ProcessSettings> {
    SETTINGS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DeviceState {
    /// Takes the allocator of the device that the process's backend says: the device's
    /// `AsyncAllocator`, or the process's caching allocator of the device (made now, configured from
    /// the environment, if no other user made it yet) with the strings applied since, history
    /// recording if it was turned on, and the out-of-memory observers.
    fn open(ordinal: u32, process: &ProcessSettings) -> Result<Self> {
        let allocator = match process_backend::choice()?.backend() {
            Backend::Native => DeviceAllocator::Native(open_native(ordinal, process)?),
            Backend::CudaMallocAsync => {
                DeviceAllocator::Async(super::async_backend::async_allocator_of(ordinal)?)
            }
        };
        Ok(Self {
            allocator,
            host: OnceLock::new(),
        })
    }

    /// The device's pinned host allocator, configured by the allocator's settings
    /// (`pinned_use_cuda_host_register`, `pinned_num_register_threads`,
    /// `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`) when first used, recording its
    /// history if `record_pinned_host_memory` recording is on.
    pub(crate) fn host(&self, ordinal: u32) -> Result<&HostCachingAllocator<CudaBackend>> {
        if let Some(host) = self.host.get() {
            return Ok(host);
        }
        let device = CudaBackend::new(ordinal)?;
        let process = settings();
        let config = self.allocator.serve(
            |allocator| Ok(allocator.config()),
            |_| async_config(&process),
        )?;
        let source = CudaPinnedSource::from_config(&device, &config);
        Ok(self.host.get_or_init(|| {
            let host = HostCachingAllocator::with_config(device, source, &config);
            if let (Some((true, max_entries, context)), true) =
                (process.history, process.record_host)
            {
                host.record_history(true, max_entries, context);
            }
            host
        }))
    }

    /// The device's pinned host allocator if it was made.
    pub(crate) fn host_if_made(&self) -> Option<&HostCachingAllocator<CudaBackend>> {
        self.host.get()
    }

    /// The device.
    pub(crate) fn device(&self) -> &'static CudaBackend {
        self.allocator.device()
    }

    /// The allocator that serves the device.
    pub(crate) fn allocator(&self) -> DeviceAllocator {
        self.allocator
    }
}

/// The process's caching allocator of `ordinal` with the device API's settings (see
/// [`DeviceState::open`]).
fn open_native(
    ordinal: u32,
    process: &ProcessSettings,
) -> Result<&'static CachingAllocator<CudaBackend>> {
    let allocator: &'static CachingAllocator<CudaBackend> =
        process_devices::cuda()?.allocator(ordinal)?;
    for applied in &process.applied {
        allocator.apply_settings(applied)?;
    }
    if let Some((enabled, max_entries, context)) = process.history {
        allocator.record_history_with_context(enabled, max_entries, context);
    }
    for observer in &process.oom_observers {
        attach_shared(allocator, observer);
    }
    Ok(allocator)
}

/// The settings under `backend:cudaMallocAsync`: the environment's, then the strings applied since
/// (they configure the pinned host allocators; the keys of the caching allocator mean nothing here).
fn async_config(process: &ProcessSettings) -> Result<AllocatorConfig> {
    let mut config = process_backend::choice()?.config.clone();
    for applied in &process.applied {
        config.apply(applied)?;
    }
    Ok(config)
}

/// The settings `state`'s allocator runs with.
pub(crate) fn config_of(state: &DeviceState) -> Result<AllocatorConfig> {
    state.allocator.serve(
        |allocator| Ok(allocator.config()),
        |_| async_config(&settings()),
    )
}

impl Registry {
    /// The number of devices.
    pub(crate) fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }
}

/// The registry, initialising CUDA on first use (after arming the bad-fork guard).
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork; the driver's errors when CUDA cannot be initialised.
#[inline]
pub(crate) fn get() -> Result<&'static Registry> {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    fork::check_not_forked()?;
    if let Some(registry) = REGISTRY.get() {
        return Ok(registry);
    }
    // As PyTorch's `poison_fork`: armed before the first driver call, whether or not it succeeds.
    fork::poison_fork();
    let count = backend::device_count();
    fork::record_attempt(count.is_ok());
    let count = count?;
    Ok(REGISTRY.get_or_init(|| Registry {
        devices: (0..count).map(|_| OnceLock::new()).collect(),
    }))
}

/// `Ok` if `device` is a valid ordinal.
pub(crate) fn check_ordinal(device: u32) -> Result<()> {
    let count = get()?.device_count();
    if device < count {
        Ok(())
    } else {
        Err(Error::InvalidDevice { device, count })
    }
}

/// The state of `device`, opened on first use.
///
/// # Errors
///
/// [`Error::InvalidDevice`] for an ordinal past the device count; the errors of opening the device.
#[inline]
pub(crate) fn device(device: u32) -> Result<&'static DeviceState> {
    let slot = slot(device)?;
    if let Some(state) = slot.get() {
        return Ok(state);
    }
    device_with(device, &settings())
}

fn slot(device: u32) -> Result<&'static OnceLock<DeviceState>> {
    let registry = get()?;
    registry
        .devices
        .get(device as usize)
        .ok_or(Error::InvalidDevice {
            device,
            count: registry.device_count(),
        })
}

/// [`device`], with the settings' lock held by the caller.
fn device_with(device: u32, process: &ProcessSettings) -> Result<&'static DeviceState> {
    let slot = slot(device)?;
    if let Some(state) = slot.get() {
        return Ok(state); // opened by another thread while this one waited for the settings
    }
    let state = DeviceState::open(device, process)?;
    Ok(slot.get_or_init(|| state))
}

/// The devices any user of the process opened so far (the device API, storages, the PyTorch
/// plugin), in ordinal order, with the device API's settings applied. Under
/// `backend:cudaMallocAsync`, the devices whose `AsyncAllocator` was made.
pub(crate) fn opened() -> Result<impl Iterator<Item = (u32, &'static DeviceState)>> {
    opened_with(&settings())
}

/// [`opened`], with the settings' lock held by the caller.
fn opened_with(
    process: &ProcessSettings,
) -> Result<impl Iterator<Item = (u32, &'static DeviceState)>> {
    get()?;
    let ordinals: Vec<u32> = match process_backend::choice()?.backend() {
        Backend::Native => process_devices::cuda_if_initialised()
            .into_iter()
            .flat_map(|devices| devices.opened().map(|(i, _)| i))
            .collect(),
        Backend::CudaMallocAsync => super::async_backend::made().collect(),
    };
    let states = ordinals
        .into_iter()
        .map(|i| Ok((i, device_with(i, process)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(states.into_iter())
}

/// Applies a configuration string to every opened device's caching allocator and remembers it for
/// devices opened later (and, under `backend:cudaMallocAsync`, for the pinned host allocators made
/// later). Checked on a copy first, so a malformed string (or one naming the other backend) changes
/// nothing.
pub(crate) fn apply_settings(config: &str) -> Result<()> {
    process_backend::check_unchanged(process_backend::choice()?.backend(), config)?;
    get()?;
    let mut process = settings();
    for (_, state) in opened_with(&process)? {
        if let DeviceAllocator::Native(allocator) = state.allocator {
            allocator.apply_settings(config)?;
        }
    }
    process.applied.push(config.to_owned());
    Ok(())
}

/// The allocators a history call records.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recorded {
    /// The device allocators.
    pub(crate) cuda: bool,
    /// The pinned host allocators.
    pub(crate) host: bool,
}

/// Turns history recording on or off on every opened device's allocator and for devices opened later
/// (when `recorded.cuda`; off otherwise), and on the pinned host allocators when `recorded.host`
/// (off for them otherwise, as PyTorch turns host recording off with any call that does not ask for
/// it).
pub(crate) fn record_history(
    enabled: bool,
    max_entries: usize,
    context: RecordContext,
    recorded: Recorded,
) -> Result<()> {
    get()?;
    let mut process = settings();
    let host = enabled && recorded.host;
    let cuda = enabled && recorded.cuda;
    for (_, state) in opened_with(&process)? {
        if let DeviceAllocator::Native(allocator) = state.allocator {
            allocator.record_history_with_context(cuda, max_entries, context);
        }
        if let Some(allocator) = state.host.get() {
            allocator.record_history(host, max_entries, context);
        }
    }
    process.history = Some((cuda, max_entries, context));
    process.record_host = host;
    Ok(())
}

fn attach_shared(allocator: &CachingAllocator<CudaBackend>, observer: &SharedOomObserver) {
    let observer = Arc::clone(observer);
    allocator.attach_oom_observer(Box::new(move |event| observer(event)));
}

/// Attaches an out-of-memory observer to every opened device's allocator and to those opened later.
pub(crate) fn attach_oom_observer(observer: SharedOomObserver) -> Result<()> {
    get()?;
    let mut process = settings();
    for (_, state) in opened_with(&process)? {
        if let DeviceAllocator::Native(allocator) = state.allocator {
            attach_shared(allocator, &observer);
        }
    }
    process.oom_observers.push(observer);
    Ok(())
}
