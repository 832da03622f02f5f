//! What the GPU test files of this crate share.

use cudarc::nccl::result;
use tensormem_cuda_alloc::backend::cuda;
use tensormem_test_support::{gpu, skip};

/// Whether two devices and NCCL are here (after saying why not).
/// A machine with one GPU skips (the tests need a two-GPU host); with `TENSORMEM_REQUIRE_GPU=1`, no
/// device at all, or two devices without a loadable NCCL, fail instead.
pub(crate) fn two_gpus_and_nccl() -> bool {
    if gpu::at_least(2, cuda::device_count()).is_none() {
        return false;
    }
    let reason = match std::panic::catch_unwind(result::get_nccl_version) {
        Ok(Ok(_)) => return true,
        Ok(Err(e)) => format!("NCCL: {e:?}"),
        Err(_) => {
            "libnccl.so cannot be loaded (put NCCL's lib directory on LD_LIBRARY_PATH)".to_owned()
        }
    };
    skip::unless_required(&[gpu::REQUIRE_GPU], &reason);
    false
}
