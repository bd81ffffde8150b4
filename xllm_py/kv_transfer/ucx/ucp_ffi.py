"""ctypes bindings to the few libucp calls that ucxx 0.52's Python API lacks.

ucxx's Python API sends one contiguous buffer per tag message. A KV pull moves many
slices (2 * num_layers per run of blocks), so without scatter-gather it costs either one
message per slice or a gather + scatter through staging buffers. UCP's iov datatype
(``ucp_dt_make_iov``) moves the whole list as ONE tag message, straight from the owner's
cache into the requester's cache. Measured with ucx_perftest (tag_bw, 2048 x 16 KiB iov
on both sides, posix/sysv): 4.3 - 5.5 GB/s, as fast as one contiguous 32 MB message.

The calls are made on a worker and endpoints created through ucxx (``.handle``) from the
single thread that progresses that worker (see ``iov_worker.py``): no UCP callbacks, so no
Python code ever runs inside ``ucp_worker_progress``; completion is polled with
``ucp_request_check_status`` after each progress.
"""
from __future__ import annotations

import ctypes

import numpy as np

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_CANCELED = -16
UCS_ERR_MESSAGE_TRUNCATED = -9
_UCS_ERR_LAST = -100

_FIELD_DATATYPE = 1 << 3
_FIELD_RECV_INFO = 1 << 7
_FIELD_MEMORY_TYPE = 1 << 6
_DATATYPE_IOV = 2
_CONTIG_BYTES = (1 << 3) | 0  # ucp_dt_make_contig(1)

FULL_MASK = (1 << 64) - 1


class TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


