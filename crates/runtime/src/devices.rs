//! The process's one table of devices, and the process-wide state beside it.
//!
//! Per device ordinal: the caching allocator (made on first use, configured from the environment,
//! then by every settings string applied since, with history recording and the out-of-memory
//! observers set so far), the `backend:cudaMallocAsync` allocator (made on first use, on the
//! device's default memory pool) and the pinned host allocator. Beside them: the settings applied,
//! the observers, and the IPC producer and consumer. Made on first use, never dropped (like
//! PyTorch's allocators); the producer gives its ref-counter files back at normal exit.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tensormem_cuda_alloc::backend::cuda::{self as backend, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::{caching_disabled_by_env, AllocatorConfig, Backend};
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::oom::OomEvent;
use tensormem_cuda_alloc::{AsyncAllocator, CachingAllocator, RecordContext};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{IpcConsumer, IpcProducer};

use crate::backend::{self as process_backend, check_unchanged};
use crate::device_allocator::DeviceAllocator;
use crate::error::{Error, Result};
use crate::fork;

/// An out-of-memory observer shared by every device's caching allocator.
pub type SharedOomObserver = Arc<dyn Fn(&OomEvent) + Send + Sync>;

/// Told of every caching allocator the process opens (those opened already when it is added, and
/// each one opened later), once per allocator.
pub type OpenObserver = Arc<dyn Fn(&'static CachingAllocator<CudaBackend>) + Send + Sync>;

/// The table: one slot per device ordinal, and the process-wide state.
struct Table {
    devices: Box<[DeviceState]>,
}

/// What the process keeps for one device.
pub struct DeviceState {
    ordinal: u32,
    caching: OnceLock<Arc<CachingAllocator<CudaBackend>>>,
    async_allocator: OnceLock<AsyncAllocator>,
    host: OnceLock<HostCachingAllocator<CudaBackend>>,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("ordinal", &self.ordinal)
            .field("caching", &self.caching.get().is_some())
            .field("async", &self.async_allocator.get().is_some())
            .field("host", &self.host.get().is_some())
            .finish()
    }
}

/// Settings made for all devices, including those not opened yet (PyTorch's allocator settings and
/// history recording are process-wide); also held while a device's allocator is made, so that one
/// made concurrently with a change gets the change exactly once.
#[derive(Default)]
struct ProcessSettings {
    /// Configuration strings applied, in order, after the environment's.
    applied: Vec<String>,
    /// History recording: (enabled, max entries, stack context), when set.
    history: Option<(bool, usize, RecordContext)>,
    /// Whether the pinned host allocators record their history too.
    record_host: bool,
    /// Out-of-memory observers for every device, in order.
    oom_observers: Vec<SharedOomObserver>,
    /// Observers of caching allocators opened.
    open_observers: Vec<OpenObserver>,
}

static SETTINGS: Mutex<ProcessSettings> = Mutex::new(ProcessSettings {
    applied: Vec::new(),
    history: None,
    record_host: false,
    oom_observers: Vec::new(),
    open_observers: Vec::new(),
});

fn settings() -> MutexGuard<'static, ProcessSettings> {
    SETTINGS.lock().unwrap_or_else(PoisonError::into_inner)
}

static TABLE: OnceLock<Table> = OnceLock::new();

/// `Err(Error::ForkedChild)` in a child forked after CUDA was initialised (or tried) in an
/// ancestor: every entry point of the runtime refuses there, whichever crate asked.
///
/// # Errors
///
/// As said.
#[inline]
pub fn check_not_forked() -> Result<()> {
    if fork::is_in_bad_fork() {
        Err(Error::ForkedChild)
    } else {
        Ok(())
    }
}

/// The table if CUDA was initialised, without initialising it.
fn table_if_made() -> Result<Option<&'static Table>> {
    check_not_forked()?;
    Ok(TABLE.get())
}

/// The table, initialising CUDA on first use (after arming the bad-fork guard).
#[inline]
fn table() -> Result<&'static Table> {
    check_not_forked()?;
    if let Some(table) = TABLE.get() {
        return Ok(table);
    }
    // As PyTorch's `poison_fork`: armed before the first driver call, whether or not it succeeds.
    fork::poison_fork();
    let count = backend::device_count();
    fork::record_attempt(count.is_ok());
    let count = count?;
    Ok(TABLE.get_or_init(|| Table {
        devices: (0..count)
            .map(|ordinal| DeviceState {
                ordinal,
                caching: OnceLock::new(),
                async_allocator: OnceLock::new(),
                host: OnceLock::new(),
            })
            .collect(),
    }))
}

