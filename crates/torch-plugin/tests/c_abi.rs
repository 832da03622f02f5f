//! The C header the C++ layer compiles against, `csrc/tensormem_abi.h`, against the Rust sources that
//! define the library's C interface: the header declares exactly the functions exported with
//! `#[no_mangle]`, each with the parameters (names and types) and result of its Rust definition,
//! exactly the `#[repr(C)]` structs field for field, the function pointer types, and the `c_int`
//! constants with their values. Runs on the CPU, where the sources are: it reads `src/` (the GPU bundle
//! does not carry it).
//!
//! Rust types map to C as the header's opening comment says: `c_int` is `int`, `usize` is `size_t`,
//! `*mut T` is `T*`, `*const T` is `T const*` (written `const T*`), `sys::CUstream` is `cudaStream_t`,
//! `[T; N]` is `T name[N]`, a named type `TorchX` or `X` is `TmX`, and `Option<F>` of a function pointer
//! type is the (nullable) function pointer itself.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

const HEADER: &str = include_str!("../csrc/tensormem_abi.h");

/// A parameter or field: its name and its C type in canonical form.
#[derive(Clone, PartialEq, Eq)]
struct Slot {
    name: String,
    ty: String,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.ty, self.name)
    }
}

/// A function or function pointer type: its parameters and its result's C type.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Signature {
    params: Vec<Slot>,
    ret: String,
}

/// What one side declares, every name in its C spelling.
#[derive(Debug, Default)]
struct Interface {
    functions: BTreeMap<String, Signature>,
    structs: BTreeMap<String, Vec<Slot>>,
    function_types: BTreeMap<String, Signature>,
    opaque: BTreeSet<String>,
    constants: BTreeMap<String, i64>,
}

// ---------------------------------------------------------------------------------------------
// The Rust side.

/// The `.rs` files under `dir`, with `//` comment lines left out.
fn rust_sources(dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("a source file");
            let code: Vec<&str> = text
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect();
            out.push((path.display().to_string(), code.join("\n")));
        }
    }
}

/// The text from `open` (an opening bracket) to its matching closing bracket, both left out, and
/// what follows.
fn balanced(text: &str, open: char, close: char) -> (&str, &str) {
    assert!(text.starts_with(open), "expected `{open}` at {text:.40}");
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                return (&text[1..i], &text[i + 1..]);
            }
        }
    }
    panic!("unbalanced `{open}` at {text:.40}");
}

