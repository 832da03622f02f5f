//! `cargo xtask test-gpu --bundle DIR`: the GPU test executables, the GPU examples, the
//! benchmark binaries (`alloc_patterns`, `ipc_roundtrip`, `handoff_bench`, `shm_bench`,
//! `shm_pool_bench`, `shm_loader_bench`, `storage_pool_bench`, `refit_bench`), the PyTorch anchors they are
//! compared with (`anchors/`) and a `run.sh`, built here for a GPU host that has no Rust toolchain.
//!
//! The executables are built in release without debug info and stripped (through `CARGO_PROFILE_*`
//! variables, so the workspace's profiles stay as they are), found through cargo's JSON messages, and
//! copied into `DIR`. CUDA is loaded at run time (`libcuda.so`), so the bundle needs only the NVIDIA driver
//! and a glibc at least as new as the newest symbol version the executables use (printed, and written to
//! `DIR/README.txt`).

use std::fmt::Write as _;
use std::fs;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::gpu_tests::{cargo, GPU_EXAMPLES, GPU_TEST_TARGETS};

/// The benchmark binaries copied beside the tests: (package, binary). Each is self-contained (the
/// sharing benchmarks re-execute themselves as their consumer processes).
const BENCH_BINS: &[(&str, &str)] = &[
    ("tensormem-benches", "alloc_patterns"),
    ("tensormem-benches", "cuda_crash"),
    ("tensormem-benches", "host_probe"),
    ("tensormem-benches", "ipc_roundtrip"),
    ("tensormem-benches", "handoff_bench"),
    ("tensormem-benches", "nccl_pool_bench"),
    ("tensormem-benches", "nccl_weights_bench"),
    ("tensormem-benches", "pinned_patterns"),
    ("tensormem-benches", "refit_bench"),
    ("tensormem-benches", "shm_bench"),
    ("tensormem-benches", "shm_pool_bench"),
    ("tensormem-benches", "shm_loader_bench"),
    ("tensormem-benches", "sleep_wake_bench"),
    ("tensormem-benches", "storage_pool_bench"),
    // The command, for the replay checks against real runs (`replay/whatif_check.py`).
    ("tensormem-cli", "tensormem"),
];

/// PyTorch anchors copied into `DIR/anchors/` (from [`ANCHORS_DIR`], vendored in the repository), so
/// that a benchmark and its anchor run from the bundle in one call.
const ANCHOR_SCRIPTS: &[&str] = &[
    "compare_alloc.sh",
    "build_torch_bench.sh",
    "torch_alloc_bench.cpp",
    "torch_handoff_bench.py",
    "torch_sharing_bench.py",
    "torch_loader_bench.py",
    "torch_nccl_weights_bench.py",
    "torch_pinned_bench.py",
    "torch_refit_bench.py",
    "torch_step_bench.py",
];

/// The trace-recording and what-if-check scripts, copied into `DIR/replay/` (relative to the
/// workspace root).
const REPLAY_SCRIPTS_DIR: &str = "benches/gpu";

/// Where the anchors live, relative to the workspace root (`benches/anchors/README.md` says what they
/// are).
const ANCHORS_DIR: &str = "benches/anchors";

/// PyTorch's pluggable allocator library: (package, library target name, file name), copied into
/// `DIR/torch/` with the crate's Python scripts.
const TORCH_PLUGIN: (&str, &str, &str) = (
    "tensormem-torch",
    "tensormem_torch",
    "libtensormem_torch.so",
);

/// The Python test and bench drivers of the plugin crate, relative to the workspace root (the package
/// itself, in the crate's `python/`, travels as a wheel).
const TORCH_PYTHON_DIR: &str = "crates/torch-plugin/tests/python";
/// The plugin crate, whose wheel the bundle carries.
const TORCH_PLUGIN_DIR: &str = "crates/torch-plugin";

/// Builds the bundle into `dir` (created if missing; files of an earlier bundle are replaced).
pub(crate) fn build(dir: &Path) -> Result<()> {
    let tests_dir = dir.join("tests");
    if tests_dir.exists() {
        fs::remove_dir_all(&tests_dir)
            .with_context(|| format!("could not clear {}", tests_dir.display()))?;
    }
    fs::create_dir_all(&tests_dir)
        .with_context(|| format!("could not create {}", tests_dir.display()))?;

    let mut files = Vec::new();
    for &(package, test) in GPU_TEST_TARGETS {
        let exe = build_one(
            &["test", "--no-run", "-p", package, "--test", test],
            |artifact| {
                artifact
                    .pointer("/profile/test")
                    .and_then(serde_json::Value::as_bool)
                    == Some(true)
                    && target_name(artifact) == Some(test)
            },
        )
        .with_context(|| format!("building the GPU tests of {package}"))?;
        let dest = tests_dir.join(format!("{}-{test}", package.replace('-', "_")));
        copy_executable(&exe, &dest)?;
        files.push(dest);
    }
    let examples_dir = dir.join("examples");
    if examples_dir.exists() {
        fs::remove_dir_all(&examples_dir)
            .with_context(|| format!("could not clear {}", examples_dir.display()))?;
    }
    fs::create_dir_all(&examples_dir)
        .with_context(|| format!("could not create {}", examples_dir.display()))?;
    for &(package, example) in GPU_EXAMPLES {
        let exe = build_one(
            &["build", "-p", package, "--example", example],
            |artifact| target_name(artifact) == Some(example),
        )
        .with_context(|| format!("building the example {example} of {package}"))?;
        let dest = examples_dir.join(example);
        copy_executable(&exe, &dest)?;
        files.push(dest);
    }
    for &(package, bin) in BENCH_BINS {
        let exe = build_one(&["build", "-p", package, "--bin", bin], |artifact| {
            target_name(artifact) == Some(bin)
        })
        .with_context(|| format!("building {bin}"))?;
        let dest = dir.join(bin);
        copy_executable(&exe, &dest)?;
        files.push(dest);
    }

    files.extend(copy_anchors(dir)?);
    let replay_dir = dir.join("replay");
    fs::create_dir_all(&replay_dir)
        .with_context(|| format!("could not create {}", replay_dir.display()))?;
    copy_scripts(
        &crate::gpu_tests::workspace_root().join(REPLAY_SCRIPTS_DIR),
        &replay_dir,
    )?;
    files.push(bundle_torch_plugin(dir)?);

    let run_sh = dir.join("run.sh");
    fs::write(&run_sh, RUN_SH).with_context(|| format!("could not write {}", run_sh.display()))?;
    set_executable(&run_sh)?;

    let mut glibc = (0, 0);
    let mut total = 0u64;
    for file in &files {
        total += fs::metadata(file)?.len();
        glibc = glibc.max(newest_glibc_symbol(file)?);
    }
    let readme = dir.join("README.txt");
    fs::write(&readme, readme_text(&files, dir, glibc))
        .with_context(|| format!("could not write {}", readme.display()))?;
    eprintln!(
        "xtask: bundle in {} ({} files, {:.1} MiB; needs glibc >= 2.{}); run it on the GPU host with: bash {}/run.sh",
        dir.display(),
        files.len() + 2,
        total as f64 / (1024.0 * 1024.0),
        glibc.1,
        dir.display()
    );
    Ok(())
}

/// Builds the PyTorch plugin library into `DIR/torch/` beside its Python scripts; returns the library's
/// path there.
fn bundle_torch_plugin(dir: &Path) -> Result<PathBuf> {
    let (package, target, file) = TORCH_PLUGIN;
    let torch_dir = dir.join("torch");
    if torch_dir.exists() {
        fs::remove_dir_all(&torch_dir)
            .with_context(|| format!("could not clear {}", torch_dir.display()))?;
    }
    fs::create_dir_all(&torch_dir)
        .with_context(|| format!("could not create {}", torch_dir.display()))?;
    let lib = build_artifact(
        &["build", "-p", package, "--lib"],
        |artifact| target_name(artifact) == Some(target),
        |artifact| {
            artifact["filenames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(serde_json::Value::as_str)
                .find(|f| f.ends_with(".so"))
                .map(PathBuf::from)
        },
    )
    .with_context(|| format!("building {package}"))?;
    let dest = torch_dir.join(file);
    fs::copy(&lib, &dest)
        .with_context(|| format!("could not copy {} to {}", lib.display(), dest.display()))?;
    let root = crate::gpu_tests::workspace_root();
    copy_scripts(&root.join(TORCH_PYTHON_DIR), &torch_dir)?;
    build_wheel(&root.join(TORCH_PLUGIN_DIR), &dest, &torch_dir)?;
    Ok(dest)
}

/// Copies the [`ANCHOR_SCRIPTS`] into `DIR/anchors/`; returns the copies. An anchor missing from
/// [`ANCHORS_DIR`] is left out with a note.
fn copy_anchors(dir: &Path) -> Result<Vec<PathBuf>> {
    let from = crate::gpu_tests::workspace_root().join(ANCHORS_DIR);
    let to = dir.join("anchors");
    fs::create_dir_all(&to).with_context(|| format!("could not create {}", to.display()))?;
    let mut copied = Vec::new();
    for script in ANCHOR_SCRIPTS {
        let source = from.join(script);
        if !source.is_file() {
            eprintln!(
                "xtask: {} not found: the bundle carries no copy of that anchor",
                source.display()
            );
            continue;
        }
        let dest = to.join(script);
        fs::copy(&source, &dest).with_context(|| {
            format!("could not copy {} to {}", source.display(), dest.display())
        })?;
        copied.push(dest);
    }
    Ok(copied)
}

/// Copies the scripts (`.py` files) of `from` into `to`; the package itself travels as a wheel.
fn copy_scripts(from: &Path, to: &Path) -> Result<()> {
    for entry in fs::read_dir(from).with_context(|| format!("could not read {}", from.display()))? {
        let path = entry?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "py") {
            let dest = to.join(path.file_name().unwrap_or_default());
            fs::copy(&path, &dest).with_context(|| {
                format!("could not copy {} to {}", path.display(), dest.display())
            })?;
        }
    }
    Ok(())
}

