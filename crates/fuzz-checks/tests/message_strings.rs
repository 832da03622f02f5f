//! Messages read as they were written: no string literal in the sources carries a source line's
//! indentation into its value.
//!
//! A message written across source lines needs a `\` at the end of each line, which drops the
//! newline and the next line's indentation. Without it, the newline and the indentation become
//! part of the message; and once a formatter or an editor joins such a literal onto one line, the
//! message reads `made by a          share_memory_`. This test reads every Rust source under
//! `crates/*/src`, `benches/src` and `xtask/src` (and the C++ and Python sources of the PyTorch
//! plugin), tokenizes their string literals, and fails on either shape:
//!
//! - a literal that opens on an indented line and runs onto the next source line without a `\`,
//!   taking that line's indentation;
//! - a run of three or more spaces between two words of a line of a literal's value.
//!
//! Deliberate layouts pass: usage texts whose lines start with their indentation, columns aligned
//! before a `:` or after a placeholder, raw strings (`r"..."`, Python's triple quotes), and files
//! under `tests/`. A layout that needs a gap between words writes it with a width (`{:<12}`).

use std::path::{Path, PathBuf};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `dir` (recursively) whose name ends with one of `extensions`, sorted.
fn files_under(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            files_under(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|ext| extensions.iter().any(|&wanted| ext == wanted))
        {
            out.push(path);
        }
    }
}

/// A string literal's value and where it is.
#[derive(Debug)]
struct Literal {
    /// The source line it opens on (1-based).
    line: usize,
    /// Its value, escapes and `\` line continuations resolved.
    value: String,
    /// It opens on an indented line and runs onto a next line that starts with spaces or tabs
    /// (a line break without the `\` that would have dropped them).
    takes_indentation: bool,
}

