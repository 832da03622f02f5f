"""A model's weights from one process into another's own tensors, version after version.

A trainer and an inference engine on the same GPU (the colocated "refit" of RL post-training): the engine keeps
its own parameters (its CUDA graphs stay valid) and, after every optimizer step, the trainer's weights are copied
into them. The trainer names its tensors once; from then on only version numbers travel::

    # producer (the trainer)
    pub = tensormem_torch.weights.Publisher(model.state_dict())   # CUDA tensors of one device
    send(pub.message())                   # bytes, one message per consumer, over any transport
    while training:
        step()                            # writes the weights in place
        v = pub.publish()                 # after the writes queued on the current stream
        pub.wait_installed(v)             # before writing them again
    pub.close(timeout=60)                 # closes, waits until every consumer let go

    # consumer (the engine)
    sub = tensormem_torch.weights.Subscriber(receive())
    params = dict(engine.named_parameters())
    while serving:
        v = sub.install(params)           # waits for the next version, copies, synchronizes
    sub.close()

The first ``install`` checks the consumer's tensors against the published ones (names, dtypes, shapes, strides:
every mismatch is a ``WeightsError`` before anything is written) and plans the copies once per layout of
``params``. ``method="foreach"`` copies with ``torch._foreach_copy_`` on the current stream; ``method="batched"``
hands the planned copies (adjacent tensors merged) to the driver in one ``cuMemcpyBatchAsync``.
``Subscriber.tensors()`` gives the producer's tensors themselves, mapped into this process (zero copy), for a
consumer that reads them its own way between ``begin()`` and ``finish()``.

Neither process needs tensormem as PyTorch's allocator: a producer on PyTorch's own caching allocator publishes
too, its memory of expandable segments included (their chunks travel as file descriptors, where PyTorch made
them exportable, as it does for its own expandable-segment sharing). The library is loaded with ctypes (``tensormem_torch.find_library()``). Each consumer holds the
producer's memory while subscribed; a consumer that dies lets go of it, and ``Publisher.holders()`` no longer
counts it. Errors raise ``WeightsError`` (``WeightsTimeout`` for a wait that ran out of time, ``PublicationClosed``
once the producer closed the publication or exited) with the library's message.
"""
import ctypes
import json
import struct

from ._paths import last_error, load_library

__all__ = ["Publisher", "Subscriber", "WeightsError", "WeightsTimeout", "PublicationClosed"]

# The status codes of src/weights.rs (csrc/tensormem_abi.h).
TM_OK = 0
TM_OUT_OF_MEMORY = 1
TM_WEIGHTS_TIMED_OUT = 3
TM_WEIGHTS_CLOSED = 4

# A payload: magic, format version, reserved, the library's message's length and the layout's length, then both.
_MAGIC = b"TMPW"
_HEADER = struct.Struct("<4sHHII")
_FORMAT = 1

_LIB = None


class WeightsError(RuntimeError):
    """A weights call failed; the message is the library's (what was wrong and what to do)."""


class WeightsTimeout(WeightsError, TimeoutError):
    """A wait ran out of time; nothing changed: wait again, or close."""


class PublicationClosed(WeightsError):
    """The producer closed the publication or exited: no new version will come."""


_P = ctypes.c_void_p
_U64P = ctypes.POINTER(ctypes.c_uint64)
_SIZEP = ctypes.POINTER(ctypes.c_size_t)
_DESCRIBED = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), _U64P, ctypes.POINTER(ctypes.c_char_p), _U64P,
              _U64P, _U64P]
