//! The Python helper against the library cargo built, without torch: every hook it wires names a
//! function the library exports, and its ctypes calls (statistics, errors) work. Skipped where there is
//! no `python3`.

use std::path::Path;

use tensormem_test_support::python;

fn library() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let deps = exe.parent().expect("the test's folder");
    [
        deps.join("libtensormem_torch.so"),
        deps.join("../libtensormem_torch.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("cargo builds the cdylib beside the tests")
}

const CHECK: &str = r#"
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
import tensormem_torch as tt
source = tt.find_source()
assert os.path.isfile(os.path.join(os.path.dirname(source), tt.HEADER_NAME)), source
plugin = tt.Plugin(sys.argv[2])
for setter, function in tt.HOOKS:
    assert ctypes.cast(getattr(plugin.lib, function), ctypes.c_void_p).value, function
for function in ("tensormem_alloc", "tensormem_free"):
    getattr(plugin.lib, function)
try:
    stats = plugin.stats(-1)
    raise SystemExit("stats(-1) did not fail")
except RuntimeError as e:
    assert "device -1 is not a CUDA device ordinal" in str(e), e
assert "device -1" in plugin.last_error()
try:
    stats = plugin.stats(0)
    assert "reserved_bytes.all.peak" in stats, stats
    print("gpu stats", stats["reserved_bytes.all.peak"])
except RuntimeError as e:
    print("no gpu:", e)
print("ok", len(tt.HOOKS))
"#;

/// The routing of allocator settings, against a stand-in for PyTorch 2.11's functions (the binding
/// `torch._C._accelerator_setAllocatorSettings` and the deprecated `torch.cuda.memory.
/// _set_allocator_settings` that calls it by name) and the library's real
/// `tensormem_set_allocator_settings`.
const SETTINGS_CHECK: &str = r#"
import sys, types
sys.path.insert(0, sys.argv[1])
import tensormem_torch as tt

calls = []
torch = types.ModuleType("torch")
torch._C = types.ModuleType("torch._C")
def set_settings(env):
    if not isinstance(env, str):
        raise TypeError("env must be a str")
    calls.append(("pytorch", env))
torch._C._accelerator_setAllocatorSettings = set_settings
cuda = types.ModuleType("torch.cuda")
memory = types.ModuleType("torch.cuda.memory")
def _set_allocator_settings(env):
    return torch._C._accelerator_setAllocatorSettings(env)
memory._set_allocator_settings = _set_allocator_settings
torch.cuda, cuda.memory = cuda, memory
sys.modules.update({"torch": torch, "torch._C": torch._C, "torch.cuda": cuda, "torch.cuda.memory": memory})

def apply(env):
    calls.append(("tensormem", env))
tt._route_settings_of(torch, apply)
tt._route_settings_of(torch, apply)  # routing twice changes nothing
for way in (torch._C._accelerator_setAllocatorSettings, memory._set_allocator_settings):
    calls.clear()
    way("max_split_size_mb:40,garbage_collection_threshold:0.5")
    want = [("pytorch", "max_split_size_mb:40,garbage_collection_threshold:0.5"),
            ("tensormem", "max_split_size_mb:40,garbage_collection_threshold:0.5")]
    assert calls == want, (way.__name__, calls)
# PyTorch's refusal comes first, and tensormem is not asked.
calls.clear()
try:
    torch._C._accelerator_setAllocatorSettings(3)
    raise SystemExit("PyTorch's TypeError was not raised")
except TypeError:
    pass
assert calls == [], calls
assert memory._set_allocator_settings.__name__ == "_set_allocator_settings"

# The library's own refusal: a RuntimeError with tensormem's message, after PyTorch's function ran.
plugin = tt.Plugin(sys.argv[2])
torch._C._accelerator_setAllocatorSettings = set_settings
memory._set_allocator_settings = _set_allocator_settings
plugin._route_settings()
calls.clear()
try:
    memory._set_allocator_settings("max_split_size_mb:banana")
    raise SystemExit("tensormem took max_split_size_mb:banana")
except RuntimeError as e:
    assert str(e).startswith("tensormem: allocator settings 'max_split_size_mb:banana': "), e
    assert "max_split_size_mb" in str(e)[60:], e
assert calls == [("pytorch", "max_split_size_mb:banana")], calls
print("ok settings")
"#;

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn allocator_settings_reach_pytorch_then_tensormem_once_whichever_way() {
    let stdout = check_script(SETTINGS_CHECK, true);
    assert!(stdout.contains("ok settings"), "{stdout}");
}

/// Runs `script` with python3 (required) on the package folder and, with `with_library`, the
/// library cargo built; asserts it succeeded and returns what it printed.
fn check_script(script: &str, with_library: bool) -> String {
    python::require();
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let mut command = python::command();
    command.args(["-c", script]).arg(&package);
    if with_library {
        command.arg(library());
    }
    let out = command.output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Tagged regions against a stand-in for `torch.cuda` (`MemPool`, `use_mem_pool`, devices) and for the
/// pool sleep calls: a pool per tag and device, made once; `sleep_regions` keeps and discards as asked
/// and runs the devices at once (the stand-in's calls meet at a barrier, which sequential calls never
/// reach); tags work wherever pools do; bad input is refused with a message saying what to do.
const REGIONS_CHECK: &str = r#"
import contextlib, sys, threading, types
sys.path.insert(0, sys.argv[1])

state = {"device": 0, "stack": []}
torch = types.ModuleType("torch")
cuda = types.ModuleType("torch.cuda")
class MemPool:
    made = 0
    def __init__(self):
        MemPool.made += 1
        self.id = (0, MemPool.made)
        self.device = state["device"]
@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    state["stack"].append((pool.id, device))
    try:
        yield
    finally:
        state["stack"].pop()
@contextlib.contextmanager
def device_ctx(index):
    old, state["device"] = state["device"], index
    try:
        yield
    finally:
        state["device"] = old
class Device:
    def __init__(self, text):
        self.index = int(text.split(":")[1]) if ":" in text else None
cuda.MemPool, cuda.use_mem_pool, cuda.device = MemPool, use_mem_pool, device_ctx
cuda.current_device = lambda: state["device"]
torch.cuda, torch.device = cuda, Device
sys.modules.update({"torch": torch, "torch.cuda": cuda})

import tensormem_torch as tt
pools = sys.modules["tensormem_torch.sleep"]
calls, asleep, lock = [], set(), threading.Lock()
meet = threading.Barrier(2, timeout=10)
def fake_sleep(pool, keep, device):
    with lock:
        calls.append(("sleep", pool.id, keep, device))
        asleep.add(pool.id)
    if pool.id == weights0.id or pool.id == weights1.id:
        meet.wait()  # both devices' weights at once, or never
    return (1 << 20) if keep else (2 << 20)
def fake_wake(pool, device=None, release_host_memory=False):
    with lock:
        calls.append(("wake", pool.id, device))
        asleep.discard(pool.id)
    return 3 << 20
def fake_is_asleep(pool, device=None):
    return pool.id in asleep
released = []
pools.sleep, pools.wake, pools.is_asleep = fake_sleep, fake_wake, fake_is_asleep
pools.release_host_memory_now = lambda: released.append(True)

with tt.region("weights") as weights0:
    assert state["stack"] == [(weights0.id, 0)], state
    with tt.region("kv_cache") as cache0:
        assert [p for p, _ in state["stack"]] == [weights0.id, cache0.id], state
assert state["stack"] == []
with tt.region("weights") as again:
    assert again is weights0
with tt.region("weights", device=1) as weights1:
    assert weights1.device == 1 and weights1 is not weights0, (weights1.device,)
assert state["device"] == 0
assert sorted(tt.regions()) == [("kv_cache", 0), ("weights", 0), ("weights", 1)], tt.regions()

got = tt.sleep_regions(keep=["weights"], discard=["kv_cache"])
assert got == {("weights", 0): 1 << 20, ("weights", 1): 1 << 20, ("kv_cache", 0): 2 << 20}, got
assert sorted(c for c in calls if c[0] == "sleep") == sorted([
    ("sleep", weights0.id, True, 0), ("sleep", weights1.id, True, 1), ("sleep", cache0.id, False, 0)]), calls
assert tt.is_asleep("weights") and tt.is_asleep("kv_cache", device=0)
calls.clear()
woken = tt.wake_regions(release_host_memory=True)
assert woken == {("kv_cache", 0): 3 << 20, ("weights", 0): 3 << 20, ("weights", 1): 3 << 20}, woken
assert released == [True] and not tt.is_asleep("weights")
assert tt.wake_regions() == {}  # nothing asleep

# Tags and pools through the package's sleep and wake.
meet = threading.Barrier(2, timeout=10)
assert tt.sleep("weights", keep_contents=False) == 2 * (2 << 20)
assert tt.wake("weights", device=1) == 3 << 20
assert tt.sleep(cache0, True, 0) == 1 << 20

for bad, error, words in [
    (lambda: tt.region("").__enter__(), ValueError, "non-empty string"),
    (lambda: tt.sleep("nope"), KeyError, "regions made so far: ['kv_cache', 'weights']"),
    (lambda: tt.sleep_regions(keep="weights"), TypeError, "lists of tags"),
    (lambda: tt.sleep_regions(keep=["weights"], discard=["weights"]), ValueError, "both kept and discarded"),
    (lambda: tt.wake("kv_cache", device=1), KeyError, "no region 'kv_cache' on device 1"),
]:
    try:
        bad()
        raise SystemExit(f"accepted: {words}")
    except error as e:
        assert words in str(e), (words, str(e))
print("ok regions")
"#;

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn regions_pool_by_tag_and_sleep_every_device_at_once() {
    let stdout = check_script(REGIONS_CHECK, false);
    assert!(stdout.contains("ok regions"), "{stdout}");
}

/// `tensormem_torch.nccl_weights` against a stand-in for torch (tensors, streams, `torch.distributed`'s default
/// store), a stand-in store and a recording stand-in for the library: two ranks (threads) share the id rank 0
/// made through the store and open with the arrays their tensors give; `sync` passes the current stream and
/// returns the library's report; a rank whose tensors are refused makes both ranks raise before either opens;
/// bad arguments are refused with what to do. Then the real library: its exports bind, and without NCCL (or a
/// GPU) the calls raise `NcclWeightsError` saying what is missing.
const NCCL_CHECK: &str = r#"
import ctypes, sys, threading, types
sys.path.insert(0, sys.argv[1])

torch = types.ModuleType("torch")
class DType:
    def __init__(self, name, size):
        self.name, self.itemsize = name, size
    def __str__(self):
        return "torch." + self.name
float32, bfloat16 = DType("float32", 4), DType("bfloat16", 2)
class Device:
    def __init__(self, index):
        self.index = index
class Tensor:
    next_ptr = [0x7f00_0000_0000]
    def __init__(self, shape, dtype=float32, device=0, contiguous=True, cuda=True):
        self.shape, self.dtype, self.device = tuple(shape), dtype, Device(device)
        self.is_cuda, self._contiguous = cuda, contiguous
        self.ptr = Tensor.next_ptr[0]
        Tensor.next_ptr[0] += 1 << 20
    def data_ptr(self):
        return self.ptr
    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n
    def element_size(self):
        return self.dtype.itemsize
    def is_contiguous(self):
        return self._contiguous
    def stride(self):
        return (1,) * len(self.shape)
class Stream:
    def __init__(self, device):
        self.cuda_stream = 0x5000 + device
cuda = types.ModuleType("torch.cuda")
cuda.current_stream = lambda device=None: Stream(device)
cuda.current_device = lambda: 0
dist = types.ModuleType("torch.distributed")
dist.is_available = lambda: True
dist.is_initialized = lambda: False
dist.distributed_c10d = types.SimpleNamespace(_get_default_store=lambda: default_store)
torch.Tensor, torch.device, torch.cuda, torch.distributed = Tensor, Device, cuda, dist
torch.OutOfMemoryError = MemoryError
sys.modules.update({"torch": torch, "torch.cuda": cuda, "torch.distributed": dist})

class Store:
    """torch.distributed.Store's set and get (get waits for the key)."""
    def __init__(self):
        self.values, self.changed = {}, threading.Condition()
    def set(self, key, value):
        assert isinstance(key, str) and isinstance(value, bytes), (key, value)
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()
    def get(self, key):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout=10):
                raise RuntimeError(f"store: no {key} in 10 s")
            return self.values[key]
default_store = Store()

ID = bytes(range(7, 7 + 128))
class FakeLib:
    """The library's four calls, recording what ctypes would pass."""
    def __init__(self):
        self.calls, self.lock, self.next = [], threading.Lock(), 0x100
    def record(self, *call):
        with self.lock:
            self.calls.append(call)
    def tensormem_nccl_unique_id(self, buf, n):
        assert n == 128
        ctypes.memmove(buf, ID, n)
        self.record("unique_id")
        return 0
    def tensormem_nccl_weights_open(self, device, uid, uid_len, rank, world, src, count, names, ptrs, sizes, metas,
                                    bucket, timeout_ms, out):
        arrays = ([names[i].decode() for i in range(count)], list(ptrs[:count]), list(sizes[:count]),
                  [metas[i].decode() for i in range(count)])
        with self.lock:
            self.next += 1
            out._obj.value = self.next
        self.record("open", rank, device, bytes(uid[:uid_len]), world, src, bucket, arrays, self.next, timeout_ms)
        return 0
    def tensormem_nccl_weights_sync(self, handle, stream, report):
        report._obj.sync, report._obj.bytes, report._obj.seconds = 1, 4096, 0.25
        self.record("sync", handle, stream.value)
        return 0
    def tensormem_nccl_weights_close(self, handle):
        self.record("close", handle)
        return 0
    def tensormem_last_error(self):
        return b"the library refused"

import tensormem_torch
nw = tensormem_torch.nccl_weights
assert "nccl_weights" in tensormem_torch.__all__
fake = nw._LIB = FakeLib()

def model(device=0, contiguous=True):
    return {"wte.weight": Tensor((8, 4), device=device), "h.0.attn.bias": Tensor((3,), bfloat16, device=device),
            "h.0.mlp.weight": Tensor((2, 5), device=device, contiguous=contiguous)}

def ranks(tensors, store, **kw):
    """NcclWeights on ranks 0 and 1 of two, each in a thread: what each returned or raised."""
    out = [None, None]
    def run(rank):
        try:
            out[rank] = nw.NcclWeights(tensors[rank], rank, 2, store=store, **kw)
        except Exception as e:
            out[rank] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out

# Two ranks share rank 0's id through the store and open with their own tensors' arrays.
store = Store()
tensors = [model(0), model(1)]
w0, w1 = ranks(tensors, store, bucket_bytes=2 << 20)
assert isinstance(w0, nw.NcclWeights) and isinstance(w1, nw.NcclWeights), (w0, w1)
assert [c[0] for c in fake.calls].count("unique_id") == 1, fake.calls
opens = sorted(c for c in fake.calls if c[0] == "open")
for rank, call in enumerate(opens):
    _, r, device, uid, world, src, bucket, arrays, _, timeout_ms = call
    assert (r, device, uid, world, src, bucket, timeout_ms) == (rank, rank, ID, 2, 0, 2 << 20, 0), call
    names, ptrs, sizes, metas = arrays
    assert names == ["wte.weight", "h.0.attn.bias", "h.0.mlp.weight"], names
    assert ptrs == [t.data_ptr() for t in tensors[rank].values()], ptrs
    assert sizes == [128, 6, 40], sizes
    assert metas == ["float32[8,4]", "bfloat16[3]", "float32[2,5]"], metas
assert store.values["tensormem_nccl_weights/0/id"] == ID
assert store.values["tensormem_nccl_weights/0/status/1"] == b"ok"

fake.calls.clear()
report = w1.sync()
assert report == nw.SyncReport(1, 4096, 0, 0, 0.25), report
assert fake.calls == [("sync", w1._handle, 0x5001)], fake.calls
handle = w1._handle
with w1:
    pass
w1.close()
assert fake.calls[1:] == [("close", handle)], fake.calls
try:
    w1.sync()
    raise SystemExit("a closed sync synced")
except nw.NcclWeightsError as e:
    assert "closed" in str(e), e
w0.close()

# A rank whose tensors are refused: it raises its own error, the other names it; neither opens.
fake.calls.clear()
e0, e1 = ranks([model(0), model(1, contiguous=False)], Store())
assert isinstance(e1, ValueError) and "'h.0.mlp.weight' is not contiguous" in str(e1), e1
assert isinstance(e0, nw.NcclWeightsError), e0
assert "rank 1: ValueError" in str(e0) and "not contiguous" in str(e0), e0
assert not [c for c in fake.calls if c[0] == "open"], fake.calls

# The default process group's store, under the next key.
dist.is_initialized = lambda: True
w0, w1 = ranks([model(0), model(1)], None)
assert "tensormem_nccl_weights/2/id" in default_store.values, sorted(default_store.values)
w0.close(), w1.close()
dist.is_initialized = lambda: False

# An id given: no store; the library's refusal is raised with its message.
w = nw.NcclWeights(model(0), 0, 1, unique_id=ID, bucket_bytes=1 << 20)
assert fake.calls[-1][0] == "open" and fake.calls[-1][3] == ID, fake.calls[-1]
w.close()
# A timeout in seconds reaches the library in milliseconds.
w = nw.NcclWeights(model(0), 0, 1, unique_id=ID, timeout=2.5)
assert fake.calls[-1][0] == "open" and fake.calls[-1][-1] == 2500, fake.calls[-1]
w.close()
fake.tensormem_nccl_weights_sync = lambda *args: -1
w = nw.NcclWeights(model(0), 0, 1, unique_id=ID)
try:
    w.sync()
    raise SystemExit("a refused sync returned")
except nw.NcclWeightsError as e:
    assert str(e) == "tensormem nccl_weights: sync failed: the library refused", e
w.close()

for bad, error, words in [
    (lambda: nw.NcclWeights(model(), 2, 2, unique_id=ID), ValueError, "rank 2 is not a rank of a world of 2"),
    (lambda: nw.NcclWeights(model(), 0, 2, src=-1, unique_id=ID), ValueError, "src -1"),
    (lambda: nw.NcclWeights(model(), 0, "2", unique_id=ID), TypeError, "world_size must be an int"),
    (lambda: nw.NcclWeights(model(), 0, 1, unique_id=ID[:100]), ValueError, "100 bytes, not 128"),
    (lambda: nw.NcclWeights(model(), 0, 1, unique_id=ID, bucket_bytes=4096), ValueError, "at least 1048576"),
    (lambda: nw.NcclWeights(model(), 0, 1, unique_id=ID, timeout=0), ValueError, "timeout is 0"),
    (lambda: nw.NcclWeights(model(), 0, 1, unique_id=ID, timeout="1"), ValueError, "pass seconds"),
    (lambda: nw.NcclWeights(dict(model(), x=Tensor((2,), cuda=False)), 0, 1, unique_id=ID), ValueError,
     "'x' is not a CUDA tensor"),
    (lambda: nw.NcclWeights(dict(model(), x=Tensor((2,), device=1)), 0, 1, unique_id=ID), ValueError,
     "on devices [0, 1]"),
    (lambda: nw.NcclWeights(model(0), 0, 1, unique_id=ID, device=1), ValueError, "on devices [0, 1]"),
    (lambda: nw.NcclWeights([("a", Tensor((1,))), ("a", Tensor((1,)))], 0, 1, unique_id=ID), ValueError,
     "two tensors are named 'a'"),
    (lambda: nw.NcclWeights(model(), 0, 2), ValueError, "pass store="),
]:
    try:
        bad()
        raise SystemExit(f"accepted: {words}")
    except error as e:
        assert words in str(e), (words, str(e))

# The real library: every call binds; without NCCL or a GPU each says what is missing.
nw._LIB = None
import os
os.environ["TENSORMEM_TORCH_LIB"] = sys.argv[2]
try:
    uid = nw.unique_id()
    assert len(uid) == 128
    print("nccl id made")
except nw.NcclWeightsError as e:
    assert "NCCL could not be loaded" in str(e), e
    print("no nccl:", e)
    try:
        nw.NcclWeights(model(0), 0, 1, unique_id=ID)
        raise SystemExit("opened without NCCL")
    except nw.NcclWeightsError as e:
        assert "open failed: NCCL could not be loaded" in str(e), e
print("ok nccl_weights")
"#;

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn nccl_weights_share_the_id_check_every_rank_and_pass_the_arrays() {
    let stdout = check_script(NCCL_CHECK, true);
    assert!(stdout.contains("ok nccl_weights"), "{stdout}");
}

// The tests run python3: `#[ignore]`d so that a machine without it reports them as ignored, never
// as passed; `.ci/run` runs them (`cargo test -p tensormem-torch --test python_helper --
// --ignored`), and there a missing python3 is a failure (`python::require`).

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn the_helper_wires_exported_functions_and_reads_errors() {
    let stdout = check_script(CHECK, true);
    assert!(stdout.contains("ok 8"), "{stdout}");
}

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn the_scripts_compile() {
    python::require();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    for script in [
        "python/tensormem_torch/__init__.py",
        "python/tensormem_torch/sleep.py",
        "python/tensormem_torch/regions.py",
        "python/tensormem_torch/nccl_weights.py",
        "tests/python/nccl_weights_check.py",
        "tests/python/real_clients.py",
        "tests/python/alloc_bench.py",
        "tests/python/workloads.py",
        "tests/python/torch_client.py",
        "tests/python/step_bench.py",
    ] {
        let path = crate_dir.join(script);
        let out = python::command()
            .args([
                "-c",
                "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])",
            ])
            .arg(&path)
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `python/` is what the wheel is built from (`package-dir`): the package alone, the test and bench
/// drivers living in `tests/python/` (which the GPU bundle copies whole).
#[test]
fn the_package_folder_holds_the_package_alone() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let mut entries: Vec<String> = std::fs::read_dir(&python)
        .expect("the crate's python/")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        // What a build or an import leaves behind.
        .filter(|name| !name.ends_with(".egg-info") && name != "__pycache__")
        .collect();
    entries.sort();
    assert_eq!(entries, ["tensormem_torch"], "{}", python.display());
}
