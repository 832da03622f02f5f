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
    python::require();
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let out = python::command()
        .args(["-c", SETTINGS_CHECK])
        .arg(&package)
        .arg(library())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ok settings"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// The tests run python3: `#[ignore]`d so that a machine without it reports them as ignored, never
// as passed; `.ci/run` runs them (`cargo test -p tensormem-torch --test python_helper --
// --ignored`), and there a missing python3 is a failure (`python::require`).

#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn the_helper_wires_exported_functions_and_reads_errors() {
    python::require();
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let out = python::command()
        .args(["-c", CHECK])
        .arg(&package)
        .arg(library())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
