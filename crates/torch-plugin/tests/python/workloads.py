"""The PyTorch workloads the plugin is checked and measured with, seeded so runs can be compared.

gpt2_train is record_traces.py's (6-layer GPT-2, batch 8 x 512, bf16 autocast, AdamW); cudagraph_train is
record_more_traces.py's (a two-layer MLP with dropout trained through a captured CUDA graph, then a burst
of random-size tensors); small_ops is torch_step_bench.py's eager loop of small elementwise ops. Each
returns the losses it saw; the timed ones also return per-step seconds.
"""
import random
import time

import torch


def gpt2_train(steps=4, seed=0):
    """Trains GPT-2 for `steps` steps; returns (losses, seconds per step)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=6, n_head=12, n_embd=768, n_positions=1024)
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    losses, times = [], []
    for _ in range(steps):
        x = torch.randint(0, 50257, (8, 512), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return losses, times


def cudagraph_train(seed=0, replays=10):
    """Warms up an MLP on a side stream, captures one training step in a CUDA graph, replays it on new
    data, then allocates and frees 300 tensors of random size; returns the losses (warm-up, replays)."""
    torch.manual_seed(seed)
    n, d_in, h, d_out = 640, 4096, 2048, 1024
    model = torch.nn.Sequential(torch.nn.Linear(d_in, h), torch.nn.Dropout(p=0.2),
                                torch.nn.Linear(h, d_out), torch.nn.Dropout(p=0.1)).cuda()
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_input = torch.randn(n, d_in, device="cuda")
    static_target = torch.randn(n, d_out, device="cuda")
    losses = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(static_input), static_target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model(static_input), static_target)
        static_loss.backward()
        opt.step()
    for _ in range(replays):
        static_input.copy_(torch.randn(n, d_in, device="cuda"))
        static_target.copy_(torch.randn(n, d_out, device="cuda"))
        graph.replay()
        losses.append(static_loss.item())
    torch.cuda.synchronize()
    del graph, static_loss
    keep = []
    rng = random.Random(3)
    for _ in range(300):
        keep.append(torch.empty(rng.randint(1, 1 << 24), dtype=torch.uint8, device="cuda"))
        if len(keep) > 24:
            keep.pop(rng.randrange(len(keep)))
    torch.cuda.synchronize()
    return losses


def small_ops(iters=2000):
    """Seconds per iteration of an eager loop of small (256 x 256) elementwise ops: six allocations and
    frees per iteration, so the allocator's cost shows."""
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        y = x * 2 + 1
        y = torch.relu(y) - x
        y = y.sum(dim=0, keepdim=True) + y
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters
