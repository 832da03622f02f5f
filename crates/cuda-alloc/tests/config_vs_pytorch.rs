//! The configuration grammar against PyTorch's own parser: a corpus of strings, well-formed and
//! hostile, each given to `torch._C._accelerator_setAllocatorSettings` (PyTorch's parser; it runs
//! without a GPU) and to [`AllocatorConfig::parse`]. Every string PyTorch accepts is accepted here
//! and every string PyTorch refuses is refused here, with three exceptions, each named below: keys
//! newer than the PyTorch installed (accepted here), a change of backend (a run-time rule), and
//! malformed lists PyTorch lets through (refused here). A second test does the same for PyTorch's
//! environment variables (which one each half of the configuration is read from), a third for
//! strings applied in turn at run time.
//!
//! `#[ignore]`d: CI has no torch. `cargo xtask test-gpu` runs it where torch imports; elsewhere
//! `cargo test -p tensormem-cuda-alloc --test config_vs_pytorch -- --ignored` (skips, saying so,
//! without torch unless `TENSORMEM_REQUIRE_TORCH=1`).
#![cfg(feature = "snapshot-io")]

mod common;

use std::io::Write;
use std::process::Stdio;

use tensormem_cuda_alloc::config::{AllocatorConfig, KNOWN_KEYS};
use tensormem_test_support::{python, torch};

/// Reads one JSON string list on stdin; for each string, puts PyTorch's settings back to a known
/// state, applies the string, and prints `ok` or the first line of the error.
const JUDGE: &str = r#"
import json, sys, torch
apply = torch._C._accelerator_setAllocatorSettings
out = []
for config in json.load(sys.stdin):
    # Keys PyTorch keeps between calls go back to their defaults first.
    try:
        apply("large_segment_size_mb:20,max_non_split_rounding_mb:20,pinned_num_register_threads:1")
    except Exception:
        apply("max_non_split_rounding_mb:20,pinned_num_register_threads:1")
    try:
        apply(config)
        out.append("ok")
    except Exception as e:
        out.append((str(e).splitlines() or [type(e).__name__])[0])
json.dump({"version": torch.__version__, "results": out}, sys.stdout)
"#;

/// Runs the Python `script` with `input` as JSON on its stdin and reads its stdout as JSON.
fn judge<T: serde::Serialize + ?Sized, R: serde::de::DeserializeOwned>(
    script: &str,
    input: &T,
) -> R {
    let mut child = python::command()
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let bytes = serde_json::to_vec(input).unwrap();
    child.stdin.take().unwrap().write_all(&bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the PyTorch side failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the PyTorch side prints JSON")
}

/// Values for a key: well-formed ones of each type and hostile ones.
const VALUES: &[&str] = &[
    "True",
    "False",
    "true",
    "1",
    "0",
    "",
    "20",
    "19",
    "21",
    "128",
    "10",
    "11",
    "4096",
    "18446744073709551615",
    "18446744073709551616",
    "-1",
    "+5",
    "0x20",
    "1e3",
    "0.5",
    "0.0",
    "1.0",
    "1",
    "1.5",
    "-0.5",
    "nan",
    "inf",
    ".5",
    "5.",
    "2",
    "3",
    "8",
    "64",
    "128",
    "256",
    "[1:4]",
    "[256:1,>:4]",
    "[1:0,2:8]",
    "[3:4]",
    "[>:4]",
    "[1:4,",
    "[]",
    "[1:4,>:8,>:2]",
    "native",
    "cudaMallocAsync",
    "async",
    "abc",
    " 20 ",
    "2 0",
    "[256 : 1 , > : 4]",
];

/// Shapes beyond key:value: separators, repetition, whitespace, junk.
const SHAPES: &[&str] = &[
    "",
    " ",
    ",",
    ",,",
    ":",
    "expandable_segments",
    "expandable_segments:",
    "expandable_segments:True,",
    ",expandable_segments:True",
    "expandable_segments:True,,max_split_size_mb:128",
    "expandable_segments=True",
    "expandable_segments:True:False",
    "expandable_segments:True max_split_size_mb:128",
    "max_split_size_mb:128,max_split_size_mb:256",
    "large_segment_size_mb:64,max_split_size_mb:32",
    "large_segment_size_mb:64,max_split_size_mb:64",
    "max_split_size_mb:32,large_segment_size_mb:64",
    "large_segment_size_mb:30,max_non_split_rounding_mb:25",
    "EXPANDABLE_SEGMENTS:True",
    "expandable_segments :True",
    "\texpandable_segments:True\n",
    "roundup_power2_divisions:4,roundup_power2_divisions:[256:2]",
    "backend:native,expandable_segments:True",
    "garbage_collection_threshold:0.6,max_split_size_mb:128",
    "[",
    "]",
    "roundup_power2_divisions:[",
    "roundup_power2_divisions:]",
    "roundup_power2_divisions:[1:4]]",
    "roundup_power2_divisions:[[1:4]]",
    "roundup_power2_divisions:[1:4:5]",
    "roundup_power2_divisions:[1,4]",
    "roundup_power2_divisions:[1:4][2:4]",
];

/// Malformed lists PyTorch 2.11 lets through (its list reader skips a token after `]` and takes
/// `[a,b]`): what it makes of them is not defined anywhere, so they are refused here with the
/// separator that is wrong.
const MALFORMED_LISTS: &[&str] = &[
    "roundup_power2_divisions:[1:4]]",
    "roundup_power2_divisions:[1,4]",
];

/// PyTorch refuses at run time a backend other than the one it loaded with: a rule of a running
/// process, not of the grammar ([`AllocatorConfig::parse`] reads a string as at start-up).
fn backend_change(message: &str) -> bool {
    message.contains("Allocator backend parsed at runtime")
}

/// Strings drawn from the grammar's own pieces (keys, separators, values, junk), from a fixed seed:
/// shapes nobody would write by hand.
fn random_strings(count: usize) -> Vec<String> {
    let mut pieces: Vec<&str> = KNOWN_KEYS.to_vec();
    pieces.extend([",", ",", ":", ":", ":", "[", "]", ">", " ", "\t"]);
    pieces.extend(VALUES.iter().filter(|v| !v.is_empty()));
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move |bound: usize| {
        // xorshift64*: deterministic, good enough to pick pieces.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % bound
    };
    (0..count)
        .map(|_| {
            let len = 1 + next(8);
            (0..len).map(|_| pieces[next(pieces.len())]).collect()
        })
        .collect()
}

/// Keys PyTorch versions after the installed one added: refused by an older PyTorch as unknown,
/// accepted here.
fn newer_than_installed(message: &str) -> bool {
    KNOWN_KEYS
        .iter()
        .any(|key| message.contains(&format!("Unrecognized key '{key}'")))
}

fn corpus() -> Vec<String> {
    let mut keys: Vec<&str> = KNOWN_KEYS.to_vec();
    keys.extend(["bogus", "max_split_size", "expandable_segment"]);
    let mut corpus: Vec<String> = SHAPES.iter().map(|s| (*s).to_owned()).collect();
    for key in &keys {
        for value in VALUES {
            corpus.push(format!("{key}:{value}"));
        }
    }
    // Well-formed pairs joined, so that whole strings and their separators are exercised too.
    for (i, key) in KNOWN_KEYS.iter().enumerate() {
        for value in ["True", "64", "0.5", "[256:2,>:4]"] {
            let other = KNOWN_KEYS[(i * 7 + 3) % KNOWN_KEYS.len()];
            corpus.push(format!("{key}:{value},{other}:{value}"));
        }
    }
    corpus.extend(MALFORMED_LISTS.iter().map(|s| (*s).to_owned()));
    corpus.extend(random_strings(3000));
    corpus
}

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn every_string_pytorch_accepts_parses_and_every_one_it_refuses_is_refused() {
    if !torch::python_with_torch() {
        return;
    }
    let corpus = corpus();
    let answer: serde_json::Value = judge(JUDGE, &corpus);
    let version = answer["version"].as_str().unwrap().to_owned();
    let theirs = answer["results"].as_array().unwrap();
    assert_eq!(theirs.len(), corpus.len());

    let mut disagreements = Vec::new();
    let mut accepted = 0;
    for (config, verdict) in corpus.iter().zip(theirs) {
        let verdict = verdict.as_str().unwrap();
        let ours = AllocatorConfig::parse(config);
        if MALFORMED_LISTS.contains(&config.as_str()) {
            assert!(ours.is_err(), "{config:?} must be refused: {ours:?}");
            continue;
        }
        match (verdict == "ok", &ours) {
            (true, Ok(_)) => accepted += 1,
            (false, Err(_)) => {}
            (false, Ok(_)) if newer_than_installed(verdict) || backend_change(verdict) => {}
            (true, Err(e)) => {
                disagreements.push(format!("{config:?}: PyTorch accepts, refused here: {e}"))
            }
            (false, Ok(parsed)) => disagreements.push(format!(
                "{config:?}: PyTorch refuses ({verdict}), accepted here as {parsed:?}"
            )),
        }
    }
    agree_all(
        &format!(
            "{} strings against PyTorch {version} ({accepted} accepted by both)",
            corpus.len()
        ),
        &disagreements,
    );
}

/// Reports how many of the cases that `what` describes PyTorch and tensormem disagree on; fails
/// listing them if any.
#[track_caller]
fn agree_all(what: &str, disagreements: &[String]) {
    eprintln!("{what}: {} disagreements", disagreements.len());
    assert!(
        disagreements.is_empty(),
        "{what}: {} disagreements:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
}

/// Asks PyTorch, in a fresh process with `vars` set, whether its configuration from the
/// environment parses (`ok` or the error's first line) and which backend it picked.
const ENV_JUDGE: &str = r#"
import json, torch
try:
    torch._C._accelerator_setAllocatorSettings("")
    verdict = "ok"
except Exception as e:
    verdict = (str(e).splitlines() or [type(e).__name__])[0]
print(json.dumps([verdict, torch._C._cuda_getAllocatorBackend()]))
"#;

/// PyTorch's variables, as PyTorch reads them: from which one each half of the configuration comes
/// (the backend among the CUDA keys), whether an error is reported, for every variable alone and
/// every pair, with values that each half reads or refuses.
#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorchs_variables_are_read_as_pytorch_reads_them() {
    if !torch::python_with_torch() {
        return;
    }
    const VARS: [&str; 3] = [
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_HIP_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    ];
    let values = [
        "",
        "backend:cudaMallocAsync,expandable_segments:True",
        "max_split_size_mb:10",
        "backend:bogus",
    ];
    let mut cases: Vec<Vec<(&str, &str)>> = Vec::new();
    for (i, a) in VARS.iter().enumerate() {
        for va in values {
            cases.push(vec![(a, va)]);
            for b in &VARS[i + 1..] {
                for vb in values {
                    cases.push(vec![(a, va), (b, vb)]);
                }
            }
        }
    }
    let judge = |case: &[(&str, &str)]| -> (String, String) {
        let mut command = python::command();
        command.args(["-c", ENV_JUDGE]);
        for var in VARS.iter().chain(["TENSORMEM_ALLOC_CONF"].iter()) {
            command.env_remove(var);
        }
        for (var, value) in case {
            command.env(var, value);
        }
        let out = command.output().expect("python3 runs");
        assert!(
            out.status.success(),
            "{case:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the judge prints a JSON pair")
    };
    // Two at a time: each child imports torch.
    let verdicts: Vec<(String, String)> = std::thread::scope(|scope| {
        let halves: Vec<_> = cases
            .chunks(cases.len().div_ceil(2))
            .map(|chunk| scope.spawn(move || chunk.iter().map(|c| judge(c)).collect::<Vec<_>>()))
            .collect();
        halves.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut disagreements = Vec::new();
    for (case, (verdict, backend)) in cases.iter().zip(&verdicts) {
        let lookup = |var: &'static str| {
            case.iter()
                .find(|(v, _)| *v == var)
                .map(|(_, value)| std::ffi::OsString::from(value))
        };
        let ours = AllocatorConfig::read_env_from(lookup);
        // Choosing cudaMallocAsync makes PyTorch ask the driver whether it supports it: without a
        // GPU that is a CUDA error after the string was accepted.
        let accepted = verdict == "ok" || verdict.starts_with("CUDA error");
        let agree = match &ours {
            Ok(config) => accepted && config.backend.name() == backend,
            Err(_) => !accepted,
        };
        if !agree {
            disagreements.push(format!(
                "{case:?}: PyTorch {verdict} / backend {backend}; here {:?}",
                ours.map(|c| c.backend)
            ));
        }
    }
    agree_all(&format!("{} environments", cases.len()), &disagreements);
}

/// Reads JSON lists of strings on stdin; applies each list's strings in turn after putting the
/// settings PyTorch keeps between calls back to their defaults, and prints each step's verdict.
const SEQUENCE_JUDGE: &str = r#"
import json, sys, torch
apply = torch._C._accelerator_setAllocatorSettings
out = []
for sequence in json.load(sys.stdin):
    apply("large_segment_size_mb:20,max_non_split_rounding_mb:20,pinned_num_register_threads:1")
    steps = []
    for config in sequence:
        try:
            apply(config)
            steps.append("ok")
        except Exception as e:
            steps.append((str(e).splitlines() or [type(e).__name__])[0])
    out.append(steps)
json.dump(out, sys.stdout)
"#;

/// Strings applied one after another at run time (`_set_allocator_settings`): what a string
/// leaves behind for the next (PyTorch resets some keys on every call and keeps the others, and
/// `large_segment_size_mb` bounds two other keys) decides whether the next is accepted.
#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn strings_applied_in_turn_are_accepted_and_refused_as_pytorch_does() {
    if !torch::python_with_torch() {
        return;
    }
    let pieces = [
        "large_segment_size_mb:64",
        "large_segment_size_mb:30",
        "max_split_size_mb:40",
        "max_split_size_mb:100",
        "max_non_split_rounding_mb:40",
        "max_non_split_rounding_mb:25",
        "max_split_size_mb:25,large_segment_size_mb:24",
        "expandable_segments:True",
        "roundup_power2_divisions:[256:2,>:4]",
        "garbage_collection_threshold:0.5",
        "pinned_num_register_threads:4",
        "",
    ];
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound as u64) as usize
    };
    let sequences: Vec<Vec<&str>> = (0..400)
        .map(|_| (0..3).map(|_| pieces[next(pieces.len())]).collect())
        .collect();
    let theirs: Vec<Vec<String>> = judge(SEQUENCE_JUDGE, &sequences);
    let mut disagreements = Vec::new();
    for (sequence, verdicts) in sequences.iter().zip(&theirs) {
        let mut config = AllocatorConfig::default();
        for (step, (text, verdict)) in sequence.iter().zip(verdicts).enumerate() {
            let ours = config.apply(text);
            if ours.is_ok() != (verdict == "ok") {
                disagreements.push(format!(
                    "{sequence:?} step {step}: PyTorch {verdict}; here {ours:?}"
                ));
                break;
            }
        }
    }
    let refused = theirs.iter().flatten().filter(|v| *v != "ok").count();
    agree_all(
        &format!(
            "{} sequences ({refused} steps refused by PyTorch)",
            sequences.len()
        ),
        &disagreements,
    );
}