_SIGNATURES = {
    "tensormem_weights_publish": [ctypes.c_int] + _DESCRIBED + [ctypes.POINTER(_P)],
    "tensormem_weights_message": [_P, ctypes.c_void_p, ctypes.c_size_t, _SIZEP],
    "tensormem_weights_announce": [_P, _P, _U64P],
    "tensormem_weights_wait_installed": [_P, ctypes.c_uint64, ctypes.c_int64],
    "tensormem_weights_holders": [_P, _SIZEP],
    "tensormem_weights_release": [_P, ctypes.c_int64],
    "tensormem_weights_drop_publisher": [_P],
    "tensormem_weights_open": [ctypes.c_char_p, ctypes.c_size_t, _P, ctypes.POINTER(_P)],
    "tensormem_weights_sources": [_P, ctypes.c_size_t, _U64P, _SIZEP],
    "tensormem_weights_prepare": [_P] + _DESCRIBED + [ctypes.c_int, _U64P, _SIZEP],
    "tensormem_weights_install": [_P, ctypes.c_uint64, _P, ctypes.c_int64, _U64P],
    "tensormem_weights_begin": [_P, _P, ctypes.c_int64, _U64P],
    "tensormem_weights_finish": [_P, ctypes.c_uint64],
    "tensormem_weights_close_subscription": [_P],
}


def _library():
    """libtensormem_torch.so with this module's functions (``_paths.load_library``), loaded once."""
    global _LIB
    if _LIB is None:
        _LIB = load_library(_SIGNATURES)
    return _LIB


def _ok(rc, what):
    if rc == TM_OK:
        return
    message = f"tensormem weights: {what} failed: {last_error(_library())}"
    if rc == TM_WEIGHTS_TIMED_OUT:
        raise WeightsTimeout(message)
    if rc == TM_WEIGHTS_CLOSED:
        raise PublicationClosed(message)
    if rc == TM_OUT_OF_MEMORY:
        import torch
        raise torch.OutOfMemoryError(message)
    raise WeightsError(message)


def _ms(timeout):
    """Seconds (None: no limit) as the library's milliseconds (below 0: no limit)."""
    return -1 if timeout is None else max(0, int(timeout * 1000))


def _dtype_name(dtype):
    return str(dtype).rpartition(".")[2]


def _named(tensors):
    """(names, tensors) of a mapping (a state dict) or of (name, tensor) pairs (named_parameters())."""
    items = list(tensors.items()) if hasattr(tensors, "items") else list(tensors)
    return [name for name, _ in items], [t for _, t in items]


def _describe(names, tensors):
    """The library's parallel arrays for these tensors (kept alive by the caller while used)."""
    n = len(names)
    try:
        encoded = [name.encode("utf-8") for name in names]
    except AttributeError:
        raise TypeError("tensor names must be str") from None
    shapes, strides = [], []
    for t in tensors:
        shapes += t.shape
        strides += t.stride()
    return (n, (ctypes.c_char_p * n)(*encoded), (ctypes.c_uint64 * n)(*[t.data_ptr() for t in tensors]),
            (ctypes.c_char_p * n)(*[_dtype_name(t.dtype).encode() for t in tensors]),
            (ctypes.c_uint64 * n)(*[t.dim() for t in tensors]), (ctypes.c_uint64 * len(shapes))(*shapes),
            (ctypes.c_uint64 * len(strides))(*strides))


def _raw_stream(torch, stream, device):
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    return stream, _P(stream.cuda_stream or None)


