"""PyTorch side of tensormem-ipc's interop tests (run by crates/ipc/tests/gpu.rs).

consume: reads a share tuple line from stdin (TorchShareTuple::to_line format), opens it with
         torch.UntypedStorage._new_shared_cuda, checks the producer's bytes, writes some, releases.
produce: shares a CUDA storage with _share_cuda_, prints its tuple, waits for the Rust consumer,
         checks its writes, frees and checks PyTorch's limbo emptied.
Lines starting with @@ are the protocol; everything else is commentary.
"""
import gc
import sys

import torch


def say(*parts):
    print("@@" + " ".join(str(p) for p in parts), flush=True)


def tensor_of(storage, size, device):
    t = torch.empty(0, dtype=torch.uint8, device=device)
    try:
        t.set_(storage, 0, (size,), (1,))
    except TypeError:
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        t.set_(typed, 0, (size,), (1,))
    return t


def consume():
    fields = sys.stdin.readline().split()
    device, handle, size, offset = int(fields[0]), bytes.fromhex(fields[1]), int(fields[2]), int(fields[3])
    ref_counter, slot = bytes.fromhex(fields[4]), int(fields[5])
    event, sync = bytes.fromhex(fields[6]), fields[7] == "1"
    expect, write = int(fields[8]), int(fields[9])
    torch.cuda.set_device(device)
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_counter, slot, event, sync)
    t = tensor_of(storage, size, f"cuda:{device}")
    first, last = int(t[0].item()), int(t[-1].item())
    if first != expect or last != expect:
        say("bad", first, last)
        return 1
    t[size // 2:].fill_(write)
    torch.cuda.synchronize()
    try:
        storage._share_cuda_()
        say("reshare-allowed")
        return 1
    except RuntimeError as e:
        say("reshare-refused", str(e).splitlines()[0].replace(" ", "_"))
    del t, storage
    gc.collect()
    say("released")
    return 0


def produce():
    size = int(sys.argv[2])
    torch.cuda.set_device(0)
    t = torch.full((size,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    storage = t.untyped_storage()
    (device, handle, size_bytes, offset, ref_counter, slot, event, sync) = storage._share_cuda_()
    say("tuple", device, handle.hex(), size_bytes, offset, ref_counter.hex(), slot,
        (event or b"").hex(), int(bool(sync)))
    line = sys.stdin.readline().strip()
    if line != "released":
        say("unexpected", line)
        return 1
    torch.cuda.synchronize()
    written = int(t[-1].item())
    before = torch.cuda.memory_allocated(0)
    del t, storage
    gc.collect()
    torch.cuda.ipc_collect()
    after = torch.cuda.memory_allocated(0)
    say("done", written, before, after)
    return 0


if __name__ == "__main__":
    sys.exit({"consume": consume, "produce": produce}[sys.argv[1]]())
