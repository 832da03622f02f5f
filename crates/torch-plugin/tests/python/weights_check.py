"""tensormem_torch.weights between processes: a producer publishes, spawned consumers install into their own tensors.

    python3 weights_check.py [--lib PATH/libtensormem_torch.so] [--plugin] [--methods foreach,batched]
                             [CHECK ...]

This process is the producer; each check spawns fresh consumer processes (torch.multiprocessing, spawn). With
--plugin both sides run on tensormem (tensormem_torch.install(mode="native")), else on PyTorch's own caching
allocator (the library loaded through ctypes only). Checks:

  gpt2_fp32      a small GPT-2-like fp32 state dict (tied lm_head), two consumers
  bf16_many      a few hundred bf16 tensors of assorted shapes
  fused_views    views of one fused storage (q/k/v rows, halves of a bias), a transposed parameter, a 0-dim
                 scalar, an empty tensor, float16/int64/bool/float8 tensors
  mempool        the producer's tensors in a torch.cuda.MemPool private pool
  tensors        fused_views read zero-copy through Subscriber.tensors() between begin() and finish()
  mismatch       wrong shape, wrong dtype, a missing and an extra name, a strided slice: each raises WeightsError
                 before anything is written (the tensors keep their bytes); allow_unused installs a subset
  consumer_killed  a subscribed consumer is SIGKILLed: holders() drops to 0, the next version's
                 wait_installed and close(timeout=10) succeed
  producer_closes  close() while a consumer waits for a version: it gets PublicationClosed and lets go

Each layout check runs once per method (--methods), over 3 versions: the producer writes new values, publishes,
and waits until installed before writing again; each consumer starts from zeros, installs, and compares every
byte of its tensors with the values of that version. Prints "PASS name: ...", "FAIL name: why" or
"SKIP name: why" per check; exits 1 if any failed.
"""
import argparse
import math
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "python"))
if os.path.isdir(os.path.join(PACKAGE_ROOT, "tensormem_torch")):
    sys.path.insert(0, PACKAGE_ROOT)

VERSIONS = 3
WAIT = 120  # seconds any one step may take (a consumer's start-up included)
LAYOUT_CHECKS = ("gpt2_fp32", "bf16_many", "fused_views", "mempool")
OTHER_CHECKS = ("tensors", "mismatch", "consumer_killed", "producer_closes")


def setup(plugin, lib):
    """This process's torch, on tensormem's allocator with --plugin; the library found at --lib either way."""
    if lib:
        os.environ["TENSORMEM_TORCH_LIB"] = lib
    if plugin:
        import tensormem_torch
        tensormem_torch.install(lib or None, mode="native")
    import torch
    torch.cuda.set_device(0)
    return torch


# ---- layouts: the same names, dtypes, shapes and strides on both sides ----

def gpt2_fp32(torch, make):
    d, v, ctx, layers = 256, 2048, 128, 4
    out = {"wte.weight": make((v, d)), "wpe.weight": make((ctx, d))}
    for i in range(layers):
        p = f"h.{i}."
        out.update({p + "ln_1.weight": make((d,)), p + "ln_1.bias": make((d,)),
                    p + "attn.c_attn.weight": make((d, 3 * d)), p + "attn.c_attn.bias": make((3 * d,)),
                    p + "attn.c_proj.weight": make((d, d)), p + "attn.c_proj.bias": make((d,)),
                    p + "ln_2.weight": make((d,)), p + "ln_2.bias": make((d,)),
                    p + "mlp.c_fc.weight": make((d, 4 * d)), p + "mlp.c_fc.bias": make((4 * d,)),
                    p + "mlp.c_proj.weight": make((4 * d, d)), p + "mlp.c_proj.bias": make((d,))})
    out["ln_f.weight"], out["ln_f.bias"] = make((d,)), make((d,))
    out["lm_head.weight"] = out["wte.weight"]  # tied, as GPT-2's state dict has it
    return out