/// How many CUDA devices the process sees (initialising CUDA on first use).
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork; the driver's errors when CUDA cannot be initialised.
pub fn device_count() -> Result<u32> {
    Ok(table()?.devices.len() as u32)
}

/// `Ok` if `device` is a valid ordinal.
///
/// # Errors
///
/// [`Error::InvalidDevice`]; as [`device_count`].
pub fn check_ordinal(device: u32) -> Result<()> {
    device_state(device).map(|_| ())
}

/// The state of `device` (nothing is opened by asking).
///
/// # Errors
///
/// [`Error::InvalidDevice`] for an ordinal past the device count; as [`device_count`].
#[inline]
pub fn device_state(device: u32) -> Result<&'static DeviceState> {
    let table = table()?;
    table
        .devices
        .get(device as usize)
        .ok_or(Error::InvalidDevice {
            device,
            count: table.devices.len() as u32,
        })
}

/// The allocator serving `device`, as the process's backend says, made on first use.
///
/// # Errors
///
/// As [`device_state`]; the errors of making the allocator (the driver's, a malformed
/// configuration, a device without memory pools under `backend:cudaMallocAsync`).
#[inline]
pub fn allocator(device: u32) -> Result<DeviceAllocator> {
    device_state(device)?.allocator()
}

/// The process's caching allocator of `device`, made on first use: the one every user of the
/// device shares (storages, IPC, the device API, the PyTorch plugin).
///
/// # Errors
///
/// [`Error::AsyncUnsupported`] ([`AsyncUnsupported::CachingAllocator`]) under
/// `backend:cudaMallocAsync`; as [`allocator`].
///
/// [`AsyncUnsupported::CachingAllocator`]: crate::AsyncUnsupported::CachingAllocator
pub fn caching_allocator(device: u32) -> Result<&'static Arc<CachingAllocator<CudaBackend>>> {
    process_backend::backend_supports(crate::AsyncUnsupported::CachingAllocator)?;
    device_state(device)?.caching(&settings())
}

/// The `backend:cudaMallocAsync` allocator of `device`, made on first use: the device's default
/// memory pool with PyTorch's settings (release threshold `u64::MAX`). Under
/// `backend:cudaMallocAsync` it is the allocator that serves the device; under `backend:native` a
/// program may still ask for it.
///
/// # Errors
///
/// As [`device_state`]; the driver's errors (a device without memory pools among them).
pub fn async_allocator(device: u32) -> Result<&'static AsyncAllocator> {
    device_state(device)?.async_allocator()
}

impl DeviceState {
    /// The device ordinal.
    #[must_use]
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The allocator serving the device (see [`allocator`]).
    ///
    /// # Errors
    ///
    /// As [`allocator`].
    #[inline]
    pub fn allocator(&'static self) -> Result<DeviceAllocator> {
        if let Some(caching) = self.caching.get() {
            // Made only under `backend:native`.
            return Ok(DeviceAllocator::Native(caching));
        }
        if let Some(allocator) = self.async_allocator.get() {
            if process_backend::choice()?.backend() == Backend::CudaMallocAsync {
                return Ok(DeviceAllocator::Async(allocator));
            }
        }
        self.open()
    }

    #[cold]
    fn open(&'static self) -> Result<DeviceAllocator> {
        match process_backend::choice()?.backend() {
            Backend::Native => Ok(DeviceAllocator::Native(self.caching(&settings())?)),
            Backend::CudaMallocAsync => Ok(DeviceAllocator::Async(self.async_allocator()?)),
        }
    }

