"""Configuration dataclasses. The CLI builds these; components take the sub-config they use.

Environment variables are read here only (the `*_from_env` functions).
Nothing in this module touches disk, torch or gRPC.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from typing import TYPE_CHECKING

from xllm_py.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # the paths only; config imports no grpc
    from xllm_py.tls import EtcdTLSConfig, TLSConfig


class InstanceRole(str, enum.Enum):
    DEFAULT = "DEFAULT"
    MIX = "MIX"
    PREFILL = "PREFILL"
    DECODE = "DECODE"

    @classmethod
    def parse(cls, value: str) -> "InstanceRole":
        try:
            return cls(value.upper())
        except ValueError:
            raise ValueError(
                f"unknown instance role {value!r}; expected one of {[r.value for r in cls]}"
            ) from None


class KVTransferMode(str, enum.Enum):
    PULL = "PULL"
    PUSH = "PUSH"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: sized at start-up from kv_cache_memory_bytes, else from the memory there is
    # (engine/model_setup.py kv_pool_bytes).
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The KV tiers below the pool (xllm_py/kv_tiers/, engine/kv_tiering.py)."""
    # Host-memory tier: None sizes it from the machine (kv_tiering_setup.py), 0 turns it off.
    host_bytes: int | None = None
    # Disk tier: a directory (None: $XLLM_KV_TIER_DIR, else ~/.cache/xllm_py/kv_tiers) and its bound (None:
    # from the free space there, 0: off).
    disk_dir: str | None = None
    disk_bytes: int | None = None
    # The shared Mooncake Store: its master HOST:PORT (None: off); its metadata service
    # (None: the cluster's etcd); memory this engine contributes to the store's pool.
    store: str | None = None
    store_metadata: str | None = None
    store_segment_bytes: int = 0
    store_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if self.store_segment_bytes < 0 or self.store_timeout_s <= 0:
            raise ValueError("store_segment_bytes must be >= 0 and store_timeout_s > 0")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Per-step token budget shared by prefill chunks and decode tokens.
    max_num_batched_tokens: int = 2048
    # Prompt tokens per step while sequences are decoding (0: the whole budget): bounds the
    # stall a prompt chunk puts on the running streams (a step's time, so their TPOT).
    max_prefill_tokens_while_decoding: int = 0
    # Prompt tokens beside decoding streams only while every stream's mean time per output
    # token is predicted to stay within this (engine/tpot_guard.py; 0: off); a prompt held
    # back longer than prompt_hold_max_ms goes anyway.
    prompt_tpot_target_ms: float = 0.0
    prompt_hold_max_ms: float = 1000.0
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Those above left to the latency profile (engine/self_profile.py `apply_derived`).
    from_profile: frozenset[str] = frozenset()
    # Work arriving at an idle engine: keep taking requests that come in less than
    # llm_engine.BURST_GAP_S apart, for up to this long (or until a step's budget is waiting), so a
    # burst starts as one batch. 0: start at once.
    batch_window_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.prompt_tpot_target_ms < 0 or self.prompt_hold_max_ms < 0:
            raise ValueError("prompt_tpot_target_ms and prompt_hold_max_ms must be >= 0")
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 0, got "
                             f"{self.max_prefill_tokens_while_decoding}")


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    mode: KVTransferMode = KVTransferMode.PULL
    backend: str = "ucx"  # "ucx" | "tcp" | "fake"
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    timeout_s: float = 30.0
    # PUSH: prompts of at least this many tokens stream their computed chunks' blocks to
    # the decode during the prefill (engine/pd/kv_stream.py; 0: never); below, the gain
    # after the first token is lost in TTFT's noise (benchmarks/kv_stream_handover.py).
    stream_min_tokens: int = 1024
    # The ucx backend's settings; None: UCXConfig.from_env() when the backend is built.
    ucx: UCXConfig | None = None