def bf16_many(torch, make):
    out = {}
    for j in range(320):
        shape = ((j % 9 + 1) * 48, (j % 5 + 1) * 40) if j % 4 else ((j % 13 + 1) * 64,)
        out[f"layers.{j // 8}.w{j % 8}"] = make(shape, torch.bfloat16)
    return out


def fused_views(torch, make):
    d = 128
    qkv = make((3 * d, d))
    bias = make((2 * d,), torch.float16)
    out = {"attn.q": qkv[:d], "attn.k": qkv[d:2 * d], "attn.v": qkv[2 * d:],
           "attn.b_in": bias[:d], "attn.b_out": bias[d:],
           "proj.weight_t": make((2 * d, d)).t(),  # transposed: non-contiguous, dense
           "scale": make(()), "empty": make((0, d)), "step": make((1,), torch.int64),
           "mask": make((7, 9), torch.bool)}
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8.weight"] = make((64, 48), torch.float8_e4m3fn)
    return out


def mini(torch, make):
    return {"a": make((64, 32)), "b": make((32,)), "c": make((16, 16), torch.bfloat16)}


LAYOUTS = {f.__name__: f for f in (gpt2_fp32, bf16_many, fused_views, mini)}


def build(torch, layout, pool=None):
    """The layout's tensors, zero-filled (in ``pool`` when given)."""
    device = torch.device("cuda", 0)

    def make(shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype, device=device)

    if pool is None:
        return LAYOUTS[layout](torch, make)
    with torch.cuda.use_mem_pool(pool):
        return LAYOUTS[layout](torch, make)


def owners(named):
    """name -> the index of the first name of the same tensor (tied weights are written once)."""
    first, out = {}, {}
    for i, (name, t) in enumerate(named.items()):
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        out[name] = first.setdefault(key, i)
    return out


def values(torch, t, index, k):
    """Version k's values of the tensor of index ``index``: deterministic, exact in every dtype."""
    n = math.prod(t.shape)
    base = torch.arange(n, device=t.device, dtype=torch.int64) * 7 + index * 13 + k * 101 + 1
    if t.dtype == torch.bool:
        v = (base % 2).bool()
    elif t.dtype.is_floating_point:
        v = (base % 251).to(torch.float32).to(t.dtype)
    else:
        v = (base % 251).to(t.dtype)
    return v.reshape(t.shape)


def fill(torch, named, k):
    with torch.no_grad():
        for name, index in owners(named).items():
            named[name].copy_(values(torch, named[name], index, k))


def bits(torch, t):
    """The tensor's bytes as integers of its element size (so equal means byte for byte)."""
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(carrier) if t.dtype != carrier else t


def differing(torch, named, k, sources=None, only=None):
    """The names (of ``only``, default all) whose bytes are not version k's values (of ``sources`` when given,
    else of ``named``)."""
    seen = sources if sources is not None else named
    bad = []
    for name, index in owners(named).items():
        if only is not None and name not in only:
            continue
        if not torch.equal(bits(torch, seen[name]), bits(torch, values(torch, named[name], index, k))):
            bad.append(name)
    return bad


# ---- the consumer ----

def mismatches(torch, weights, sub, named, method):
    """Each wrong layout raises WeightsError, before waiting or writing; returns the problems found."""
    problems = []
    device = named["a"].device
    fill_value = 3
    wrong = {
        "shape": dict(named, a=torch.zeros((64, 31), device=device)),
        "dtype": dict(named, b=torch.zeros((32,), dtype=torch.float16, device=device)),
        "missing": {n: t for n, t in named.items() if n != "c"},
        "extra": dict(named, d=torch.zeros((4,), device=device)),
        "strided": dict(named, a=torch.zeros((64, 64), device=device)[:, ::2]),
    }
    for case, params in wrong.items():
        with torch.no_grad():
            for t in params.values():
                t.fill_(fill_value)
        try:
            sub.install(params, timeout=5, method=method)
            problems.append(f"{case}: installed")
        except weights.WeightsTimeout as e:
            problems.append(f"{case}: waited instead of refusing ({e})")
        except weights.WeightsError as e:
            if "cannot install the published weights" not in str(e):
                problems.append(f"{case}: unexpected error {e}")
        torch.cuda.synchronize()
        changed = [n for n, t in params.items() if not bool((t == fill_value).all())]
        if changed:
            problems.append(f"{case}: written before the refusal: {changed}")
    return problems


