//! One caching allocator per device and one IPC producer and consumer per process, shared by every
//! user: PyTorch's process-wide `CUDACachingAllocator` and `CudaIPCGlobalEntities`.
//!
//! PyTorch has one caching allocator per device in a process, and one set of IPC state (ref-counter
//! files, the limbo, the event budget of [`MAXIMUM_EVENTS_TO_USE`](crate::MAXIMUM_EVENTS_TO_USE)).
//! If each user of a device made its own allocator, two caches would compete for one device, memory
//! statistics and `empty_cache` would see only one of them, and every user would spend its own
//! event budget and keep its own files. [`ProcessDevices`] is that process-wide state:
//!
//! - [`allocator`](ProcessDevices::allocator): the device's caching allocator, made on first use and
//!   kept for the life of the process;
//! - [`producer`](ProcessDevices::producer) and [`consumer`](ProcessDevices::consumer): one IPC
//!   producer (files, limbo, events of every device) and one consumer (opened-handle cache);
//! - [`ipc_collect`](ProcessDevices::ipc_collect): PyTorch's `torch.cuda.ipc_collect()`.
//!
//! A `ProcessDevices` usually lives in a static, which Rust never drops; PyTorch drops its IPC state
//! at static destruction (warning about memory consumers still hold, and closing its ref-counter
//! files). So the producer is registered to [`close_at_exit`](IpcProducer::close_at_exit) when the
//! process exits normally ([`IpcProducer::register_exit_hook`]): no file of the process is left in
//! `/dev/shm` after it ends, and the warning is given.
//!
//! [`cuda()`] (feature `cuda`) is the process's instance on the CUDA driver; the device API
//! (`tensormem::cuda`), CUDA storages (`tensormem-storage`) and the PyTorch plugin all take their
//! allocators from it. It lives here, the lowest crate all of them depend on, because the IPC state
//! must be per process too. Tests make their own instances on the simulated device and the fake
//! driver.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tensormem_cuda_alloc::{CachingAllocator, Device};

use crate::driver::IpcDriver;
use crate::error::{Error, Result};
use crate::producer::IpcProducer;
use crate::received::IpcConsumer;

/// Makes the caching allocator of a device ordinal, the first time the device is used.
pub type OpenDevice<D> = dyn Fn(u32) -> Result<CachingAllocator<D>> + Send + Sync;

/// The allocators of a process's devices and its IPC producer and consumer (see the
/// [module docs](self)).
pub struct ProcessDevices<D: Device, B: IpcDriver> {
    /// One slot per device ordinal, filled on the device's first use, never emptied.
    devices: Box<[OnceLock<Arc<CachingAllocator<D>>>]>,
    /// Held while a device is opened, so that each is opened once.
    opening: Mutex<()>,
    open: Box<OpenDevice<D>>,
    producer: IpcProducer<D, B>,
    consumer: IpcConsumer<B>,
}

