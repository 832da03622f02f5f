//! Typed views of received device memory: [`DeviceView`] over [`DeviceElement`]s.

use std::marker::PhantomData;

use tensormem_cuda_alloc::DeviceAddress;

use crate::error::{Error, Result};

mod sealed {
    pub trait Sealed {}
}

/// Plain numeric types a [`DeviceView`] can hold (every bit pattern valid).
pub trait DeviceElement: sealed::Sealed + Copy + 'static {}

macro_rules! device_element {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl DeviceElement for $t {}
    )*};
}
device_element!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

/// Received device memory seen as `len` elements of `T`; borrows the [`ReceivedMemory`](crate::ReceivedMemory).
#[derive(Debug, Clone, Copy)]
pub struct DeviceView<'a, T: DeviceElement> {
    ptr: DeviceAddress,
    len: usize,
    _memory: PhantomData<&'a [T]>,
}

impl<T: DeviceElement> DeviceView<'_, T> {
    /// `bytes` at `ptr` as elements of `T`, checked to fit.
    pub(crate) fn new(ptr: DeviceAddress, bytes: u64) -> Result<Self> {
        let elem = std::mem::size_of::<T>();
        let align = std::mem::align_of::<T>();
        if !bytes.is_multiple_of(elem as u64) || !ptr.0.is_multiple_of(align as u64) {
            return Err(Error::BadView {
                bytes,
                addr: ptr.0,
                elem_size: elem,
                align,
            });
        }
        Ok(DeviceView {
            ptr,
            len: (bytes / elem as u64) as usize,
            _memory: PhantomData,
        })
    }

    /// The device address of the first element.
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        self.ptr
    }

    /// The number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element `index`, if in range.
    #[must_use]
    pub fn element_ptr(&self, index: usize) -> Option<DeviceAddress> {
        (index < self.len).then(|| self.ptr.offset(index * std::mem::size_of::<T>()))
    }
}