/// Builds the plugin's wheel (`pip install crates/torch-plugin` on a host without Rust) around the
/// library just built, into `to`; the bundle's `run.sh` installs it for the real-client tests.
fn build_wheel(crate_dir: &Path, lib: &Path, to: &Path) -> Result<()> {
    // pip runs the build in a folder of its own: hand it absolute paths.
    let lib = fs::canonicalize(lib).with_context(|| format!("no library at {}", lib.display()))?;
    let to = fs::canonicalize(to).with_context(|| format!("no folder {}", to.display()))?;
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
        ])
        .arg(&to)
        .arg(crate_dir)
        .env("TENSORMEM_TORCH_LIB", &lib)
        .status()
        .context("could not run python3 -m pip wheel (install pip, setuptools and wheel)")?;
    anyhow::ensure!(
        status.success(),
        "building the tensormem-torch wheel failed ({status}); python3 needs pip, setuptools and wheel"
    );
    for leftover in [
        crate_dir.join("build"),
        crate_dir.join("python").join("tensormem_torch.egg-info"),
    ] {
        let _ = fs::remove_dir_all(leftover);
    }
    Ok(())
}

/// Runs `cargo <args> --release --message-format=json` with debug info off and stripping on, and returns
/// the one executable whose artifact message `wanted` accepts.
fn build_one(args: &[&str], wanted: impl Fn(&serde_json::Value) -> bool) -> Result<PathBuf> {
    build_artifact(args, wanted, |artifact| {
        artifact["executable"].as_str().map(PathBuf::from)
    })
}

/// As [`build_one`], with `file` picking the wanted file out of an accepted artifact message.
fn build_artifact(
    args: &[&str],
    wanted: impl Fn(&serde_json::Value) -> bool,
    file: impl Fn(&serde_json::Value) -> Option<PathBuf>,
) -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args(args)
        .args(["--release", "--message-format=json-render-diagnostics"])
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().context("could not run cargo")?;
    let stdout = child
        .stdout
        .take()
        .context("cargo's stdout was not captured")?;
    let mut found = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || !wanted(&msg) {
            continue;
        }
        if let Some(path) = file(&msg) {
            found.push(path);
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!("cargo {} produced no matching executable", args.join(" ")),
        many => bail!(
            "cargo {} produced several matching executables: {many:?}",
            args.join(" ")
        ),
    }
}

/// The target name of an artifact message.
fn target_name(artifact: &serde_json::Value) -> Option<&str> {
    artifact
        .pointer("/target/name")
        .and_then(serde_json::Value::as_str)
}

fn copy_executable(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to)
        .with_context(|| format!("could not copy {} to {}", from.display(), to.display()))?;
    set_executable(to)
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("could not make {} executable", path.display()))
}