/// The non-raw string literals (`"..."`, `b"..."`, `c"..."`) of Rust source `src`. Comments, char
/// literals, lifetimes and raw strings are stepped over; raw strings are laid out verbatim on
/// purpose and are not returned.
fn rust_literals(src: &str) -> Vec<Literal> {
    let s: Vec<char> = src.chars().collect();
    let n = s.len();
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    let mut line_starts = vec![0];
    line_starts.extend((0..n).filter(|&i| s[i] == '\n').map(|i| i + 1));
    let line_of = |i: usize| line_starts.partition_point(|&start| start <= i);

    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let c = s[i];
        if c == '/' && at(i + 1) == '/' {
            while i < n && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= n {
                    break;
                } else if s[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < n && (s[i].is_alphanumeric() || s[i] == '_') {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            if matches!(word.as_str(), "r" | "br" | "cr") {
                let mut quote = i;
                while at(quote) == '#' {
                    quote += 1;
                }
                if at(quote) == '"' {
                    // A raw string: skip to `"` followed by as many `#` as opened it.
                    let hashes = quote - i;
                    i = quote + 1;
                    while i < n && !(s[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#')) {
                        i += 1;
                    }
                    i += 1 + hashes;
                }
                // Otherwise a raw identifier (`r#type`) or a plain name.
            }
            // `b"..."` and `c"..."` go on to the string below.
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped char literal: `'\''`, `'\n'`, `'\u{1b}'`.
                i += 3;
                while i < n && s[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3; // `'a'`, `'"'`
            } else {
                i += 1; // a lifetime or a label
            }
        } else if c == '"' {
            let opening_line = line_of(i);
            let indented = matches!(at(line_starts[opening_line - 1]), ' ' | '\t');
            let mut literal = Literal {
                line: opening_line,
                value: String::new(),
                takes_indentation: false,
            };
            i += 1;
            while i < n && s[i] != '"' {
                if s[i] == '\\' {
                    let escape = at(i + 1);
                    i += 2;
                    match escape {
                        '\n' | '\r' => {
                            while i < n && s[i].is_whitespace() {
                                i += 1;
                            }
                        }
                        'n' => literal.value.push('\n'),
                        't' => literal.value.push('\t'),
                        'r' => literal.value.push('\r'),
                        '0' => literal.value.push('\0'),
                        'x' => {
                            let hex: String = s[i..(i + 2).min(n)].iter().collect();
                            let code = u32::from_str_radix(&hex, 16).unwrap_or(0);
                            literal
                                .value
                                .push(char::from_u32(code).unwrap_or('\u{fffd}'));
                            i += 2;
                        }
                        'u' => {
                            let start = i + 1;
                            while i < n && s[i] != '}' {
                                i += 1;
                            }
                            let hex: String = s[start.min(i)..i].iter().collect();
                            let code = u32::from_str_radix(&hex, 16).unwrap_or(0xfffd);
                            literal
                                .value
                                .push(char::from_u32(code).unwrap_or('\u{fffd}'));
                            i += 1;
                        }
                        other => literal.value.push(other),
                    }
                } else {
                    if s[i] == '\n' && indented && matches!(at(i + 1), ' ' | '\t') {
                        literal.takes_indentation = true;
                    }
                    literal.value.push(s[i]);
                    i += 1;
                }
            }
            i += 1;
            out.push(literal);
        } else {
            i += 1;
        }
    }
    out
}

/// The single-line string literals of C++ or Python source `src` (`python` picks the comment
/// marker and the quotes), with `\n` resolved. Python's triple-quoted strings are stepped over.
fn c_or_python_literals(src: &str, python: bool) -> Vec<Literal> {
    let s: Vec<char> = src.chars().collect();
    let n = s.len();
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < n {
        let c = s[i];
        let comment = if python {
            c == '#'
        } else {
            c == '/' && at(i + 1) == '/'
        };
        if c == '\n' {
            line += 1;
            i += 1;
        } else if comment {
            while i < n && s[i] != '\n' {
                i += 1;
            }
        } else if !python && c == '/' && at(i + 1) == '*' {
            i += 2;
            while i < n && !(s[i] == '*' && at(i + 1) == '/') {
                line += usize::from(s[i] == '\n');
                i += 1;
            }
            i += 2;
        } else if python && (c == '"' || c == '\'') && at(i + 1) == c && at(i + 2) == c {
            i += 3;
            while i < n && !(s[i] == c && at(i + 1) == c && at(i + 2) == c) {
                line += usize::from(s[i] == '\n');
                i += if s[i] == '\\' { 2 } else { 1 };
            }
            i += 3;
        } else if c == '\'' && !python {
            // A char literal, or a digit separator (`1'000`).
            if i > 0 && s[i - 1].is_ascii_alphanumeric() {
                i += 1;
            } else {
                i += 1;
                while i < n && s[i] != '\'' && s[i] != '\n' {
                    i += if s[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
        } else if c == '"' || (python && c == '\'') {
            let mut literal = Literal {
                line,
                value: String::new(),
                takes_indentation: false,
            };
            i += 1;
            while i < n && s[i] != c && s[i] != '\n' {
                if s[i] == '\\' {
                    match at(i + 1) {
                        'n' => literal.value.push('\n'),
                        other => {
                            literal.value.push('\\');
                            literal.value.push(other);
                        }
                    }
                    i += 2;
                } else {
                    literal.value.push(s[i]);
                    i += 1;
                }
            }
            i += 1;
            out.push(literal);
        } else {
            i += 1;
        }
    }
    out
}

/// A run of three or more spaces between two words on a line of `value` (a line that starts with
/// its own indentation is laid out on purpose and passes), with a little of its context.
fn spaced_words(value: &str) -> Option<String> {
    let word_end = |c: char| c.is_alphanumeric() || matches!(c, ',' | ';' | '.' | ')' | '`');
    let word_start = |c: char| c.is_alphanumeric() || matches!(c, '(' | '`');
    for line in value.split('\n') {
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let chars: Vec<char> = line.chars().collect();
        let mut i = 1;
        while i < chars.len() {
            if chars[i] != ' ' {
                i += 1;
                continue;
            }
            let start = i;
            while i < chars.len() && chars[i] == ' ' {
                i += 1;
            }
            if i - start >= 3
                && i < chars.len()
                && word_end(chars[start - 1])
                && word_start(chars[i])
            {
                let from = start.saturating_sub(20);
                let to = (i + 20).min(chars.len());
                return Some(chars[from..to].iter().collect());
            }
        }
    }
    None
}

/// What is wrong with `literal`, if anything.
fn problem(literal: &Literal) -> Option<String> {
    if literal.takes_indentation {
        return Some(
            "runs onto the next source line without a `\\` and takes its indentation".to_owned(),
        );
    }
    spaced_words(&literal.value).map(|context| format!("has a run of spaces: {context:?}"))
}

/// The problems of one file, as `path:line: problem`.
fn problems_in(path: &Path, root: &Path) -> Vec<String> {
    let src = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let literals = match path.extension().and_then(|ext| ext.to_str()) {
        Some("rs") => rust_literals(&src),
        Some("py") => c_or_python_literals(&src, true),
        _ => c_or_python_literals(&src, false),
    };
    let shown = path
        .strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string();
    literals
        .iter()
        .filter_map(|literal| problem(literal).map(|p| format!("{shown}:{}: {p}", literal.line)))
        .collect()
}

#[test]
fn no_message_carries_source_indentation() {
    let root = root();
    let mut files = Vec::new();
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/ exists");
    let mut crate_dirs: Vec<PathBuf> = crates
        .map(|e| e.expect("a directory entry").path())
        .collect();
    crate_dirs.sort();
    for dir in crate_dirs {
        files_under(&dir.join("src"), &["rs"], &mut files);
    }
    files_under(&root.join("benches/src"), &["rs"], &mut files);
    files_under(&root.join("xtask/src"), &["rs"], &mut files);
    let plugin = root.join("crates/torch-plugin");
    files_under(&plugin.join("csrc"), &["cpp", "h", "hpp", "cu"], &mut files);
    files_under(&plugin.join("python"), &["py"], &mut files);
    assert!(files.len() > 50, "only {} source files found", files.len());

    let problems: Vec<String> = files.iter().flat_map(|f| problems_in(f, &root)).collect();
    assert!(
        problems.is_empty(),
        "string literals with source indentation in their value (end the line with `\\`, \
         or join the words with one space):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_scanner_finds_both_shapes() {
    let joined = r#"
    #[error(
        "pool exists already (made by a          share_memory_); call set_default_pool first"
    )]
    Joined,
"#;
    let found = rust_literals(joined);
    assert_eq!(found.len(), 1);
    assert!(problem(&found[0]).is_some_and(|p| p.contains("made by a")));
    assert_eq!(found[0].line, 3);

    let broken = "fn f() {\n    let m = \"made by a\n        share_memory_\";\n}\n";
    let found = rust_literals(broken);
    assert_eq!(found.len(), 1);
    assert!(found[0].takes_indentation);

    let python =
        "raise ValueError('no allocation has memory; share empty          ones one by one')\n";
    assert!(problem(&c_or_python_literals(python, true)[0]).is_some());
    let cpp =
        "  TORCH_CHECK(ok, \"a batch is of one device (send          one batch per device)\");\n";
    assert!(problem(&c_or_python_literals(cpp, false)[0]).is_some());
}

#[test]
fn the_scanner_passes_deliberate_layouts() {
    let fine = r##"
const USAGE: &str = "usage: prog [--sim]
  --sim       run on the simulated device
  --raw       use the pointer API";
fn f<'a>(x: &'a str) -> char {
    let _ = "one line, \
             continued with a backslash";
    let _ = "Currently allocated     : {}\nRequested               : {}";
    let _ = "active:    {} (allocated)";
    let _ = "\x20   indented by an escape";
    let _ = r#"raw   strings   pass"#;
    let _ = '"'; // a quote as a char does not open a string: "   "
    /* nor in a /* nested */ comment: "a   b" */
    let _ = "{name:<12}   {size:>8}";
    '\''
}
"##;
    let literals = rust_literals(fine);
    let problems: Vec<_> = literals.iter().filter_map(problem).collect();
    assert!(problems.is_empty(), "{problems:?}");
    assert!(literals
        .iter()
        .any(|l| l.value == "one line, continued with a backslash"));
    assert_eq!(literals.len(), 6, "{literals:?}");
}