/// `text` split at the commas outside any brackets, blank pieces left out.
fn split_top(text: &str, at: char) -> Vec<&str> {
    let (mut depth, mut start, mut pieces) = (0i32, 0, Vec::new());
    for (i, c) in text.char_indices() {
        match c {
            '(' | '<' | '[' | '{' => depth += 1,
            ')' | '>' | ']' | '}' => depth -= 1,
            _ if c == at && depth == 0 => {
                pieces.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    pieces.push(&text[start..]);
    pieces
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

/// `text` up to its first `;` outside any brackets.
fn statement(text: &str) -> &str {
    let mut depth = 0i32;
    for (i, c) in text.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ';' if depth == 0 => return &text[..i],
            _ => {}
        }
    }
    panic!("no `;` ends {text:.60}");
}

fn squash(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The C spelling of a Rust type, `arrays` expanding the array aliases (`TorchStatArray`).
fn c_type(rust: &str, arrays: &BTreeMap<String, String>) -> String {
    let t = squash(rust);
    if let Some(inner) = t.strip_prefix("*mut ") {
        return format!("{}*", c_type(inner, arrays));
    }
    if let Some(inner) = t.strip_prefix("*const ") {
        return format!("{} const*", c_type(inner, arrays));
    }
    if let Some(inner) = t.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')) {
        // A nullable function pointer (checked to name a function pointer type below).
        return c_type(inner, arrays);
    }
    if let Some(inner) = t.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        let (element, len) = inner.split_once(';').expect("[T; N]");
        return format!("{}[{}]", c_type(element, arrays), len.trim());
    }
    let name = t.rsplit("::").next().expect("a type name");
    if let Some(array) = arrays.get(name) {
        return c_type(array, arrays);
    }
    match name {
        "c_int" => "int".into(),
        "c_char" => "char".into(),
        "c_void" => "void".into(),
        "usize" => "size_t".into(),
        "isize" => "ptrdiff_t".into(),
        "u8" => "uint8_t".into(),
        "u64" => "uint64_t".into(),
        "i64" => "int64_t".into(),
        "f64" => "double".into(),
        "CUstream" => "cudaStream_t".into(),
        named => {
            assert!(
                named.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "a Rust type the check cannot spell in C: {rust}"
            );
            format!("Tm{}", named.strip_prefix("Torch").unwrap_or(named))
        }
    }
}

/// A Rust parameter list (`name: Type, ...`) in C.
fn rust_params(list: &str, arrays: &BTreeMap<String, String>) -> Vec<Slot> {
    split_top(list, ',')
        .into_iter()
        .map(|param| {
            let (name, ty) = param.split_once(':').expect("name: Type");
            Slot {
                name: name.trim().trim_start_matches("mut ").into(),
                ty: c_type(ty, arrays),
            }
        })
        .collect()
}

/// A Rust result (`-> Type` or nothing) in C.
fn rust_ret(after: &str, arrays: &BTreeMap<String, String>) -> String {
    match after.trim().strip_prefix("->") {
        Some(ty) => c_type(ty, arrays),
        None => "void".into(),
    }
}

/// The C interface the Rust sources under `src/` define.
fn rust_interface() -> Interface {
    let mut sources = Vec::new();
    rust_sources(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut sources,
    );
    // The type aliases first: the arrays are expanded where they are used.
    let mut arrays = BTreeMap::new();
    let mut aliases = Vec::new();
    for (_, code) in &sources {
        for (_, rest) in code
            .match_indices("pub type ")
            .map(|(i, _)| code.split_at(i))
        {
            let decl = statement(&rest["pub type ".len()..]);
            let (name, ty) = decl.split_once('=').expect("type NAME = TYPE");
            let (name, ty) = (name.trim().to_owned(), squash(ty));
            if ty.starts_with('[') {
                arrays.insert(name, ty);
            } else if ty.contains("extern \"C\" fn") {
                aliases.push((name, ty));
            }
        }
    }
    let mut rust = Interface::default();
    for (name, ty) in aliases {
        let from_paren = &ty[ty.find('(').expect("fn(")..];
        let (params, after) = balanced(from_paren, '(', ')');
        rust.function_types.insert(
            c_type(&name, &arrays),
            Signature {
                params: rust_params(params, &arrays),
                ret: rust_ret(after, &arrays),
            },
        );
    }
    for (path, code) in &sources {
        for (at, _) in code.match_indices("#[no_mangle]") {
            let decl = code[at + "#[no_mangle]".len()..].trim_start();
            let decl = decl
                .strip_prefix("pub extern \"C\" fn ")
                .or_else(|| decl.strip_prefix("pub unsafe extern \"C\" fn "))
                .unwrap_or_else(|| {
                    panic!(
                        "{path}: an export that is not `pub [unsafe] extern \"C\" fn`: {decl:.60}"
                    )
                });
            let open = decl.find('(').expect("fn name(");
            let name = decl[..open].trim().to_owned();
            let (params, after) = balanced(&decl[open..], '(', ')');
            let ret = rust_ret(&after[..after.find('{').expect("a body")], &arrays);
            let signature = Signature {
                params: rust_params(params, &arrays),
                ret,
            };
            assert!(
                rust.functions.insert(name.clone(), signature).is_none(),
                "{name} is exported twice"
            );
        }
        for (at, _) in code.match_indices("#[repr(C)]") {
            let rest = &code[at..];
            let decl = &rest[rest.find("pub struct ").expect("#[repr(C)] pub struct")..];
            let open = decl.find('{').expect("a struct with named fields");
            let name = decl["pub struct ".len()..open].trim();
            let (body, _) = balanced(&decl[open..], '{', '}');
            rust.structs.insert(
                c_type(name, &arrays),
                rust_params(&body.replace("pub ", ""), &arrays),
            );
        }
        for (at, _) in code.match_indices("pub const ") {
            let decl = statement(&code[at + "pub const ".len()..]);
            let (name, rest) = decl.split_once(':').expect("const NAME: TYPE = VALUE");
            let (ty, value) = rest.split_once('=').expect("const NAME: TYPE = VALUE");
            if ty.trim() == "c_int" {
                let value = value.trim().parse().expect("a literal c_int constant");
                rust.constants.insert(name.trim().to_owned(), value);
            }
        }
    }
    // Named types that are neither structs nor function pointer types are opaque.
    let known: BTreeSet<String> = rust
        .structs
        .keys()
        .chain(rust.function_types.keys())
        .cloned()
        .collect();
    let signatures = rust.functions.values().chain(rust.function_types.values());
    for slot in signatures.flat_map(|s| s.params.iter().map(|p| &p.ty).chain([&s.ret])) {
        let base = slot.replace("const", "").replace('*', "");
        let base = base.trim();
        if base.starts_with("Tm") && !known.contains(base) {
            rust.opaque.insert(base.to_owned());
        }
    }
    rust
}

// ---------------------------------------------------------------------------------------------
// The header.

/// A C type in canonical form: `*` and `[N]` attached to what they follow, other words one space
/// apart, a leading `const` moved after its type (`const char*` is `char const*`).
fn canonical(c: &str) -> String {
    let spaced = c.replace('*', " * ").replace('[', " [");
    let mut words: Vec<&str> = spaced.split_whitespace().collect();
    if words.len() > 1 && words[0] == "const" {
        words.swap(0, 1);
    }
    let mut t = String::new();
    for word in words {
        if !(t.is_empty() || word == "*" || word.starts_with('[')) {
            t.push(' ');
        }
        t.push_str(word);
    }
    t
}

/// A C declarator (`type name`, `type name[N]`) as a slot.
fn c_slot(decl: &str) -> Slot {
    let decl = squash(decl);
    let (decl, array) = match decl.find('[') {
        Some(i) => (decl[..i].trim().to_owned(), decl[i..].to_owned()),
        None => (decl.clone(), String::new()),
    };
    let split = decl
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or_else(|| panic!("a declaration without a type: {decl}"));
    Slot {
        name: decl[split + 1..].to_owned(),
        ty: canonical(&format!("{}{array}", &decl[..=split])),
    }
}

fn c_params(list: &str) -> Vec<Slot> {
    if squash(list) == "void" {
        return Vec::new();
    }
    split_top(list, ',').into_iter().map(c_slot).collect()
}

/// The C interface the header declares (as C sees it: the C++-only lines left out).
fn header_interface() -> Interface {
    let mut code = String::new();
    let mut cplusplus = false;
    for line in HEADER.lines() {
        let line = line.trim();
        if line.starts_with("#ifdef __cplusplus") {
            cplusplus = true;
        } else if cplusplus && line.starts_with("#endif") {
            cplusplus = false;
        } else if !cplusplus && !line.starts_with('#') {
            code.push_str(line.split("//").next().unwrap_or_default());
            code.push('\n');
        }
    }
    while let Some(start) = code.find("/*") {
        let end = start + code[start..].find("*/").expect("`*/` ends a comment") + 2;
        code.replace_range(start..end, " ");
    }
    let mut header = Interface::default();
    for statement in split_top(&code, ';') {
        let statement = squash(statement);
        if let Some(body) = statement.strip_prefix("enum ") {
            let (body, _) = balanced(body, '{', '}');
            for constant in split_top(body, ',') {
                let (name, value) = constant.split_once('=').expect("NAME = VALUE");
                let value = value.trim().parse().expect("a literal value");
                assert!(
                    header
                        .constants
                        .insert(name.trim().to_owned(), value)
                        .is_none(),
                    "{name} is declared twice"
                );
            }
        } else if let Some(rest) = statement.strip_prefix("typedef struct ") {
            match rest.find('{') {
                Some(open) => {
                    let name = rest[..open].trim().to_owned();
                    let (body, alias) = balanced(&rest[open..], '{', '}');
                    assert_eq!(alias.trim(), name, "typedef struct {name} {{...}} {name}");
                    let fields = split_top(body, ';').into_iter().map(c_slot).collect();
                    header.structs.insert(name, fields);
                }
                None => {
                    let (name, alias) = rest.split_once(' ').expect("typedef struct X X");
                    assert_eq!(name, alias, "typedef struct {name} {name}");
                    header.opaque.insert(name.to_owned());
                }
            }
        } else if let Some(rest) = statement.strip_prefix("typedef ") {
            let star = rest.find("(*").expect("typedef RET (*NAME)(PARAMS)");
            let close = star + rest[star..].find(')').expect("(*NAME)");
            let name = rest[star + 2..close].trim().to_owned();
            let (params, _) = balanced(rest[close + 1..].trim_start(), '(', ')');
            let signature = Signature {
                params: c_params(params),
                ret: canonical(&rest[..star]),
            };
            header.function_types.insert(name, signature);
        } else {
            let open = statement.find('(').expect("a function declaration");
            let head = c_slot(&statement[..open]);
            let (params, _) = balanced(&statement[open..], '(', ')');
            let signature = Signature {
                params: c_params(params),
                ret: head.ty,
            };
            assert!(
                header
                    .functions
                    .insert(head.name.clone(), signature)
                    .is_none(),
                "{} is declared twice",
                head.name
            );
        }
    }
    header
}

// ---------------------------------------------------------------------------------------------

/// `what` of both sides, the differences listed in the failure.
fn same<T: PartialEq + fmt::Debug>(
    what: &str,
    rust: &BTreeMap<String, T>,
    header: &BTreeMap<String, T>,
) {
    let mut problems = Vec::new();
    for (name, r) in rust {
        match header.get(name) {
            None => problems.push(format!("{name}: missing from the header (Rust: {r:?})")),
            Some(h) if h != r => {
                problems.push(format!("{name}:\n    Rust:   {r:?}\n    header: {h:?}"));
            }
            Some(_) => {}
        }
    }
    for name in header.keys().filter(|name| !rust.contains_key(*name)) {
        problems.push(format!("{name}: in the header, not in the Rust sources"));
    }
    assert!(
        problems.is_empty(),
        "csrc/tensormem_abi.h and src/ disagree on {what}:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_header_declares_every_exported_function_as_rust_defines_it() {
    let (rust, header) = (rust_interface(), header_interface());
    assert!(
        rust.functions.len() >= 60,
        "the parse found {} exports",
        rust.functions.len()
    );
    same("the functions", &rust.functions, &header.functions);
}

#[test]
fn the_header_declares_the_repr_c_structs_field_for_field() {
    let (rust, header) = (rust_interface(), header_interface());
    assert!(rust.structs.contains_key("TmDeviceStats"), "{rust:?}");
    same("the structs", &rust.structs, &header.structs);
    assert_eq!(
        rust.opaque, header.opaque,
        "the opaque types (named in signatures, defined only in Rust)"
    );
}

#[test]
fn the_header_declares_the_function_pointer_types_and_constants() {
    let (rust, header) = (rust_interface(), header_interface());
    same(
        "the function pointer types",
        &rust.function_types,
        &header.function_types,
    );
    same("the constants", &rust.constants, &header.constants);
    // `Option<F>` is read as a nullable function pointer: it must wrap one.
    let mut sources = Vec::new();
    rust_sources(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut sources,
    );
    for (path, code) in &sources {
        for (at, _) in code.match_indices("Option<") {
            let inner = &code[at + "Option<".len()..];
            let inner = &inner[..inner.find('>').unwrap_or(inner.len())];
            let in_signature = code[..at]
                .rfind("#[no_mangle]")
                .is_some_and(|export| !code[export..at].contains('{'));
            assert!(
                !in_signature
                    || rust
                        .function_types
                        .contains_key(&c_type(inner, &BTreeMap::new())),
                "{path}: `Option<{inner}>` in an export's signature is not a function pointer type"
            );
        }
    }
}

#[test]
fn canonical_c_types_read_const_either_side() {
    assert_eq!(canonical("const char *"), "char const*");
    assert_eq!(canonical("char const*"), "char const*");
    assert_eq!(canonical("void * const *"), "void* const*");
    assert_eq!(
        c_type("*const *mut c_void", &BTreeMap::new()),
        "void* const*"
    );
    assert_eq!(
        c_type("*const std::ffi::c_char", &BTreeMap::new()),
        "char const*"
    );
    assert_eq!(
        c_slot("uint64_t roundup_power2_divisions[16]"),
        Slot {
            name: "roundup_power2_divisions".into(),
            ty: "uint64_t[16]".into()
        }
    );
}