class Publisher:
    """A set of CUDA tensors of one device, published to consumer processes version after version.

    ``tensors``: a mapping of names to tensors (a ``state_dict()``) or (name, tensor) pairs
    (``named_parameters()``). The publisher keeps references to them until ``close()`` succeeded: their memory
    must stay allocated while any consumer maps it. Write the weights in place (``copy_``, an optimizer step);
    a tensor replaced by another (``param.data = ...``) is not published.
    """

    def __init__(self, tensors):
        import torch
        names, values = _named(tensors)
        if not names:
            raise ValueError("tensormem weights: nothing to publish; pass a non-empty state dict")
        devices = set()
        for name, t in zip(names, values):
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                raise ValueError(f"tensormem weights: {name!r} is not a CUDA tensor; publish CUDA tensors only")
            devices.add(t.device.index)
        if len(devices) != 1:
            raise ValueError(f"tensormem weights: the tensors are on devices {sorted(devices)}; publish the "
                             "tensors of one device per Publisher")
        self.device = devices.pop()
        self.names = names
        self._tensors = values
        described = _describe(names, values)
        handle = _P()
        _ok(_library().tensormem_weights_publish(self.device, *described, ctypes.byref(handle)), "publish")
        self._handle = handle.value
        self._layout = json.dumps({
            "device": self.device,
            "tensors": [[name, _dtype_name(t.dtype), list(t.shape), list(t.stride())]
                        for name, t in zip(names, values)],
        }).encode()
        self.version = 0

    def _live(self):
        if self._handle is None:
            raise WeightsError("tensormem weights: the publisher is closed")
        return self._handle

    def message(self):
        """The bytes one consumer opens the publication with (``Subscriber(payload)``): each call takes a
        consumer slot of its own, so send each consumer its own message."""
        lib, handle = _library(), self._live()
        length = ctypes.c_size_t()
        _ok(lib.tensormem_weights_message(handle, None, 0, ctypes.byref(length)), "message")
        buf = ctypes.create_string_buffer(length.value)
        _ok(lib.tensormem_weights_message(handle, buf, length.value, ctypes.byref(length)), "message")
        rust = buf.raw[:length.value]
        return _HEADER.pack(_MAGIC, _FORMAT, 0, len(rust), len(self._layout)) + rust + self._layout

    def publish(self, stream=None):
        """Announces a new version of the weights, written by the work queued so far on ``stream`` (default: the
        current stream of the tensors' device). Returns the version (1, 2, ...). Write the weights again only
        after ``wait_installed`` for it."""
        import torch
        _, raw = _raw_stream(torch, stream, self.device)
        version = ctypes.c_uint64()
        _ok(_library().tensormem_weights_announce(self._live(), raw, ctypes.byref(version)), "publish")
        self.version = version.value
        return self.version

    def wait_installed(self, version=None, timeout=None):
        """Waits until every subscribed consumer installed ``version`` (default: the last published); consumers
        that died are skipped. Raises WeightsTimeout after ``timeout`` seconds (None: no limit)."""
        version = self.version if version is None else version
        _ok(_library().tensormem_weights_wait_installed(self._live(), version, _ms(timeout)), "wait_installed")

    def holders(self):
        """How many consumers hold the publication's memory now (dead ones are not counted)."""
        count = ctypes.c_size_t()
        _ok(_library().tensormem_weights_holders(self._live(), ctypes.byref(count)), "holders")
        return count.value

    def close(self, timeout=None):
        """Closes the publication (consumers waiting for a version get PublicationClosed) and waits until no
        consumer holds its memory; then lets go of the tensors. Raises WeightsTimeout after ``timeout`` seconds
        (None: no limit), the publication staying closed and the tensors held: call again."""
        if self._handle is None:
            return
        _ok(_library().tensormem_weights_release(self._handle, _ms(timeout)), "close")
        self._handle = None
        self._tensors = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Not closed: the publication closes without waiting, and consumers still subscribed keep mapping
        # memory that may be reused from now on (the library warns). Call close().
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None and _LIB is not None:
            _LIB.tensormem_weights_drop_publisher(handle)


class _DeviceArray:
    """A __cuda_array_interface__ over device memory this process mapped."""

    def __init__(self, ptr, shape, strides, typestr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "strides": tuple(strides),
                                         "typestr": typestr, "version": 2}


# Integer types of each element size, to carry types __cuda_array_interface__ cannot name (bfloat16, float8).
_CARRIERS = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def _alias(torch, ptr, dtype, shape, stride, device):
    """A tensor of ``dtype``, ``shape`` and ``stride`` (elements) whose first element is at ``ptr`` on ``device``,
    without copying."""
    if any(s == 0 for s in shape):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    size = getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()
    typestr = _CARRIERS[size]
    scalar = len(shape) == 0
    view = _DeviceArray(ptr, shape or [1], [s * size for s in stride] or [size], typestr)
    t = torch.as_tensor(view, device=device)
    if t.data_ptr() != ptr:
        raise WeightsError(f"tensormem weights: PyTorch copied the mapped memory at {ptr:#x} instead of viewing it")
    if t.dtype != dtype:
        t = t.view(dtype)
    return t.squeeze(0) if scalar else t


