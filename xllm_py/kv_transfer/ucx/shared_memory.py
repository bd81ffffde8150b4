"""KV pools a peer on the same host can map: a pull is then one memcpy, not two.

The iov message path (``iov_protocol.py``) moves a pull through UCX's shared-memory FIFO:
the owner copies its slices in, the puller copies them out (two copies, both processes
busy). Here the host pool itself is allocated by UCX (``ucp_mem_map`` with ALLOCATE: UCX
picks its first allocator that works, System V shared memory on Linux), its remote key
goes to the peer at link time, and the peer maps the whole pool into its own address
space with ``ucp_ep_rkey_unpack`` + ``ucp_rkey_ptr`` (what UCX's own rendezvous
``rkey_ptr`` protocol does). A pull or push is then a list of memcpys between the two
pools, on the requester alone; the owner's part is to keep the blocks (the PD flow holds
them until decode confirms).

Where it does not apply, nothing changes: a pool UCX could not allocate as shared memory
(``rkey_ptr`` answers UNREACHABLE), peers in different IPC namespaces or on other hosts,
CUDA pools, ``XLLM_UCX_MAP=0`` (``UCXConfig.map_peer_pools``): transfers take the iov message path.

memcpy from a mapped System V segment runs at plain memcpy speed only when both pools sit
at the same offset in a page (at different offsets, e.g. 0 and 64, it runs at a fraction
of it). Both sides allocate here, at ``POOL_OFFSET`` (the offset torch's allocator gives a large tensor,
which also suits the iov path when a mapping is not possible).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Any, Callable

import numpy as np
import torch

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.kv_storage import prefault_pages
from xllm_py.kv_transfer.ucx import ucp_ffi as ffi

logger = logging.getLogger(__name__)

POOL_OFFSET = 64  # bytes into the first page; see the module docstring
_PAGE = 4096

_contexts: dict[tuple, Any] = {}
_ctx_lock = threading.Lock()
_shared: "weakref.WeakValueDictionary[int, SharedHostMemory]" = weakref.WeakValueDictionary()


def mapping_enabled(config: UCXConfig | None = None) -> bool:
    """Whether pools are allocated mappable and peers' pools mapped (None: from the environment)."""
    return (config if config is not None else UCXConfig.from_env()).map_peer_pools


def host_context(config: dict[str, str]) -> Any:
    """One UCP context per config per process, shared by the IovWorkers and the pool
    allocations: a remote key is unpacked against the memory domains of the context that
    packed it, so pools and workers must agree."""
    key = tuple(sorted(config.items()))
    with _ctx_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            import ucxx._lib.libucxx as ucxx_lib

            f = ucxx_lib.Feature
            ctx = ucxx_lib.UCXContext(config, feature_flags=(f.TAG, f.WAKEUP, f.RMA))
            _contexts[key] = ctx
        return ctx


class SharedHostMemory:
    """``nbytes`` of host memory allocated by UCX on the host context, zero-filled, with the
    packed remote key a peer needs to map it. ``tensor()`` is a uint8 view of it; the memory
    is unmapped when the last view of such a tensor is gone (views hold the ctypes array,
    the array holds this object)."""

    def __init__(self, nbytes: int, config: dict[str, str]) -> None:
        ucp = ffi.lib()
        self._ctx = host_context(config)
        p = ffi.MemMapParams()
        p.field_mask = ffi.MEM_MAP_FIELD_LENGTH_FLAGS
        p.length = nbytes + POOL_OFFSET + _PAGE
        p.flags = ffi.MEM_MAP_ALLOCATE
        memh = ctypes.c_void_p()
        st = ucp.ucp_mem_map(self._ctx.handle, ctypes.byref(p), ctypes.byref(memh))
        if st != ffi.UCS_OK:
            raise ffi.UcpError("ucp_mem_map (allocate)", st)
        try:
            attr = ffi.MemAttr()
            attr.field_mask = ffi.MEM_ATTR_ADDRESS_LENGTH
            st = ucp.ucp_mem_query(memh, ctypes.byref(attr))
            if st != ffi.UCS_OK:
                raise ffi.UcpError("ucp_mem_query", st)
            buf, size = ctypes.c_void_p(), ctypes.c_size_t()
            st = ucp.ucp_rkey_pack(self._ctx.handle, memh, ctypes.byref(buf), ctypes.byref(size))
            if st != ffi.UCS_OK:
                raise ffi.UcpError("ucp_rkey_pack", st)
        except BaseException:
            ucp.ucp_mem_unmap(self._ctx.handle, memh)
            raise
        self.rkey = ctypes.string_at(buf, size.value)
        ucp.ucp_rkey_buffer_release(buf)
        self.base = int(attr.address)  # what the remote key covers (the peer maps from here)
        self.address = self.base + (-self.base % _PAGE) + POOL_OFFSET  # where the pool starts
        self.nbytes = nbytes
        self._arr = (ctypes.c_uint8 * nbytes).from_address(self.address)
        prefault_pages(self.address, nbytes)  # (as torch.zeros would: no page faults in the first steps)
        self._finalizer = weakref.finalize(self, ucp.ucp_mem_unmap, self._ctx.handle, memh)
        _shared[self.address] = self

    def tensor(self) -> torch.Tensor:
        arr, self._arr = self._arr, None  # (once: the array and its views own us from now on)
        if arr is None:
            raise RuntimeError("SharedHostMemory.tensor() is called once")
        arr.owner = self
        return torch.frombuffer(arr, dtype=torch.uint8)

    def export(self) -> dict:
        """What a peer needs to map the pool: goes into the link hello."""
        return {"rkey": self.rkey.hex(), "base": self.base, "offset": self.address - self.base,
                "nbytes": self.nbytes}


