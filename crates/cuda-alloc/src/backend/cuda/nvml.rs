//! The processes using a device, from NVML, for the out-of-memory message (PyTorch's
//! `reportProcessMemoryInfo`).
//!
//! PyTorch opens `libnvidia-ml.so.1` at run time (`DriverAPI::get_nvml_handle`), initialises NVML
//! once (`nvmlInit_v2`), finds the device by its PCI bus id (`nvmlDeviceGetHandleByPciBusId_v2`) and
//! lists its compute processes (`nvmlDeviceGetComputeRunningProcesses`, the `nvmlProcessInfo_v1_t`
//! form); without the library the message has no process sentences. This module does the same
//! through `libloading` (the loader cudarc already uses for `libcuda.so`), with one difference: where
//! PyTorch asserts that NVML succeeds, a failure here only leaves the sentences out, since an
//! out-of-memory error must never become another error or a panic.
//!
//! The library and its three functions are looked up once per process and kept (NVML is never shut
//! down, as in PyTorch).
//!
//! # References
//! - [NVML API reference](https://docs.nvidia.com/deploy/nvml-api/): `nvmlInit_v2`,
//!   `nvmlDeviceGetHandleByPciBusId_v2`, `nvmlDeviceGetComputeRunningProcesses`.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use libloading::Library;

use super::driver::{attribute, device_handle};
use crate::device::ProcessMemory;

/// `nvmlReturn_t`'s success.
const NVML_SUCCESS: c_int = 0;
/// `nvmlReturn_t`'s "the buffer is too small" (the count needed is written back).
const NVML_ERROR_INSUFFICIENT_SIZE: c_int = 7;
/// How many times the process list is asked for again when it grew between two calls.
const MAX_TRIES: usize = 8;

/// `nvmlProcessInfo_v1_t`: what `nvmlDeviceGetComputeRunningProcesses` (the unversioned symbol, as
/// PyTorch binds it) writes per process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: u64,
}

/// `nvmlDevice_t`.
type NvmlDevice = *mut c_void;
type InitFn = unsafe extern "C" fn() -> c_int;
type HandleByPciBusIdFn = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int;
type ComputeProcessesFn =
    unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut ProcessInfoV1) -> c_int;

/// NVML, opened and initialised.
#[derive(Debug)]
struct Nvml {
    /// Keeps the library, so the function pointers below stay valid.
    _library: Library,
    handle_by_pci_bus_id: HandleByPciBusIdFn,
    compute_running_processes: ComputeProcessesFn,
}

impl Nvml {
    /// Opens `libnvidia-ml.so.1` and initialises NVML; `None` where the library, a function or the
    /// initialisation is missing.
    fn open() -> Option<Nvml> {
        // SAFETY: loading the driver's NVML library runs its initialisers, which have no
        // preconditions (PyTorch and nvidia-smi load it the same way).
        let library = unsafe { Library::new("libnvidia-ml.so.1") }.ok()?;
        // SAFETY: the three symbols have these C signatures in every NVML since the `_v2` entry
        // points (CUDA 5); the pointers are used only while `library` is kept alive, in `Nvml`.
        let (init, handle_by_pci_bus_id, compute_running_processes) = unsafe {
            (
                *library.get::<InitFn>(c"nvmlInit_v2").ok()?,
                *library
                    .get::<HandleByPciBusIdFn>(c"nvmlDeviceGetHandleByPciBusId_v2")
                    .ok()?,
                *library
                    .get::<ComputeProcessesFn>(c"nvmlDeviceGetComputeRunningProcesses")
                    .ok()?,
            )
        };
        // SAFETY: `nvmlInit_v2` takes no arguments and may be called from any thread, any number of
        // times (NVML counts them).
        if unsafe { init() } != NVML_SUCCESS {
            tracing::debug!("nvmlInit_v2 failed: out-of-memory messages list no processes");
            return None;
        }
        Some(Nvml {
            _library: library,
            handle_by_pci_bus_id,
            compute_running_processes,
        })
    }

    /// The compute processes on the device at `pci_bus_id`, and the memory each holds.
    fn processes(&self, pci_bus_id: &CString) -> Option<Vec<ProcessInfoV1>> {
        let mut device: NvmlDevice = std::ptr::null_mut();
        // SAFETY: `pci_bus_id` is a NUL-terminated string and `device` a valid out-parameter; NVML
        // is initialised.
        let found = unsafe { (self.handle_by_pci_bus_id)(pci_bus_id.as_ptr(), &mut device) };
        if found != NVML_SUCCESS {
            return None;
        }
        let mut processes = vec![ProcessInfoV1::default(); 8];
        for _ in 0..MAX_TRIES {
            let mut count = c_uint::try_from(processes.len()).ok()?;
            // SAFETY: `device` came from NVML; `processes` has room for `count` entries, and NVML
            // writes at most that many (or, refusing with INSUFFICIENT_SIZE, the count it needs).
            let listed = unsafe {
                (self.compute_running_processes)(device, &mut count, processes.as_mut_ptr())
            };
            match listed {
                NVML_SUCCESS => {
                    processes.truncate(count as usize);
                    return Some(processes);
                }
                NVML_ERROR_INSUFFICIENT_SIZE => {
                    // `count` is what NVML needs now; grow at least by one in any case.
                    let needed = (count as usize).max(processes.len() + 1);
                    processes.resize(needed, ProcessInfoV1::default());
                }
                _ => return None,
            }
        }
        None
    }
}

/// The process's NVML, opened on first use; `None` where it cannot be.
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(Nvml::open).as_ref()
}

/// NVML's PCI bus id of device `ordinal` (`NVML_DEVICE_PCI_BUS_ID_FMT`, `%08X:%02X:%02X.0`, from
/// the driver's PCI domain, bus and device numbers, as PyTorch builds it from `cudaDeviceProp`).
fn pci_bus_id(ordinal: u32) -> Option<CString> {
    let dev = device_handle(ordinal).ok()?;
    let domain = attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID).ok()?;
    let bus = attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID).ok()?;
    let device = attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID).ok()?;
    CString::new(format!("{domain:08X}:{bus:02X}:{device:02X}.0")).ok()
}

/// The processes using device `ordinal` and the memory each holds, this process marked, in NVML's
/// order; `None` where NVML is missing or refuses.
pub(crate) fn process_memory(ordinal: u32) -> Option<Vec<ProcessMemory>> {
    let nvml = nvml()?;
    let listed = nvml.processes(&pci_bus_id(ordinal)?)?;
    let this = std::process::id();
    Some(
        listed
            .into_iter()
            .map(|p| ProcessMemory {
                pid: p.pid,
                used_bytes: p.used_gpu_memory,
                this_process: p.pid == this,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v1_process_record_has_nvmls_layout() {
        // `unsigned int pid; unsigned long long usedGpuMemory;`: 16 bytes, the second field at 8.
        assert_eq!(std::mem::size_of::<ProcessInfoV1>(), 16);
        assert_eq!(std::mem::offset_of!(ProcessInfoV1, used_gpu_memory), 8);
    }

    #[test]
    fn without_nvml_or_a_device_there_is_no_list_and_no_panic() {
        // On a machine without a GPU (CI) this is `None`; on a GPU host, a list. Either way the call
        // returns.
        let listed = process_memory(0);
        if let Some(list) = listed {
            assert!(list.iter().filter(|p| p.this_process).count() <= 1);
        }
    }
}