def consumer(plugin, lib, layout, method, mode, q_in, q_out):
    try:
        torch = setup(plugin, lib)
        from tensormem_torch import weights
        named = build(torch, layout)
        sub = weights.Subscriber(q_in.get(timeout=WAIT))
        q_out.put(("ready",))
        problems = []
        if mode == "mismatch":
            problems = mismatches(torch, weights, sub, named, method)
            with torch.no_grad():
                for t in named.values():
                    t.zero_()
        for i in range(1 if mode in ("hold", "closed") else VERSIONS):
            if mode == "mismatch" and i == 0:
                subset = {n: named[n] for n in ("a", "c")}
                v = sub.install(subset, timeout=WAIT, method=method, allow_unused=True)
                problems += [f"allow_unused: {n} not installed" for n in differing(torch, named, v - 1, only=subset)]
                problems += [f"allow_unused: {n} written" for n in ("b",) if bool(named[n].any())]
            elif mode == "tensors":
                v = sub.begin(timeout=WAIT)
                sources = sub.tensors()
                problems += [f"source {n} differs" for n in differing(torch, named, v - 1, sources)]
                torch.cuda.current_stream().synchronize()
                sub.finish(v)
            else:
                v = sub.install(named, timeout=WAIT, method=method)
                problems += [f"{n} differs after version {v}" for n in differing(torch, named, v - 1)]
            q_out.put(("installed", v, problems))
            problems = []
        if mode == "hold":
            q_out.put(("holding",))
            time.sleep(600)
        if mode == "closed":
            try:
                sub.install(named, timeout=WAIT, method=method)
                problems.append("installed after the producer closed")
            except weights.PublicationClosed:
                pass
            except weights.WeightsError as e:
                problems.append(f"not PublicationClosed: {e}")
        sub.close()
        q_out.put(("done", problems))
    except BaseException as e:  # noqa: BLE001 - the producer reports it
        q_out.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


# ---- the producer ----

class Failed(Exception):
    pass