def allocate(nbytes: int, config: dict[str, str]) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` that peers can map (``lookup`` finds its key)."""
    return SharedHostMemory(nbytes, config).tensor()


def lookup(address: int) -> SharedHostMemory | None:
    """The shared allocation whose pool starts at ``address`` (a KV storage's data_ptr)."""
    return _shared.get(address)


class RemotePool:
    """A peer's pool mapped into this process. ``acquire`` / ``release`` bracket every copy;
    ``close`` (on the IovWorker thread) releases the remote key (which unmaps the pool) once
    no copy uses it any more: a copy never reads unmapped memory."""

    def __init__(self, rkey: int, address: int, nbytes: int, destroy_later: Callable[[Callable[[], None]], None]) -> None:
        self._rkey = rkey
        self.address = address
        self.nbytes = nbytes
        self._destroy_later = destroy_later
        self._lock = threading.Lock()
        self._refs = 0
        self._closed = False

    @classmethod
    def map(cls, ep: int, export: dict, destroy_later: Callable[[Callable[[], None]], None]) -> "RemotePool":
        """On the IovWorker thread: unpack the peer's key on our endpoint to it and map the
        pool; raises UcpError when this process cannot map it (UNREACHABLE: not shared
        memory, another host or IPC namespace)."""
        ucp = ffi.lib()
        rkey = ctypes.c_void_p()
        key_bytes = bytes.fromhex(export["rkey"])
        st = ucp.ucp_ep_rkey_unpack(ep, key_bytes, ctypes.byref(rkey))
        if st != ffi.UCS_OK:
            raise ffi.UcpError("ucp_ep_rkey_unpack", st)
        base, offset, nbytes = int(export["base"]), int(export["offset"]), int(export["nbytes"])
        ptrs = []
        for raddr in (base + offset, base + offset + nbytes - 1):  # both ends of the pool
            local = ctypes.c_void_p()
            st = ucp.ucp_rkey_ptr(rkey, raddr, ctypes.byref(local))
            if st != ffi.UCS_OK:
                ucp.ucp_rkey_destroy(rkey)
                raise ffi.UcpError("ucp_rkey_ptr", st)
            ptrs.append(int(local.value or 0))
        if ptrs[1] - ptrs[0] != nbytes - 1:  # one mapping, not pieces
            ucp.ucp_rkey_destroy(rkey)
            raise ffi.UcpError("ucp_rkey_ptr (pool not mapped in one piece)", -1)
        return cls(rkey.value, ptrs[0], nbytes, destroy_later)

    def acquire(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._closed and self._refs == 0
        if last:
            self._destroy_later(self._destroy)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._refs == 0
        if idle:
            self._destroy()

    def _destroy(self) -> None:
        if self._rkey:
            ffi.lib().ucp_rkey_destroy(self._rkey)
            self._rkey = 0


def copy_chunks(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy ``src[i]`` -> ``dst[i]`` for (address, length) rows (uint64 [n, 2], equal lengths)."""
    from xllm_py.model import cpu_kernels

    if not cpu_kernels.copy_chunks(dst, src):
        for (d, n), (s, _) in zip(dst.tolist(), src.tolist()):
            ctypes.memmove(d, s, n)