    /// The caching allocator, made now with the process's settings if it was not (the settings'
    /// lock held by the caller).
    fn caching(
        &'static self,
        process: &ProcessSettings,
    ) -> Result<&'static Arc<CachingAllocator<CudaBackend>>> {
        if let Some(caching) = self.caching.get() {
            return Ok(caching);
        }
        let config = AllocatorConfig::from_env().map_err(tensormem_cuda_alloc::Error::from)?;
        let allocator = CachingAllocator::with_config(CudaBackend::new(self.ordinal)?, config);
        allocator.set_caching_disabled(caching_disabled_by_env());
        for applied in &process.applied {
            allocator.apply_settings(applied)?;
        }
        if let Some((enabled, max_entries, context)) = process.history {
            allocator.record_history_with_context(enabled, max_entries, context);
        }
        for observer in &process.oom_observers {
            attach_shared(&allocator, observer);
        }
        let caching = self.caching.get_or_init(|| Arc::new(allocator));
        tracing::debug!(target: "tensormem_runtime", device = self.ordinal,
            "opened the process's caching allocator");
        for observer in &process.open_observers {
            observer(caching);
        }
        Ok(caching)
    }

    fn async_allocator(&'static self) -> Result<&'static AsyncAllocator> {
        if let Some(allocator) = self.async_allocator.get() {
            return Ok(allocator);
        }
        let _opening = settings();
        if let Some(allocator) = self.async_allocator.get() {
            return Ok(allocator);
        }
        let made = AsyncAllocator::new(CudaBackend::new(self.ordinal)?)?;
        tracing::debug!(target: "tensormem_runtime", device = self.ordinal,
            "opened the device's async allocator");
        Ok(self.async_allocator.get_or_init(|| made))
    }

    /// The device.
    ///
    /// # Errors
    ///
    /// As [`allocator`].
    pub fn device(&'static self) -> Result<&'static CudaBackend> {
        Ok(match self.allocator()? {
            DeviceAllocator::Native(a) => a.device(),
            DeviceAllocator::Async(a) => a.device(),
        })
    }

    /// The settings the device's allocator runs with: the caching allocator's, or under
    /// `backend:cudaMallocAsync` the environment's with the strings applied since (they configure
    /// the pinned host allocators; the caching allocator's keys mean nothing there).
    ///
    /// # Errors
    ///
    /// As [`allocator`].
    pub fn config(&'static self) -> Result<AllocatorConfig> {
        match self.allocator()? {
            DeviceAllocator::Native(a) => Ok(a.config()),
            DeviceAllocator::Async(_) => async_config(&settings()),
        }
    }

    /// The device's pinned host allocator, configured by the allocator's settings
    /// (`pinned_use_cuda_host_register`, `pinned_num_register_threads`,
    /// `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`) when first used, recording
    /// its history if `record_pinned_host_memory` recording is on.
    ///
    /// # Errors
    ///
    /// As [`allocator`].
    pub fn host(&'static self) -> Result<&'static HostCachingAllocator<CudaBackend>> {
        if let Some(host) = self.host.get() {
            return Ok(host);
        }
        let config = self.config()?;
        let device = CudaBackend::new(self.ordinal)?;
        let process = settings();
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
    #[must_use]
    pub fn host_if_made(&self) -> Option<&HostCachingAllocator<CudaBackend>> {
        self.host.get()
    }

    /// The allocator serving the device if it was made (without making it).
    fn made(&'static self, backend: Backend) -> Option<DeviceAllocator> {
        match backend {
            Backend::Native => self.caching.get().map(|a| DeviceAllocator::Native(a)),
            Backend::CudaMallocAsync => self.async_allocator.get().map(DeviceAllocator::Async),
        }
    }
}

/// The settings under `backend:cudaMallocAsync`: the environment's, then the strings applied
/// since.
fn async_config(process: &ProcessSettings) -> Result<AllocatorConfig> {
    let mut config = process_backend::choice()?.config.clone();
    for applied in &process.applied {
        config.apply(applied)?;
    }
    Ok(config)
}

/// The states of the devices, if CUDA was initialised (none otherwise; initialises nothing).
fn made_states() -> Result<impl Iterator<Item = &'static DeviceState>> {
    Ok(table_if_made()?
        .into_iter()
        .flat_map(|table| table.devices.iter()))
}

/// The devices whose serving allocator any user of the process made so far (the device API,
/// storages, the PyTorch plugin), in ordinal order, without allocating (what a search for a
/// pointer of unknown device walks). Initialises nothing: none before CUDA is.
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork; a malformed configuration.
#[inline]
pub fn opened() -> Result<impl Iterator<Item = (&'static DeviceState, DeviceAllocator)>> {
    let states = made_states()?;
    let backend = process_backend::choice()?.backend();
    Ok(states.filter_map(move |state| state.made(backend).map(|a| (state, a))))
}

/// The caching allocators made so far, in ordinal order (none before CUDA is initialised;
/// initialises nothing).
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork.
pub fn opened_caching_allocators(
) -> Result<impl Iterator<Item = &'static CachingAllocator<CudaBackend>>> {
    Ok(made_states()?.filter_map(|state| state.caching.get().map(|a| &**a)))
}

/// Applies a configuration string to every opened device's caching allocator and remembers it for
/// those opened later (and, under `backend:cudaMallocAsync`, for the pinned host allocators made
/// later). Checked on a copy first, so a malformed string (or one naming the other backend)
/// changes nothing.
///
/// # Errors
///
/// [`Error::BackendChanged`]; the string's configuration error; as [`device_count`].
pub fn apply_settings(config: &str) -> Result<()> {
    check_unchanged(process_backend::choice()?.backend(), config)?;
    let mut process = settings();
    for allocator in opened_caching_allocators()? {
        allocator.apply_settings(config)?;
    }
    process.applied.push(config.to_owned());
    tracing::debug!(target: "tensormem_runtime", config, "allocator settings applied");
    Ok(())
}

/// Which allocators a history call records.
#[derive(Clone, Copy, Debug)]
pub struct Recorded {
    /// The device allocators.
    pub cuda: bool,
    /// The pinned host allocators.
    pub host: bool,
}

/// Turns history recording on or off on every opened device's caching allocator and for those
/// opened later (when `recorded.cuda`; off otherwise), and on the pinned host allocators when
/// `recorded.host` (off for them otherwise, as PyTorch turns host recording off with any call
/// that does not ask for it).
///
/// # Errors
///
/// As [`device_count`].
pub fn record_history(
    enabled: bool,
    max_entries: usize,
    context: RecordContext,
    recorded: Recorded,
) -> Result<()> {
    let table = table()?;
    let mut process = settings();
    let host = enabled && recorded.host;
    let cuda = enabled && recorded.cuda;
    for allocator in opened_caching_allocators()? {
        allocator.record_history_with_context(cuda, max_entries, context);
    }
    for state in table.devices.iter() {
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

/// Attaches an out-of-memory observer to every opened device's caching allocator and to those
/// opened later.
///
/// # Errors
///
/// As [`device_count`].
pub fn attach_oom_observer(observer: SharedOomObserver) -> Result<()> {
    table()?;
    let mut process = settings();
    for allocator in opened_caching_allocators()? {
        attach_shared(allocator, &observer);
    }
    process.oom_observers.push(observer);
    Ok(())
}

/// Calls `observer` with every caching allocator opened so far and with each one opened later
/// (what an integration attaches its own hooks with, whoever opens the device first), with the
/// runtime's settings lock held: it must not call back into the runtime. Initialises nothing:
/// it may be registered before CUDA is.
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork.
pub fn on_caching_allocator(observer: OpenObserver) -> Result<()> {
    check_not_forked()?;
    let mut process = settings();
    for allocator in opened_caching_allocators()? {
        observer(allocator);
    }
    process.open_observers.push(observer);
    Ok(())
}

/// The process's IPC state: one producer (ref-counter files, limbo and event budget of every
/// device) and one consumer (opened-handle cache).
struct Ipc {
    producer: IpcProducer<CudaBackend, CudaIpcDriver>,
    consumer: IpcConsumer<CudaIpcDriver>,
}

static IPC: OnceLock<Ipc> = OnceLock::new();

fn ipc() -> Result<&'static Ipc> {
    if let Some(ipc) = IPC.get() {
        return Ok(ipc);
    }
    table()?;
    let _making = settings();
    if let Some(ipc) = IPC.get() {
        return Ok(ipc);
    }
    let driver = Arc::new(CudaIpcDriver::new()?);
    let producer = IpcProducer::new(Arc::clone(&driver));
    // Rust never drops statics: PyTorch's IPC state gives its files back at static destruction.
    producer.register_exit_hook();
    Ok(IPC.get_or_init(|| Ipc {
        producer,
        consumer: IpcConsumer::new(driver),
    }))
}

/// The process's IPC producer (PyTorch's `CudaIPCGlobalEntities`): one set of ref-counter files,
/// one limbo and one event budget for every device. Its ref-counter files are given back when the
/// process exits normally.
///
/// # Errors
///
/// As [`device_count`]; the IPC driver's.
pub fn producer() -> Result<&'static IpcProducer<CudaBackend, CudaIpcDriver>> {
    Ok(&ipc()?.producer)
}

/// The process's IPC consumer: one cache of opened memory handles, files and events.
///
/// # Errors
///
/// As [`producer`].
pub fn consumer() -> Result<&'static IpcConsumer<CudaIpcDriver>> {
    Ok(&ipc()?.consumer)
}

/// PyTorch's `torch.cuda.ipc_collect()`: frees the memory consumer processes released, of every
/// device. Returns whether any memory was freed (`false` when nothing was ever shared).
pub fn ipc_collect() -> bool {
    IPC.get().is_some_and(|ipc| ipc.producer.collect())
}