def expect(q, kind, p):
    """The consumer's next report, which must be ``kind``."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            msg = q.get(timeout=1)
            break
        except Exception:  # noqa: BLE001 - queue.Empty
            if not p.is_alive():
                raise Failed(f"the consumer exited ({p.exitcode}) before reporting {kind}") from None
            if time.monotonic() > deadline:
                raise Failed(f"no {kind} from the consumer in {WAIT} s") from None
    if msg[0] == "error":
        raise Failed(f"the consumer failed: {msg[1]}")
    if msg[0] != kind:
        raise Failed(f"the consumer reported {msg} instead of {kind}")
    return msg


def run_check(torch, args, layout, method, mode, consumers=1):
    import torch.multiprocessing as mp
    from tensormem_torch import weights
    pool = None
    if layout.startswith("mempool"):
        pool = torch.cuda.MemPool()
        layout = "gpt2_fp32"
    named = build(torch, layout, pool)
    pub = weights.Publisher(named)
    ctx = mp.get_context("spawn")
    procs, queues, notes = [], [], []
    try:
        for _ in range(consumers):
            q_in, q_out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=consumer, args=(args.plugin, args.lib, layout, method, mode, q_in, q_out),
                            daemon=True)
            p.start()
            q_in.put(pub.message())
            procs.append((p, q_out))
            queues.append(q_in)  # alive until the consumer has read it
        for p, q in procs:
            expect(q, "ready", p)
        versions = 1 if mode in ("hold", "closed") else VERSIONS
        for k in range(versions):
            fill(torch, named, k)
            v = pub.publish()
            if v != k + 1:
                raise Failed(f"published version {v}, expected {k + 1}")
            for p, q in procs:
                _, got, problems = expect(q, "installed", p)
                if got != v or problems:
                    raise Failed(f"version {v}: the consumer installed {got}: {'; '.join(problems)}")
            pub.wait_installed(v, timeout=WAIT)
        if mode == "hold":
            p, q = procs[0]
            expect(q, "holding", p)
            if pub.holders() != 1:
                raise Failed(f"holders() is {pub.holders()} with one consumer subscribed")
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            deadline = time.monotonic() + 10
            while pub.holders() and time.monotonic() < deadline:
                time.sleep(0.05)
            if pub.holders():
                raise Failed(f"holders() is still {pub.holders()} 10 s after the consumer was killed")
            fill(torch, named, 1)
            v = pub.publish()
            pub.wait_installed(v, timeout=10)
            t0 = time.monotonic()
            pub.close(timeout=10)
            notes.append(f"holders 1 -> 0 after SIGKILL; close took {time.monotonic() - t0:.3f} s")
        else:
            pub.close(timeout=WAIT)
            for p, q in procs:
                _, problems = expect(q, "done", p)
                if problems:
                    raise Failed("; ".join(problems))
        for p, _ in procs:
            p.join(timeout=WAIT)
        tensors = len(named)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        notes.insert(0, f"{tensors} tensors, {nbytes} bytes, {versions} version(s), {consumers} consumer(s)")
        return "; ".join(notes)
    finally:
        for p, _ in procs:
            if p.is_alive():
                p.kill()
        if pub._handle is not None:
            try:
                pub.close(timeout=10)
            except weights.WeightsError:
                pass
        del named
        if pool is not None:
            del pool


def checks(names, methods):
    """(label, layout, method, mode, consumers) of each check asked for."""
    out = []
    for name in names:
        if name in LAYOUT_CHECKS:
            for method in methods:
                out.append((f"{name} {method}", name, method, "install", 2 if name == "gpt2_fp32" else 1))
        elif name == "tensors":
            out.append(("tensors begin/finish", "fused_views", "foreach", "tensors", 1))
        elif name == "mismatch":
            for method in methods:
                out.append((f"mismatch {method}", "mini", method, "mismatch", 1))
        elif name == "consumer_killed":
            out.append(("consumer_killed", "mini", methods[0], "hold", 1))
        elif name == "producer_closes":
            out.append(("producer_closes", "mini", methods[0], "closed", 1))
        else:
            raise SystemExit(f"unknown check {name!r}: one of {', '.join(LAYOUT_CHECKS + OTHER_CHECKS)}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--plugin", action="store_true", help="run producer and consumers on tensormem's allocator")
    ap.add_argument("--methods", default="foreach,batched")
    ap.add_argument("checks", nargs="*")
    args = ap.parse_args()
    allocator = "tensormem" if args.plugin else "pytorch"
    try:
        import torch
    except ImportError as e:
        print(f"SKIP weights: no PyTorch ({e})")
        return 0
    if not torch.cuda.is_available():
        print("SKIP weights: no CUDA device")
        return 0
    # Memory of expandable segments has no CUDA IPC memory handle: both sides use ordinary segments.
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "TENSORMEM_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    torch = setup(args.plugin, args.lib)
    methods = [m for m in args.methods.split(",") if m]
    failed = 0
    for label, layout, method, mode, consumers in checks(args.checks or LAYOUT_CHECKS + OTHER_CHECKS, methods):
        label = f"{label} ({allocator})"
        if layout == "mempool" and not hasattr(torch.cuda, "MemPool"):
            print(f"SKIP {label}: this PyTorch has no torch.cuda.MemPool", flush=True)
            continue
        t0 = time.monotonic()
        try:
            notes = run_check(torch, args, layout, method, mode, consumers)
            print(f"PASS {label}: {notes}; {time.monotonic() - t0:.1f} s", flush=True)
        except Failed as e:
            failed += 1
            print(f"FAIL {label}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - one line per check, the traceback after it
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
