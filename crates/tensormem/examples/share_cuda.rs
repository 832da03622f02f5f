//! Producer/consumer of a CUDA storage through CUDA IPC (PyTorch's `_share_cuda_` /
//! `_new_shared_cuda`).
//!
//! Run `cargo run -p tensormem --example share_cuda`. Without a CUDA driver or device it says so
//! and exits successfully. Otherwise the producer fills 8 MiB of device memory, shares it, and
//! starts this program again as the consumer with the encoded handle on its command line; the
//! consumer opens the memory, checks it, writes into it and exits; the producer sees the write.

use std::process::{Command, ExitCode};

use tensormem::storage::{storage_copy, CudaContext, IpcHandle, Storage};

const SIZE: usize = 8 << 20;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("share_cuda: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, wire] = args.as_slice() {
        if role == "consumer" {
            return consumer(wire);
        }
    }
    match tensormem::cuda::device_count() {
        Ok(n) if n > 0 => producer(),
        Ok(_) => {
            println!("share_cuda: no CUDA device here; nothing to do");
            Ok(())
        }
        Err(e) => {
            println!("share_cuda: no CUDA driver here ({e}); nothing to do");
            Ok(())
        }
    }
}

fn producer() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let storage = Storage::new_cuda(&ctx, SIZE)?;
    storage_copy(&storage, &Storage::from_vec(vec![5u8; SIZE]), false)?;
    let handle = storage.share_cuda()?; // _share_cuda_
    let wire: String = handle.encode().iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "producer: shared {SIZE} bytes of cuda:0 (slot {} of {})",
        handle.slot,
        handle
            .ref_counter
            .as_ref()
            .expect("a non-empty storage's handle names its ref-counter file")
    );
    let status = Command::new(std::env::current_exe()?)
        .args(["consumer", &wire])
        .status()?;
    assert!(status.success());
    let mut first = [0u8; 1];
    storage.read_at(0, &mut first)?;
    assert_eq!(first, [6], "the consumer's write is visible here");
    println!(
        "producer: the consumer wrote {} into the shared memory",
        first[0]
    );
    Ok(())
}

fn consumer(wire: &str) -> Result<(), Box<dyn std::error::Error>> {
    let bytes: Vec<u8> = (0..wire.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&wire[i..i + 2], 16))
        .collect::<Result<_, _>>()?;
    let handle = IpcHandle::decode(&bytes)?;
    let ctx = CudaContext::new(handle.device)?;
    let storage = Storage::new_shared_cuda(&ctx, &handle)?; // _new_shared_cuda
    let mut last = [0u8; 1];
    storage.read_at(SIZE - 1, &mut last)?;
    assert_eq!(last, [5]);
    storage.write_at(0, &[6])?;
    println!(
        "consumer: opened {} bytes, last byte {}",
        storage.nbytes(),
        last[0]
    );
    Ok(()) // dropping the storage releases the producer's counter
}