def _env_on(name: str) -> bool:
    """A switch that is on unless set to 0 / false / no / off."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class UCXConfig:
    """The UCX KV transfer backend (xllm_py/kv_transfer/ucx/): which data paths it may take
    and their tuning knobs, each with the measurement that chose it (2-core VM)."""

    # XLLM_UCX_MAP=0: never map a same-host peer's KV pool (ucx/shared_memory.py); transfers
    # with it then take the iov message path.
    map_peer_pools: bool = True
    # XLLM_UCX_IOV_<NAME>=value: overrides of the iov data path's UCP context settings
    # (ucx/env.py UCX_IOV_DEFAULTS; UCX names without the UCX_ prefix), in (name, value) pairs.
    iov_overrides: tuple[tuple[str, str], ...] = ()
    # UCXPY_PROGRESS_MODE / UCXPY_ENABLE_PYTHON_FUTURE: how ucxx is initialised. Futures
    # completed by ucxx's notifier thread: the yield-polling loop would steal the CPU the
    # transfer needs (ucx/env.py).
    progress_mode: str = "thread"
    python_future: bool = True
    # Tag path (CUDA pools, modes direct/gather): ``direct`` (zero-copy, one message per slice)
    # only for at most this many messages of at least this average slice size, else ``gather``
    # (ucx/path_tag.py TagPath.choose_mode: a message's fixed cost dominates small slices).
    direct_max_msgs: int = 1024
    direct_min_slice_bytes: int = 256 << 10
    # Mapped-pool transfers up to this size are copied on the caller's thread (~0.1 ms at
    # 10 GB/s; a hop to the copy thread and back costs ~0.1 - 0.2 ms here).
    inline_copy_bytes: int = 1 << 20
    # Right after linking (iov path), this many pulls of about warmup_bytes of the peer's
    # blocks into a scratch buffer (half one run, half one run per block): the first pulls
    # over a new link cost 2 - 7 ms for 1 MB instead of ~0.5 (first touch of the shared-memory
    # FIFO and receive buffers on both sides, UCX protocol selection per iov shape, cold
    # Python paths), and it takes about ten to settle. The warm-up costs 10 - 40 ms.
    warmup_pulls: int = 12
    warmup_bytes: int = 1 << 20
    warmup_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.direct_max_msgs <= 0 or self.direct_min_slice_bytes < 0:
            raise ValueError("direct_max_msgs must be positive and direct_min_slice_bytes >= 0")
        if self.inline_copy_bytes < 0 or self.warmup_pulls < 0 or self.warmup_bytes <= 0:
            raise ValueError("inline_copy_bytes and warmup_pulls must be >= 0, warmup_bytes positive")

    @classmethod
    def from_env(cls, **overrides: object) -> "UCXConfig":
        """The settings above from XLLM_UCX_MAP, XLLM_UCX_IOV_*, UCXPY_PROGRESS_MODE and
        UCXPY_ENABLE_PYTHON_FUTURE; ``overrides`` set other fields."""
        env = os.environ
        return cls(map_peer_pools=_env_on("XLLM_UCX_MAP"),
                   iov_overrides=tuple((k.removeprefix("XLLM_UCX_IOV_"), v) for k, v in env.items()
                                       if k.startswith("XLLM_UCX_IOV_")),
                   progress_mode=env.get("UCXPY_PROGRESS_MODE", "thread"),
                   python_future=env.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0",
                   **overrides)  # type: ignore[arg-type]


def env_with_prefix(*prefixes: str) -> dict[str, str]:
    """The environment variables whose names start with one of ``prefixes`` (e.g. UCX's own)."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``: what a child process is started with."""
    return {**os.environ, **overrides}


def apply_env_defaults(defaults: dict[str, str]) -> None:
    """For libraries that read their settings from the environment only (UCX, at init): set
    each variable that is not set already (one the user set wins)."""
    for k, v in defaults.items():
        os.environ.setdefault(k, v)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The native CPU kernels (xllm_py/model/cpu_kernels.py)."""

    enabled: bool = True  # XLLM_CPU_KERNELS=0: the torch path everywhere
    cache_dir: str | None = None  # XLLM_KERNEL_CACHE (None: ~/.cache/xllm_py/kernels)
    cc: str | None = None  # CC (None: cc, else gcc, on PATH)
    # XLLM_CPU_ISA: "avx2" builds the AVX2/FMA kernels even where the CPU has AVX-512 (to
    # compare or test both), "avx512" asks for the AVX-512 ones; None (unset, "auto"): the
    # widest the CPU has (/proc/cpuinfo), also what a request past it gets
    isa: str | None = None

    def __post_init__(self) -> None:
        if self.isa not in (None, "avx2", "avx512"):
            raise ValueError(f"XLLM_CPU_ISA must be avx2, avx512 or auto, got {self.isa!r}")

    @classmethod
    def from_env(cls) -> "KernelConfig":
        isa = (os.environ.get("XLLM_CPU_ISA") or "auto").strip().lower()
        return cls(enabled=_env_on("XLLM_CPU_KERNELS"), cache_dir=os.environ.get("XLLM_KERNEL_CACHE") or None,
                   cc=os.environ.get("CC") or None, isa=None if isa == "auto" else isa)


def model_cache_dir_from_env() -> str | None:
    """XLLM_CACHE_DIR: where tiny models are built (None: ~/.cache/xllm_py/models)."""
    return os.environ.get("XLLM_CACHE_DIR") or None


def kv_tier_dir_from_env() -> str | None:
    """XLLM_KV_TIER_DIR: where the disk KV tiers live unless kv_disk_tier_dir says (None:
    ~/.cache/xllm_py/kv_tiers); one directory per model and layout under it; {pid} in it:
    one per process (engines that must not share blocks on disk, e.g. a test suite's)."""
    return os.environ.get("XLLM_KV_TIER_DIR") or None


@dataclasses.dataclass(frozen=True)
class APILimits:
    """Work one OpenAI HTTP server takes (engine's own API and the service).

    A body over `max_body_bytes` is refused with 413 before it is read whole. Beyond
    `max_pending_requests` HTTP requests, or `max_pending_tokens` prompt tokens x
    sequences, admitted and not finished yet (waiting or running), a new request gets 429
    with `Retry-After: retry_after_s`. Defaults: 8 MiB is ~100x the longest prompt of a
    32k-token context as JSON token ids; 1024 requests and 2M tokens are far above what
    one engine runs at once (max_num_seqs 128) and keep a flood from queueing unbounded.
    """
    max_body_bytes: int = 8 << 20
    max_pending_requests: int = 1024
    max_pending_tokens: int = 2 << 20
    retry_after_s: int = 1
    # vLLM's --trust-request-chat-template: a request's own chat_template is rendered only
    # then (a template is code: a sandboxed one can still loop for long).
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pending_requests", "max_pending_tokens",
                     "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """Who may call a process (xllm_py.api.auth, xllm_py.tls): API keys on its OpenAI HTTP
    API, the cluster TLS identity of its gRPC servers and channels, and how it reaches etcd."""
    # Accepted `Authorization: Bearer` keys; empty: the HTTP API is open. Never logged.
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    # /metrics needs a key too (default: open, like /health and /readiness).
    protect_metrics: bool = False
    # xllm_py.tls.TLSConfig (cert, key, CA paths), or None: plaintext gRPC.
    tls: TLSConfig | None = None
    # xllm_py.tls.EtcdTLSConfig (--etcd-cacert/--etcd-cert/--etcd-key), or None: plaintext
    # etcd. Separate from `tls`: etcd often has a CA of its own, or none.
    etcd_tls: EtcdTLSConfig | None = None


PREFILL_ORDERS = ("fcfs", "deadline")  # (cluster/prefill_order.py ORDERS)


@dataclasses.dataclass(frozen=True)
class PDSchedulerConfig:
    """The PD scheduler's own settings (engine/pd/; settings-file keys pd_<name>)."""
    # Prefill: AddNewRequests tries per decode while it answers "no KV space", with
    # doubling backoff (8 tries: ~4.5 s) before another decode is tried.
    attempts_per_decode: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    # Prefill: decodes tried per request (the service's choice, then the master's list).
    max_decodes_per_request: int = 3
    # Prefill: requests finding a decode at the same time.
    max_dispatching: int = 64
    # Prefill: a queued request is placed on a decode (its blocks set aside there) only
    # while the prompts placed and not handed over yet hold fewer tokens (0: no limit):
    # under a long queue, decode KV is not held by prompts waiting here.
    max_placed_prompt_tokens: int = 4096
    # Prefill: which queued request is placed next (cluster/prefill_order.py).
    prefill_order: str = "deadline"
    # Prefill: how often it links the decodes it has not linked yet (prelink_once).
    prelink_interval_s: float = 2.0
    # Decode: a request whose FirstGeneration never comes is freed after this.
    orphan_timeout_s: float = 60.0
    reap_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if min(self.attempts_per_decode, self.max_decodes_per_request, self.max_dispatching) < 1:
            raise ValueError("attempts_per_decode, max_decodes_per_request and "
                             "max_dispatching must be >= 1")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, "
                             f"got {self.prefill_order!r}")
        if self.max_placed_prompt_tokens < 0:
            raise ValueError("max_placed_prompt_tokens must be >= 0")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = "gemma-3-270m"  # xllm_py.model.catalog.DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    role: InstanceRole = InstanceRole.MIX
    host: str = "127.0.0.1"
    # Address peers use to reach this instance (default: host). Needed when binding
    # 0.0.0.0 / :: (containers, pods): a wildcard is never advertised.
    advertise_host: str | None = None
    port: int = 9000
    served_model_name: str | None = None
    seed: int = 0
    # CPU compute: torch intra-op threads (None: torch's default, one per core) and
    # oneDNN pre-packed linear weights (xllm_py/model/packed.py).
    num_threads: int | None = None
    pack_weights: bool = True
    # Packed CPU linear weights: "auto" keeps a weight in bfloat16 when every value is one
    # (a bf16 checkpoint: half the bytes per decode step, float32 math, same results),
    # else float32; "float32" / "bfloat16" force it (bfloat16 rounds).
    weight_dtype: str = "auto"
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    tiers: TierConfig = dataclasses.field(default_factory=TierConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    pd: PDSchedulerConfig = dataclasses.field(default_factory=PDSchedulerConfig)
    # Cluster
    etcd_addr: str | None = None
    etcd_namespace: str = ""
    etcd_ttl_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    instance_name: str | None = None
    disagg_pd_port: int = 0
    worker_port: int = 0
    rpc_timeout_s: float = 10.0
    # SIGTERM: stop taking requests and finish the ones in flight for up to this long
    # before leaving the cluster (0: leave at once). A second signal cuts it short.
    drain_timeout_s: float = 30.0
    # Step-cost profile (JSON, xllm_py.cluster.latency_profile) registered for SLO_AWARE
    # routing; None: measured at start-up (engine/self_profile.py); "off": none.
    latency_profile_path: str | None = None
    # A time-model profile (JSON, xllm_py/sim/profile.py): run the simulated engine, whose
    # forward is a sleep of the modelled step time (no torch), instead of the model.
    simulate: str | None = None
    # One JSON line per step to this file (xllm_py/engine/step_trace.py); None: off.
    step_trace: str | None = None
    api: APILimits = dataclasses.field(default_factory=APILimits)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    # Tensor parallelism (xllm_py/parallel/): ranks of this instance, and the bound on one
    # collective of a step (a rank that hangs fails the instance after this long).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 30.0
    # Pipeline parallelism (parallel/pipeline.py): stages of this instance, each a process
    # with a contiguous range of the layers; their layer counts (None: an even split).
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    # Speculative decoding of greedy sequences (engine/spec_decode/); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The address to publish: advertise_host, else host unless it is a wildcard."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostname()
    return host


def etcd_credentials_from_env() -> tuple[str, str] | None:
    """ETCD_USERNAME / ETCD_PASSWORD: both or neither."""
    user = os.environ.get("ETCD_USERNAME")
    password = os.environ.get("ETCD_PASSWORD")
    if bool(user) != bool(password):
        raise ValueError("set both ETCD_USERNAME and ETCD_PASSWORD, or neither")
    return (user, password) if user else None