impl<D: Device, B: IpcDriver> std::fmt::Debug for ProcessDevices<D, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessDevices")
            .field("devices", &self.devices.len())
            .field("opened", &self.opened().map(|(i, _)| i).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<D: Device, B: IpcDriver> ProcessDevices<D, B> {
    /// Process-wide state for `device_count` devices reached through `driver`; `open` makes a
    /// device's allocator on its first use. Its producer closes its ref-counter files when the
    /// process exits normally, if it is still alive then ([`IpcProducer::register_exit_hook`]).
    pub fn new(
        driver: Arc<B>,
        device_count: u32,
        open: impl Fn(u32) -> Result<CachingAllocator<D>> + Send + Sync + 'static,
    ) -> Self {
        let producer = IpcProducer::new(Arc::clone(&driver));
        producer.register_exit_hook();
        Self {
            devices: (0..device_count).map(|_| OnceLock::new()).collect(),
            opening: Mutex::new(()),
            open: Box::new(open),
            producer,
            consumer: IpcConsumer::new(driver),
        }
    }

    /// How many devices there are.
    #[must_use]
    pub fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    /// The caching allocator of `device`, made on first use; the same one for every caller.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDevice`] for an ordinal past the device count; the errors of opening the
    /// device (no such device, a malformed allocator configuration). A device that failed to open
    /// is tried again by the next call.
    pub fn allocator(&self, device: u32) -> Result<&Arc<CachingAllocator<D>>> {
        let Some(slot) = self.devices.get(device as usize) else {
            return Err(Error::InvalidDevice {
                device: i64::from(device),
                count: self.device_count(),
            });
        };
        if let Some(allocator) = slot.get() {
            return Ok(allocator);
        }
        let _opening = self.opening.lock();
        if let Some(allocator) = slot.get() {
            return Ok(allocator); // opened by another thread while this one waited
        }
        let allocator = Arc::new((self.open)(device)?);
        tracing::debug!(target: "tensormem_ipc", device, "opened the process's caching allocator");
        Ok(slot.get_or_init(|| allocator))
    }

    /// The devices whose allocator was made so far, in ordinal order.
    pub fn opened(&self) -> impl Iterator<Item = (u32, &Arc<CachingAllocator<D>>)> {
        self.devices
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| slot.get().map(|a| (i as u32, a)))
    }

    /// The process's IPC producer: one set of ref-counter files, one limbo and one event budget
    /// for every device.
    #[must_use]
    pub fn producer(&self) -> &IpcProducer<D, B> {
        &self.producer
    }

    /// The process's IPC consumer: one cache of opened memory handles, files and events.
    #[must_use]
    pub fn consumer(&self) -> &IpcConsumer<B> {
        &self.consumer
    }

    /// Frees the memory that consumers released (PyTorch's `torch.cuda.ipc_collect()`): see
    /// [`IpcProducer::collect`]. Returns whether any memory was freed.
    pub fn ipc_collect(&self) -> bool {
        self.producer.collect()
    }
}

#[cfg(feature = "cuda")]
mod on_cuda {
    use std::sync::{Arc, OnceLock};

    use parking_lot::Mutex;
    use tensormem_cuda_alloc::backend::cuda::CudaBackend;
    use tensormem_cuda_alloc::config::{caching_disabled_by_env, AllocatorConfig};
    use tensormem_cuda_alloc::CachingAllocator;

    use super::ProcessDevices;
    use crate::driver::cuda::CudaIpcDriver;
    use crate::driver::IpcDriver;
    use crate::error::Result;

    static CUDA: OnceLock<ProcessDevices<CudaBackend, CudaIpcDriver>> = OnceLock::new();
    static INIT: Mutex<()> = Mutex::new(());