class RequestParam(ctypes.Structure):
    """ucp_request_param_t (ucp.h, UCX 1.21)."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class MemMapParams(ctypes.Structure):
    """ucp_mem_map_params_t (ucp.h, UCX 1.21)."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class MemAttr(ctypes.Structure):
    """ucp_mem_attr_t (ucp_def.h)."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("mem_type", ctypes.c_int)]


MEM_MAP_FIELD_LENGTH_FLAGS = (1 << 1) | (1 << 2)  # UCP_MEM_MAP_PARAM_FIELD_LENGTH | _FLAGS
MEM_MAP_ALLOCATE = 1 << 1
MEM_ATTR_ADDRESS_LENGTH = (1 << 0) | (1 << 1)


class UcpError(RuntimeError):
    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: {status_string(status)} ({status})")
        self.status = status


_lib: ctypes.CDLL | None = None


def _libucp_path() -> str:
    """The libucp that ucxx loaded (same handle: dlopen of a loaded path is refcounted)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libucp.so" in path:
                return path
    return "libucp.so.0"


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        import ucxx  # noqa: F401 - loads libucp

        path = _libucp_path()
        ucp = ctypes.CDLL(path)
        vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        for name, res, args in (
            ("ucp_tag_send_nbx", vp, [vp, vp, sz, u64, ctypes.POINTER(RequestParam)]),
            ("ucp_tag_recv_nbx", vp, [vp, vp, sz, u64, u64, ctypes.POINTER(RequestParam)]),
            ("ucp_tag_probe_nb", vp, [vp, u64, u64, ctypes.c_int, ctypes.POINTER(TagRecvInfo)]),
            ("ucp_tag_msg_recv_nbx", vp, [vp, vp, sz, vp, ctypes.POINTER(RequestParam)]),
            # ucs_status_t is a packed enum (UCS_S_PACKED): one signed byte, not an int
            ("ucp_request_check_status", ctypes.c_int8, [vp]),
            ("ucp_tag_recv_request_test", ctypes.c_int8, [vp, ctypes.POINTER(TagRecvInfo)]),
            ("ucp_request_cancel", None, [vp, vp]),
            ("ucp_request_free", None, [vp]),
            # memory mapping and remote keys (the mapped-pool path, shared_memory.py)
            ("ucp_mem_map", ctypes.c_int8, [vp, ctypes.POINTER(MemMapParams), ctypes.POINTER(vp)]),
            ("ucp_mem_unmap", ctypes.c_int8, [vp, vp]),
            ("ucp_mem_query", ctypes.c_int8, [vp, ctypes.POINTER(MemAttr)]),
            ("ucp_rkey_pack", ctypes.c_int8, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
            ("ucp_rkey_buffer_release", None, [vp]),
            ("ucp_ep_rkey_unpack", ctypes.c_int8, [vp, vp, ctypes.POINTER(vp)]),
            ("ucp_rkey_ptr", ctypes.c_int8, [vp, u64, ctypes.POINTER(vp)]),
            ("ucp_rkey_destroy", None, [vp]),
        ):
            fn = getattr(ucp, name)
            fn.restype = res
            fn.argtypes = args
        ucs = ctypes.CDLL(path.replace("libucp", "libucs"))
        ucs.ucs_status_string.restype = ctypes.c_char_p
        ucs.ucs_status_string.argtypes = [ctypes.c_int]
        ucp.ucs_status_string = ucs.ucs_status_string
        _lib = ucp
    return _lib


def status_string(status: int) -> str:
    try:
        return lib().ucs_status_string(status).decode()
    except Exception:  # noqa: BLE001
        return "UCS status"


def _ptr_status(ptr: int | None) -> tuple[int, int | None]:
    """(status, request) from a ucs_status_ptr_t: NULL = done, small negative = error."""
    if not ptr:
        return UCS_OK, None
    if ptr >= (1 << 64) + _UCS_ERR_LAST:  # error codes are encoded as (uintptr_t)status
        return ptr - (1 << 64), None
    return UCS_INPROGRESS, ptr


def iov_array(chunks: np.ndarray) -> np.ndarray:
    """A ucp_dt_iov_t array: uint64 [n, 2] of (address, length), C-contiguous."""
    arr = np.ascontiguousarray(chunks, dtype=np.uint64).reshape(-1, 2)
    return arr


class Op:
    """One posted UCP request, polled for completion. Keeps its buffers alive until done."""

    __slots__ = ("req", "status", "keep", "info", "expected", "what", "tag")

    def __init__(self, what: str, ptr: int | None, keep: object, info: TagRecvInfo | None = None,
                 expected: int | None = None, tag: int | None = None) -> None:
        self.what = what
        self.tag = tag  # a tag receive's tag (full mask); None for sends
        self.status, self.req = _ptr_status(ptr)
        self.keep = keep
        self.info = info
        self.expected = expected
        if self.status == UCS_OK:
            self._check_length()

    def _check_length(self) -> None:
        if self.expected is not None and self.info is not None and self.info.length != self.expected:
            self.status = UCS_ERR_MESSAGE_TRUNCATED  # a short message is as bad as a long one

    @property
    def done(self) -> bool:
        return self.status != UCS_INPROGRESS

    def poll(self) -> bool:
        if self.req is None:
            return True
        ucp = lib()
        if self.info is not None:
            st = ucp.ucp_tag_recv_request_test(self.req, ctypes.byref(self.info))
        else:
            st = ucp.ucp_request_check_status(self.req)
        if st == UCS_INPROGRESS:
            return False
        self.status = st
        ucp.ucp_request_free(self.req)
        self.req = None
        if st == UCS_OK:
            self._check_length()
        return True

    def cancel(self, worker: int) -> None:
        if self.req is not None:
            lib().ucp_request_cancel(worker, self.req)


def _param(datatype: int, info: TagRecvInfo | None = None) -> RequestParam:
    p = RequestParam()
    p.op_attr_mask = _FIELD_DATATYPE | (_FIELD_RECV_INFO if info is not None else 0) | _FIELD_MEMORY_TYPE
    p.datatype = datatype
    p.memory_type = 0  # UCS_MEMORY_TYPE_HOST: no memory type detection per buffer
    if info is not None:
        p.recv_info = ctypes.addressof(info)
    return p


def tag_send_iov(ep: int, chunks: np.ndarray, tag: int, keep: object = None) -> Op:
    """One tag message gathered from ``chunks`` (uint64 [n, 2]: address, length)."""
    iov = iov_array(chunks)
    p = _param(_DATATYPE_IOV)
    ptr = lib().ucp_tag_send_nbx(ep, iov.ctypes.data, iov.shape[0], tag, ctypes.byref(p))
    return Op("data send", ptr, (iov, keep))


def tag_recv_iov(worker: int, chunks: np.ndarray, tag: int, keep: object = None,
                 expected: int | None = None) -> Op:
    """Receive one tag message scattered into ``chunks``; anything but exactly their total size
    (``expected``, when the caller knows it) fails."""
    iov = iov_array(chunks)
    info = TagRecvInfo()
    p = _param(_DATATYPE_IOV, info)
    ptr = lib().ucp_tag_recv_nbx(worker, iov.ctypes.data, iov.shape[0], tag, FULL_MASK, ctypes.byref(p))
    return Op("data receive", ptr, (iov, keep), info, int(iov[:, 1].sum()) if expected is None else expected, tag)


def tag_send_bytes(ep: int, data: bytes, tag: int) -> Op:
    buf = ctypes.create_string_buffer(data, len(data))
    p = _param(_CONTIG_BYTES)
    ptr = lib().ucp_tag_send_nbx(ep, ctypes.addressof(buf), len(data), tag, ctypes.byref(p))
    return Op("message send", ptr, buf)


def tag_recv_bytes(worker: int, size: int, tag: int) -> tuple[Op, ctypes.Array]:
    buf = ctypes.create_string_buffer(size)
    info = TagRecvInfo()
    p = _param(_CONTIG_BYTES, info)
    ptr = lib().ucp_tag_recv_nbx(worker, ctypes.addressof(buf), size, tag, FULL_MASK, ctypes.byref(p))
    op = Op("message receive", ptr, buf, info, tag=tag)
    return op, buf


def tag_recv_drain(worker: int, buf: ctypes.Array, tag: int) -> Op:
    """Receive the message tagged ``tag`` into ``buf`` (small) only to consume it: a larger
    message completes the receive with UCS_ERR_MESSAGE_TRUNCATED and UCX drops its data
    (eager fragments are released, a rendezvous is acknowledged without being fetched)."""
    info = TagRecvInfo()
    p = _param(_CONTIG_BYTES, info)
    ptr = lib().ucp_tag_recv_nbx(worker, ctypes.addressof(buf), len(buf), tag, FULL_MASK, ctypes.byref(p))
    return Op("drain receive", ptr, buf, info, tag=tag)


def probe_recv(worker: int, tag: int, mask: int) -> tuple[Op, ctypes.Array, int, int] | None:
    """Receive the next message whose tag matches (tag, mask), whatever its size; None when there is none."""
    ucp = lib()
    info = TagRecvInfo()
    msg = ucp.ucp_tag_probe_nb(worker, tag, mask, 1, ctypes.byref(info))
    if not msg:
        return None
    buf = ctypes.create_string_buffer(max(info.length, 1))
    p = _param(_CONTIG_BYTES)
    ptr = ucp.ucp_tag_msg_recv_nbx(worker, ctypes.addressof(buf), info.length, msg, ctypes.byref(p))
    return Op("request receive", ptr, buf), buf, info.sender_tag, info.length
