//! What a device is: name, compute capability, memory, multiprocessors, UUID (`torch.cuda.get_device_properties`),
//! and whether one device can access another's memory.

use std::fmt;

use cudarc::driver::sys;
use cudarc::driver::sys::CUdevice_attribute as Attr;

use super::driver::{attribute, check, device_handle};
use crate::device::DeviceResult;

/// A device's 128-bit UUID (`cuDeviceGetUuid`). Displays as PyTorch prints `_CUuuid`:
/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` in lower-case hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct DeviceUuid(pub [u8; 16]);

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// The properties `torch.cuda.get_device_properties` reports (its `_CudaDeviceProperties`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DeviceProperties {
    /// The ordinal the properties were read for.
    pub index: u32,
    /// The product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability, major part (9 for Hopper).
    pub major: i32,
    /// Compute capability, minor part.
    pub minor: i32,
    /// Global memory in bytes (`totalGlobalMem`).
    pub total_memory: u64,
    /// Number of streaming multiprocessors.
    pub multi_processor_count: i32,
    /// Maximum resident threads per multiprocessor.
    pub max_threads_per_multi_processor: i32,
    /// 32-bit registers per multiprocessor.
    pub regs_per_multiprocessor: i32,
    /// Whether the GPU is integrated with the host (shares its memory).
    pub is_integrated: bool,
    /// Whether the device is on a board with several GPUs.
    pub is_multi_gpu_board: bool,
    /// The device's UUID.
    pub uuid: DeviceUuid,
}

impl fmt::Display for DeviceProperties {
    /// The form of PyTorch's `repr(torch.cuda.get_device_properties(i))`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "_CudaDeviceProperties(name='{}', major={}, minor={}, total_memory={}MB, \
             multi_processor_count={}, uuid={})",
            self.name,
            self.major,
            self.minor,
            self.total_memory / (1024 * 1024),
            self.multi_processor_count,
            self.uuid
        )
    }
}

/// Reads the properties of device `ordinal` (`cuDeviceGetName`, `cuDeviceTotalMem`,
/// `cuDeviceGetAttribute`, `cuDeviceGetUuid`). Needs no context, so it does not initialise one.
///
/// # Errors
///
/// The driver's errors; an ordinal past the device count is `CUDA_ERROR_INVALID_DEVICE`.
///
/// # References
///
/// - [`cuDeviceGetName`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
/// - [`cuDeviceTotalMem`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
/// - [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
/// - [`cuDeviceGetUuid`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
#[doc(alias = "cudaGetDeviceProperties")]
pub fn device_properties(ordinal: u32) -> DeviceResult<DeviceProperties> {
    let dev = device_handle(ordinal)?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: `name` is a writable buffer of the length passed; the driver NUL-terminates within it.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
    })?;
    let name_bytes: Vec<u8> = name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let mut total = 0usize;
    // SAFETY: `dev` is a valid device handle; `total` is a valid out-parameter.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `dev` is a valid device handle; `uuid` is a valid out-parameter.
    check("cuDeviceGetUuid", unsafe {
        sys::cuDeviceGetUuid_v2(&mut uuid, dev)
    })?;
    Ok(DeviceProperties {
        index: ordinal,
        name: String::from_utf8_lossy(&name_bytes).into_owned(),
        major: attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        minor: attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        total_memory: total as u64,
        multi_processor_count: attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        max_threads_per_multi_processor: attribute(
            dev,
            Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
        )?,
        regs_per_multiprocessor: attribute(
            dev,
            Attr::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
        )?,
        is_integrated: attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0,
        is_multi_gpu_board: attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD)? != 0,
        uuid: DeviceUuid(uuid.bytes.map(|b| b as u8)),
    })
}

/// Whether device `device` can access memory of device `peer` directly (`cuDeviceCanAccessPeer`).
/// A device and itself: `false`, as in PyTorch (`can_device_access_peer(0, 0)` is false).
///
/// # Errors
///
/// The driver's errors; an ordinal past the device count is `CUDA_ERROR_INVALID_DEVICE`.
///
/// # References
///
/// - [`cuDeviceCanAccessPeer`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html) (Peer Context Memory Access)
#[doc(alias = "cuDeviceCanAccessPeer")]
pub fn can_access_peer(device: u32, peer: u32) -> DeviceResult<bool> {
    let dev = device_handle(device)?;
    let peer_dev = device_handle(peer)?;
    if device == peer {
        return Ok(false);
    }
    let mut can = 0;
    // SAFETY: both handles are valid; `can` is a valid out-parameter.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, dev, peer_dev)
    })?;
    Ok(can != 0)
}
