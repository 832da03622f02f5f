//! Gives the cdylib the soname `libtensormem_torch.so`, so that the C++ layer linked against it and a
//! `ctypes.CDLL` of its path load one library (one allocator) in a process, not two.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtensormem_torch.so");
}