    /// The process's devices on the CUDA driver, initialised on first use: each device's allocator
    /// configured from `TENSORMEM_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`, with caching off
    /// when `TENSORMEM_NO_CUDA_MEMORY_CACHING` (or `PYTORCH_NO_CUDA_MEMORY_CACHING`) is set.
    ///
    /// # Errors
    ///
    /// [`Error::Driver`](crate::Error::Driver) when there is no usable driver (tried again by the
    /// next call).
    pub fn cuda() -> Result<&'static ProcessDevices<CudaBackend, CudaIpcDriver>> {
        if let Some(devices) = CUDA.get() {
            return Ok(devices);
        }
        let _init = INIT.lock();
        if let Some(devices) = CUDA.get() {
            return Ok(devices);
        }
        let driver = Arc::new(CudaIpcDriver::new()?);
        let count = driver.device_count()?;
        let devices = ProcessDevices::new(driver, count, |ordinal| {
            let config = AllocatorConfig::from_env().map_err(tensormem_cuda_alloc::Error::from)?;
            let allocator = CachingAllocator::with_config(CudaBackend::new(ordinal)?, config);
            allocator.set_caching_disabled(caching_disabled_by_env());
            Ok(allocator)
        });
        Ok(CUDA.get_or_init(|| devices))
    }

    /// The process's devices on the CUDA driver if [`cuda`] initialised them, without initialising
    /// anything.
    #[must_use]
    pub fn cuda_if_initialised() -> Option<&'static ProcessDevices<CudaBackend, CudaIpcDriver>> {
        CUDA.get()
    }

    /// PyTorch's `torch.cuda.ipc_collect()` for the whole process: frees the CUDA memory that
    /// consumer processes released, of every device. Returns whether any memory was freed (`false`
    /// when CUDA was never initialised through [`cuda`]: nothing was shared).
    pub fn ipc_collect() -> bool {
        cuda_if_initialised().is_some_and(ProcessDevices::ipc_collect)
    }
}

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use on_cuda::{cuda, cuda_if_initialised, ipc_collect};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::fake::FakeDriver;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tensormem_cuda_alloc::backend::sim::SimDevice;
    use tensormem_cuda_alloc::StreamId;

    fn devices(count: u32, opens: Arc<AtomicUsize>) -> ProcessDevices<SimDevice, FakeDriver> {
        ProcessDevices::new(Arc::new(FakeDriver::new(count)), count, move |_| {
            opens.fetch_add(1, Ordering::Relaxed);
            Ok(CachingAllocator::new(SimDevice::new(1 << 30)))
        })
    }

    #[test]
    fn each_device_is_opened_once_whoever_asks_first() {
        let opens = Arc::new(AtomicUsize::new(0));
        let devices = devices(2, Arc::clone(&opens));
        assert_eq!(devices.opened().count(), 0);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| Arc::as_ptr(devices.allocator(1).unwrap()) as usize))
                .collect();
            let ptrs: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert!(ptrs.windows(2).all(|w| w[0] == w[1]), "one allocator");
        });
        assert_eq!(opens.load(Ordering::Relaxed), 1);
        assert_eq!(
            devices.opened().map(|(i, _)| i).collect::<Vec<_>>(),
            vec![1]
        );
        assert!(matches!(
            devices.allocator(2),
            Err(Error::InvalidDevice {
                device: 2,
                count: 2
            })
        ));
    }

    #[test]
    fn a_failed_open_is_tried_again() {
        let tries = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&tries);
        let devices: ProcessDevices<SimDevice, FakeDriver> =
            ProcessDevices::new(Arc::new(FakeDriver::new(1)), 1, move |_| {
                if seen.fetch_add(1, Ordering::Relaxed) == 0 {
                    Err(Error::InvalidTuple {
                        problem: "first open fails".into(),
                    })
                } else {
                    Ok(CachingAllocator::new(SimDevice::new(1 << 20)))
                }
            });
        assert!(devices.allocator(0).is_err());
        assert!(devices.allocator(0).is_ok());
        assert_eq!(tries.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn every_user_shares_one_allocator_one_limbo_and_one_collect() {
        let devices = devices(2, Arc::new(AtomicUsize::new(0)));
        let s = StreamId(0);
        // Two users of device 0 (say, the device API and a storage) and one of device 1.
        let a = devices.allocator(0).unwrap();
        let b = devices.allocator(0).unwrap();
        assert!(Arc::ptr_eq(a, b));
        let c = devices.allocator(1).unwrap();
        let (first, h0) = devices
            .producer()
            .share(a, a.allocate(1000, s).unwrap(), s)
            .unwrap();
        let (second, h1) = devices
            .producer()
            .share(c, c.allocate(3000, s).unwrap(), s)
            .unwrap();
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 1024);
        assert_eq!(
            h0.ref_counter, h1.ref_counter,
            "one ref-counter file for the process"
        );
        assert_eq!(devices.producer().stats().events_in_use, 2, "one budget");
        let r0 = devices.consumer().open(&h0, s).unwrap();
        let r1 = devices.consumer().open(&h1, s).unwrap();
        drop((first, second));
        assert_eq!(devices.producer().stats().limbo, 2);
        drop((r0, r1));
        assert!(devices.ipc_collect(), "both devices' memory freed");
        assert_eq!(devices.producer().stats().limbo, 0);
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
        assert_eq!(c.memory_stats().allocated_bytes.all.current, 0);
    }
}
