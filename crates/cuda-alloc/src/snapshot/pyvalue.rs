//! [`PyValue`]: the plain Python data a snapshot pickle holds.

use std::fmt;

/// A plain Python value, as `pickle.load` returns it for a memory snapshot: `None`, `bool`, `int`,
/// `float`, `str`, `bytes`, `list`, `tuple`, `dict`, `set`, `frozenset`. No class instances.
///
/// Dicts keep their insertion order (as Python's do), so a snapshot read and written again keeps its
/// layout. Values nest at most [`MAX_DEPTH`] levels.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `bool`.
    Bool(bool),
    /// `int`, up to 128 bits wide (snapshots hold addresses, sizes and timestamps, all below 2^64).
    Int(i128),
    /// `float`.
    Float(f64),
    /// `str`.
    Str(String),
    /// `bytes` (a `bytearray` reads as `bytes` too).
    Bytes(Vec<u8>),
    /// `list`.
    List(Vec<PyValue>),
    /// `tuple`.
    Tuple(Vec<PyValue>),
    /// `dict`, in insertion order.
    Dict(Vec<(PyValue, PyValue)>),
    /// `set`.
    Set(Vec<PyValue>),
    /// `frozenset`.
    FrozenSet(Vec<PyValue>),
}

/// How deep [`PyValue`]s may nest (a snapshot needs 5 levels; the limit keeps hostile files from
/// exhausting the stack).
pub const MAX_DEPTH: usize = 200;

impl PyValue {
    /// Python's name for the value's type (`'dict'`, `'list'`, ...), for error messages.
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        match self {
            PyValue::None => "NoneType",
            PyValue::Bool(_) => "bool",
            PyValue::Int(_) => "int",
            PyValue::Float(_) => "float",
            PyValue::Str(_) => "str",
            PyValue::Bytes(_) => "bytes",
            PyValue::List(_) => "list",
            PyValue::Tuple(_) => "tuple",
            PyValue::Dict(_) => "dict",
            PyValue::Set(_) => "set",
            PyValue::FrozenSet(_) => "frozenset",
        }
    }

    /// The string, if this is a `str`.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is an `int` (or a `bool`, which is an `int` in Python).
    #[must_use]
    pub fn as_int(&self) -> Option<i128> {
        match self {
            PyValue::Int(i) => Some(*i),
            PyValue::Bool(b) => Some(i128::from(*b)),
            _ => None,
        }
    }

    /// The value stored under the string key `key`, if this is a `dict` holding it.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&PyValue> {
        match self {
            PyValue::Dict(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The children of a container (list, tuple, set, frozenset; keys then values of a dict in order).
    pub(crate) fn children(&self) -> Box<dyn Iterator<Item = &PyValue> + '_> {
        match self {
            PyValue::List(v) | PyValue::Tuple(v) | PyValue::Set(v) | PyValue::FrozenSet(v) => {
                Box::new(v.iter())
            }
            PyValue::Dict(items) => Box::new(items.iter().flat_map(|(k, v)| [k, v])),
            _ => Box::new(std::iter::empty()),
        }
    }

    /// How many levels this value nests (0 for a scalar, 1 for a container of scalars), counted without
    /// recursion.
    #[must_use]
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut pending = vec![(self, 0usize)];
        while let Some((value, level)) = pending.pop() {
            deepest = deepest.max(level);
            pending.extend(value.children().map(|child| (child, level + 1)));
        }
        deepest
    }
}

impl From<&str> for PyValue {
    fn from(s: &str) -> Self {
        PyValue::Str(s.to_owned())
    }
}

impl From<String> for PyValue {
    fn from(s: String) -> Self {
        PyValue::Str(s)
    }
}

impl From<bool> for PyValue {
    fn from(b: bool) -> Self {
        PyValue::Bool(b)
    }
}

impl From<i64> for PyValue {
    fn from(i: i64) -> Self {
        PyValue::Int(i.into())
    }
}

impl From<u64> for PyValue {
    fn from(i: u64) -> Self {
        PyValue::Int(i.into())
    }
}

impl From<f64> for PyValue {
    fn from(f: f64) -> Self {
        PyValue::Float(f)
    }
}

impl fmt::Display for PyValue {
    /// A short Python-like rendering for messages (containers show their type and length only).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PyValue::None => f.write_str("None"),
            PyValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            PyValue::Int(i) => write!(f, "{i}"),
            PyValue::Float(x) => write!(f, "{x}"),
            PyValue::Str(s) => write!(f, "{s:?}"),
            PyValue::Bytes(b) => write!(f, "<bytes of length {}>", b.len()),
            PyValue::List(v) | PyValue::Tuple(v) | PyValue::Set(v) | PyValue::FrozenSet(v) => {
                write!(f, "<{} of length {}>", self.type_name(), v.len())
            }
            PyValue::Dict(items) => write!(f, "<dict of length {}>", items.len()),
        }
    }
}