/// The newest `GLIBC_2.N` symbol version named in an executable, as `(2, N)`: the oldest glibc it runs on.
fn newest_glibc_symbol(path: &Path) -> Result<(u32, u32)> {
    let bytes = fs::read(path).with_context(|| format!("could not read {}", path.display()))?;
    let needle = b"GLIBC_2.";
    let mut newest = (2, 0);
    let mut i = 0;
    while let Some(pos) = bytes[i..].windows(needle.len()).position(|w| w == needle) {
        let start = i + pos + needle.len();
        let digits: String = bytes[start..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .map(|&b| b as char)
            .collect();
        if let Ok(minor) = digits.parse::<u32>() {
            newest = newest.max((2, minor));
        }
        i = start;
    }
    Ok(newest)
}

fn readme_text(files: &[PathBuf], dir: &Path, glibc: (u32, u32)) -> String {
    let text = String::from(
        "tensormem GPU test bundle, built by `cargo xtask test-gpu --bundle`.\n\n\
         Run on a machine with an NVIDIA GPU and driver (no Rust toolchain needed):\n\n    bash run.sh\n\n\
         run.sh runs every test executable, then every example (examples/), with TENSORMEM_REQUIRE_GPU=1\n\
         (a missing GPU fails instead of\n\
         skipping) and, when `python3 -c 'import torch'` works, TENSORMEM_REQUIRE_TORCH=1 (the PyTorch interop\n\
         checks must run). It exits non-zero if any test failed. Extra arguments go to every test executable\n\
         (e.g. a test name filter).\n\n\
         The allocator benchmark against PyTorch (the anchors are copied into anchors/):\n\n    \
         bash gpu-bundle/anchors/compare_alloc.sh gpu-bundle/alloc_patterns\n\n\
         alloc_patterns --sim runs the same patterns on the simulated device; --raw uses the pointer API\n\
         (raw_alloc/raw_free) instead of Allocation handles; --history LEVEL records memory history\n\
         (none, state, alloc, all) while timing. host_probe prints the host's clock, instructions per cycle,\n\
         load latencies and branch cost: run it beside the benchmark (a core shared with a busy SMT\n\
         sibling retires a third fewer instructions a cycle, and the allocator's hot paths slow with it).\n\n\
         The pinned host allocator against PyTorch's, in one call:\n\n    \
         gpu-bundle/pinned_patterns; gpu-bundle/pinned_patterns --register 8; \
         python3 gpu-bundle/anchors/torch_pinned_bench.py\n\n\
         A 10 GiB pool put to sleep and woken, with and without contents, against the pinned-copy\n\
         bandwidth of the same run (--gib N for a smaller pool); the first cycle's backup pinned\n\
         with cuMemHostAlloc, then with malloc + cuMemHostRegister (8 threads touching):\n\n    \
         gpu-bundle/sleep_wake_bench --gib 22; gpu-bundle/sleep_wake_bench --gib 22 --register 8\n\n\
         The CUDA IPC round trip against PyTorch's (same call, same machine):\n\n    \
         gpu-bundle/ipc_roundtrip; python3 gpu-bundle/anchors/torch_sharing_bench.py\n\n\
         A whole model handed to another process as one batch against PyTorch's state dict on a\n\
         torch.multiprocessing Queue (GPT-2-small and 7B layouts; --quick for GPT-2 only, 3 rounds;\n\
         the anchor is copied into anchors/):\n\n    \
         gpu-bundle/handoff_bench; python3 gpu-bundle/anchors/torch_handoff_bench.py both 20\n\n\
         The sharing benchmarks, each beside its PyTorch anchor in the same call:\n\n    \
         gpu-bundle/shm_pool_bench --same-cpu; python3 gpu-bundle/anchors/torch_sharing_bench.py\n    \
         gpu-bundle/shm_loader_bench 67108864 200 4; python3 gpu-bundle/anchors/torch_loader_bench.py 67108864 200 4\n    \
         gpu-bundle/shm_loader_bench 1048576 100 2; python3 gpu-bundle/anchors/torch_loader_bench.py 1048576 100 2\n    \
         gpu-bundle/storage_pool_bench   # the storage facade's pooled paths vs the bare pool (within 10%)\n\n\
         (shm_bench prints the non-pooled round trips, copy plans and the machine's huge-page settings.)\n\n\
         torch/ holds PyTorch's pluggable allocator on tensormem (libtensormem_torch.so) and its Python\n\
         scripts; run.sh runs the real-client checks (GPT-2 and CUDA-graph training, losses against the\n\
         native allocator). The benchmark against PyTorch's native allocator, in one call:\n\n\
         \x20   python3 gpu-bundle/torch/step_bench.py --lib gpu-bundle/torch/libtensormem_torch.so\n\n\
         replay/ holds the trace recorders and the check of `tensormem replay --config X` against runs\n\
         made under X for real (the command is gpu-bundle/tensormem):\n\n    \
         python3 gpu-bundle/replay/whatif_check.py /tmp/whatif --tensormem gpu-bundle/tensormem\n    \
         python3 gpu-bundle/replay/record_fidelity_traces.py /tmp/traces [NAME ...]\n\n",
    );
    let name = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut text = text.replace("gpu-bundle/", &format!("{name}/"));
    let _ = writeln!(text, "Needs glibc 2.{} or newer. Files:", glibc.1);
    for file in files {
        let _ = writeln!(
            text,
            "  {}",
            file.strip_prefix(dir).unwrap_or(file).display()
        );
    }
    text
}

/// The bundle's runner: every test executable, one test at a time, failing if any failed.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs every tensormem GPU test executable, then every GPU example, of this bundle on this machine's
# GPUs. Exits non-zero if any failed. The GPU and PyTorch tests are #[ignore]d (a plain `cargo test`
# lists them as ignored): --include-ignored runs them. Arguments are passed to every test executable.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export TENSORMEM_REQUIRE_GPU=1
# PyTorch's pluggable allocator on tensormem and its scripts, for the real-client tests.
export TENSORMEM_TORCH_LIB="$here/torch/libtensormem_torch.so"
export TENSORMEM_TORCH_PYTHON="$here/torch"
# The plugin's wheel, installed as a user would (its C++ layer compiles on first use, cached here).
if python3 -m pip install -q --no-deps --no-index --target "$here/torch/site" "$here"/torch/tensormem_torch-*.whl; then
  export PYTHONPATH="$here/torch/site${PYTHONPATH:+:$PYTHONPATH}"
  export TENSORMEM_TORCH_CACHE="$here/torch/cache"
else
  echo "run.sh: installing the tensormem-torch wheel failed" >&2
fi
if python3 -c 'import torch' >/dev/null 2>&1; then
  export TENSORMEM_REQUIRE_TORCH=1
  echo "run.sh: python3 has torch: PyTorch interop checks are required"
else
  echo "run.sh: python3 -c 'import torch' failed: PyTorch interop checks will skip"
fi
# NCCL for the NCCL tests: the library PyTorch's wheels ship, when no other is on the loader's path.
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
if [ -n "$nccl_lib" ] && [ -d "$nccl_lib" ]; then
  export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export NCCL_NVLS_ENABLE=0
failed=()
for t in "$here"/tests/*; do
  echo "== $(basename "$t")"
  if ! "$t" --include-ignored --test-threads=1 "$@"; then
    failed+=("$(basename "$t")")
  fi
done
for e in "$here"/examples/*; do
  [ -e "$e" ] || continue
  echo "== example $(basename "$e")"
  if ! "$e"; then
    failed+=("example $(basename "$e")")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "run.sh: FAILED: ${failed[*]}"
  exit 1
fi
echo "run.sh: all GPU tests passed"
"#;

#[cfg(test)]
mod tests {
    use super::RUN_SH;
    use crate::gpu_tests::{INCLUDE_IGNORED, REQUIRE_GPU, REQUIRE_TORCH};

    #[test]
    fn run_sh_names_the_variables_the_tests_read() {
        assert!(RUN_SH.contains(&format!("export {REQUIRE_GPU}=1")));
        assert!(RUN_SH.contains(&format!("export {REQUIRE_TORCH}=1")));
        // The names tensormem-torch's tests read.
        assert!(RUN_SH.contains(&format!(
            "export TENSORMEM_TORCH_LIB=\"$here/torch/{}\"",
            super::TORCH_PLUGIN.2
        )));
        assert!(RUN_SH.contains("export TENSORMEM_TORCH_PYTHON=\"$here/torch\""));
    }

    #[test]
    fn run_sh_runs_the_ignored_gpu_tests() {
        assert!(RUN_SH.contains(&format!("\"$t\" {INCLUDE_IGNORED} ")));
    }

    #[test]
    fn newest_glibc_symbol_reads_the_highest_version() {
        let path = std::env::temp_dir().join(format!("xtask-glibc-{}", std::process::id()));
        std::fs::write(
            &path,
            b"\x7fELF..GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_2.17\0GLIBC_PRIVATE\0",
        )
        .unwrap();
        let newest = super::newest_glibc_symbol(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(newest.unwrap(), (2, 34));
    }
}