class _Plan:
    """What one layout of a consumer's tensors installs with: the library's plan, and the tensor pairs."""

    def __init__(self, names, dsts, plan, copies, srcs_by_name):
        self.names = names
        self.dsts = dsts
        self.ptrs = [t.data_ptr() for t in dsts]
        self.plan = plan
        self.copies = copies
        pairs = [(d, srcs_by_name[n]) for n, d in zip(names, dsts) if d.numel() > 0]
        self.foreach_dsts = [d for d, _ in pairs]
        self.foreach_srcs = [s for _, s in pairs]

    def fits(self, names, dsts):
        """Whether ``dsts`` are still the tensors this plan was made for, at the same addresses."""
        return (self.names == names and len(self.dsts) == len(dsts)
                and all(a is b for a, b in zip(self.dsts, dsts)) and self.ptrs == [t.data_ptr() for t in dsts])


class Subscriber:
    """A publication opened in this process, from the bytes of ``Publisher.message()``.

    The producer's tensors are mapped here (``tensors()``, zero copy) while the subscriber is open; ``install``
    copies each new version into this process's own tensors. ``stream`` (default: the device's current stream)
    is where the mapped memory is used; it is synchronized before the subscription lets go.
    """

    def __init__(self, payload, stream=None):
        import torch
        payload = bytes(payload)
        if len(payload) < _HEADER.size:
            raise WeightsError("tensormem weights: the payload is too short to be a Publisher.message()")
        magic, fmt, _, rust_len, layout_len = _HEADER.unpack_from(payload)
        if magic != _MAGIC or fmt != _FORMAT or len(payload) != _HEADER.size + rust_len + layout_len:
            raise WeightsError("tensormem weights: not a Publisher.message() of this tensormem_torch version; pass "
                               "its bytes unchanged, with the same tensormem_torch on both sides")
        rust = payload[_HEADER.size:_HEADER.size + rust_len]
        layout = json.loads(payload[_HEADER.size + rust_len:].decode())
        self.device = layout["device"]
        self._stream, raw = _raw_stream(torch, stream, self.device)
        lib = _library()
        handle = _P()
        _ok(lib.tensormem_weights_open(rust, len(rust), raw, ctypes.byref(handle)), "open")
        self._handle = handle.value
        try:
            count = ctypes.c_size_t()
            _ok(lib.tensormem_weights_sources(self._handle, 0, None, ctypes.byref(count)), "sources")
            ptrs = (ctypes.c_uint64 * count.value)()
            _ok(lib.tensormem_weights_sources(self._handle, count.value, ptrs, ctypes.byref(count)), "sources")
            entries = layout["tensors"]
            if len(entries) != count.value:
                raise WeightsError(f"tensormem weights: the payload names {len(entries)} tensors, its message "
                                   f"{count.value}; pass the bytes of one Publisher.message() unchanged")
            device = torch.device("cuda", self.device)
            self.names = [name for name, *_ in entries]
            self._sources = {name: _alias(torch, ptr, getattr(torch, dtype), shape, stride, device)
                             for (name, dtype, shape, stride), ptr in zip(entries, ptrs)}
        except BaseException:
            self.close()
            raise
        self._plans = {}
        self._side = None
        self.version = 0

    def _live(self):
        if self._handle is None:
            raise WeightsError("tensormem weights: the subscriber is closed")
        return self._handle

    def tensors(self):
        """The producer's tensors, by name, mapped here (zero copy; valid until ``close()``). Read them only
        between ``begin()`` and ``finish()`` (or inside ``install``), when no version is being written."""
        self._live()
        return dict(self._sources)

    def prepare(self, params, allow_unused=False):
        """Checks ``params`` (a mapping of names to this process's CUDA tensors, or (name, tensor) pairs) against
        the published tensors, by name, dtype, shape and strides, and plans the copies; the first ``install``
        with them does it. Raises WeightsError naming the tensors, before anything is written. ``allow_unused``:
        published tensors ``params`` has no name for are skipped instead of refused. Returns the number of
        copies a batched install makes."""
        names, dsts = _named(params)
        return self._plan(names, dsts, allow_unused).copies

    def _plan(self, names, dsts, allow_unused):
        key = (tuple(names), bool(allow_unused))
        plan = self._plans.get(key)
        if plan is not None and plan.fits(names, dsts):
            return plan
        for name, t in zip(names, dsts):
            if not getattr(t, "is_cuda", False):
                raise WeightsError(f"tensormem weights: {name!r} is not a CUDA tensor; install into CUDA tensors")
        described = _describe(names, dsts)
        plan_id, copies = ctypes.c_uint64(), ctypes.c_size_t()
        _ok(_library().tensormem_weights_prepare(self._live(), *described, 1 if allow_unused else 0,
                                                    ctypes.byref(plan_id), ctypes.byref(copies)), "prepare")
        plan = _Plan(list(names), list(dsts), plan_id.value, copies.value, self._sources)
        self._plans[key] = plan
        return plan

    def install(self, params, timeout=None, method="foreach", allow_unused=False, stream=None):
        """Waits for the next version (at most ``timeout`` seconds; None: no limit), copies it into ``params``
        (checked and planned on first use, see ``prepare``), synchronizes, and records it installed. Returns
        the version.

        ``method``: "foreach" (``torch._foreach_copy_`` on ``stream``, default the current stream) or "batched"
        (the library's planned copies, adjacent tensors merged, in one ``cuMemcpyBatchAsync`` where the driver
        has it; on a side stream ordered after ``stream`` when that is the legacy default stream, which the driver
        does not batch on)."""
        import torch
        if method not in ("foreach", "batched"):
            raise ValueError(f"method must be 'foreach' or 'batched', not {method!r}")
        names, dsts = _named(params)
        plan = self._plan(names, dsts, allow_unused)
        stream, raw = _raw_stream(torch, stream, self.device)
        lib, handle, version = _library(), self._live(), ctypes.c_uint64()
        if method == "batched":
            if not raw.value:
                # The driver batches copies on a created stream only: queue them on a side stream, after the
                # work queued so far on the legacy default stream (the host then waits for them).
                if self._side is None:
                    self._side = torch.cuda.Stream(self.device)
                self._side.wait_stream(stream)
                raw = _P(self._side.cuda_stream)
            _ok(lib.tensormem_weights_install(handle, plan.plan, raw, _ms(timeout), ctypes.byref(version)),
                   "install")
        else:
            _ok(lib.tensormem_weights_begin(handle, raw, _ms(timeout), ctypes.byref(version)), "install")
            with torch.no_grad(), torch.cuda.stream(stream):
                if plan.foreach_dsts:
                    torch._foreach_copy_(plan.foreach_dsts, plan.foreach_srcs)
            stream.synchronize()
            _ok(lib.tensormem_weights_finish(handle, version.value), "install")
        self.version = version.value
        return self.version

    def begin(self, timeout=None, stream=None):
        """Waits for the next version and orders ``stream`` (default: the current stream) after the producer's
        writes of it; read ``tensors()`` on that stream, wait for the reads, then ``finish(version)``. Returns
        the version."""
        import torch
        _, raw = _raw_stream(torch, stream, self.device)
        version = ctypes.c_uint64()
        _ok(_library().tensormem_weights_begin(self._live(), raw, _ms(timeout), ctypes.byref(version)), "begin")
        return version.value

    def finish(self, version):
        """Records ``version`` (from ``begin``) installed: the producer may write the weights again."""
        _ok(_library().tensormem_weights_finish(self._live(), version), "finish")
        self.version = max(self.version, version)

    def close(self):
        """Lets go of the publication: the mapped tensors (``tensors()``) must not be used after it."""
        handle, self._handle = getattr(self, "_handle", None), None
        self._sources, self._plans = {}, {}
        if handle is not None:
            _ok(_library().tensormem_weights_close_subscription(handle), "close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None and _LIB is not None:
            _LIB.tensormem_weights_close_subscription(handle)
