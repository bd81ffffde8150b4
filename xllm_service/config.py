"""The master's configuration (`python -m xllm_service`): the service itself, its view of
the instances, its routing and its requests to the engines. Built by xllm_service.cli only;
components take the sub-config they use. The engines' configuration is xllm_py/config.py,
which this module shares the API limits and security settings of (no torch, no gRPC).
"""
from __future__ import annotations

import dataclasses
import os

from xllm_py.api.response_store import ResponseStoreLimits
from xllm_py.config import APILimits, SecurityConfig

@dataclasses.dataclass(frozen=True)
class RegistryConfig:
    """The service's view of the instances (xllm_service.registry)."""
    # A dead instance stays SUSPECT (not schedulable) this long before it is evicted.
    evict_grace_s: float = 3.0
    # Instances whose etcd key is gone are probed on /health this often, with this deadline.
    health_interval_s: float = 0.25
    health_timeout_s: float = 0.5
    # How often the watch is checked against the store (replaced etcd, missed events).
    identity_check_s: float = 1.0
    # Waits before successive re-syncs after the watch broke (the last one repeats).
    resync_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0)

    def __post_init__(self) -> None:
        if self.evict_grace_s < 0:
            raise ValueError(f"evict_grace_s must be >= 0, got {self.evict_grace_s}")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health_interval_s and health_timeout_s must be > 0")
        if not self.resync_backoff_s:
            raise ValueError("resync_backoff_s must not be empty")


POLICIES = ("RR", "ROUND_ROBIN", "LEAST_LOAD", "LL", "CACHE_AWARE", "PREFIX", "SLO_AWARE")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How the service picks instances (xllm_service.router, xllm_service.pd_decision)."""
    # RR, LEAST_LOAD, CACHE_AWARE or SLO_AWARE (see `xllm_service.router.make_policy`).
    load_balance_policy: str = "SLO_AWARE"
    # LEAST_LOAD's load: in flight here + waiting + kv_usage_weight * KV usage (0..1).
    kv_usage_weight: float = 4.0
    # CACHE_AWARE: only instances whose load is within this of the least loaded compete on
    # cached prefix length.
    max_imbalance: float = 4.0
    # Over prefill and decode instances: ALWAYS (every prompt on a prefill instance) or
    # CONDITIONAL (per request, pd_decision.py); None: CONDITIONAL with SLO_AWARE, else
    # ALWAYS.
    disagg_decision: str | None = None
    # CONDITIONAL: a prompt with at most this many tokens not in the decode's prefix cache
    # is prefilled on the decode itself.
    local_prefill_max_tokens: int = 256
    # CONDITIONAL without profiles: longer prompts go to the decode too while the least
    # busy prefill has this many prompt tokens queued (0: never; SLO_AWARE: never).
    prefill_busy_tokens: int = 4096
    # SLO_AWARE: PD's TTFT on top of the prefill (KV pull, hand-over RPCs): an estimate, as
    # the engines report no hand-over times (the prefill only logs them).
    pd_overhead_ms: float = 20.0
    # SLO_AWARE: targets of a request that sets none; None: from the profiles; 0: none.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if self.load_balance_policy.upper() not in POLICIES:
            raise ValueError(f"unknown load balance policy {self.load_balance_policy!r}; "
                             "expected RR, LEAST_LOAD, CACHE_AWARE or SLO_AWARE")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        if self.disagg_decision is not None and self.disagg_decision.upper() not in (
                "ALWAYS", "CONDITIONAL"):
            raise ValueError(f"disagg_decision must be ALWAYS or CONDITIONAL, got "
                             f"{self.disagg_decision!r}")
        for name in ("local_prefill_max_tokens", "prefill_busy_tokens", "pd_overhead_ms",
                     "ttft_slo_ms", "tpot_slo_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def slo_aware(self) -> bool:
        return self.load_balance_policy.upper() == "SLO_AWARE"

    @property
    def conditional(self) -> bool:
        """Whether the path (PD or prefill on the decode) is decided per request."""
        if self.disagg_decision is None:
            return self.slo_aware
        return self.disagg_decision.upper() == "CONDITIONAL"


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Elastic prefill/decode (elastic_policy.py): the master's role decisions."""
    enabled: bool = False        # --elastic-pd on|off
    interval_s: float = 1.0      # a decision round
    margin: float = 0.05         # the better split's attainment: at least 1 + this times
    hold_s: float = 5.0          # ... in every round for this long
    min_dwell_s: float = 30.0    # between two flips of one instance
    warmup_s: float = 5.0        # an instance this young, a master this new: no evidence
    min_samples: int = 20        # requests in the demand window before a flip
    max_step: int = 4            # instances moved in one round
    utilization: float = 0.85    # of a side's capacity within its target, what it plans on
    # Of the fleet, the least share on each side: when the load turns, what arrives before
    # the split follows lands there, and a flood on a few decodes leaves streams that
    # miss TPOT to their end (they cannot move).
    min_share: float = 0.25
    window_s: float = 10.0       # the demand window

    def __post_init__(self) -> None:
        checks = ((0.0 < self.utilization <= 1.0, "utilization must be in (0, 1]"),
                  (self.max_step >= 1, "max_step must be >= 1"),
                  (0.0 <= self.min_share < 0.5, "min_share must be in [0, 0.5)"),
                  (min(self.hold_s, self.min_dwell_s, self.margin) >= 0,
                   "hold_s, min_dwell_s and margin must be >= 0"))
        for ok, why in checks:
            if not ok:
                raise ValueError(f"elastic: {why}")


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """The service's requests to the engines (xllm_service.backend)."""
    # Deadline of Generate and MultiGenerations.
    rpc_timeout_s: float = 5.0
    # Deadline of the Cancel sent when a client goes away (best effort).
    cancel_timeout_s: float = 1.0
    # A request whose engine sends nothing for this long fails with 504.
    idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("rpc_timeout_s", "cancel_timeout_s", "idle_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """The master process (`python -m xllm_service`); built by xllm_service.cli."""
    etcd_addr: str = "127.0.0.1:2379"
    etcd_namespace: str = ""
    # Lease TTL of the service's keys (its address, the master key, proxy registrations).
    etcd_ttl_s: float = 3.0
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    http_port: int = 8888
    rpc_port: int = 8889
    # Model directory (tokenizer, chat template, config), .gguf file or name (catalog.py).
    model: str = "gemma-3-270m"  # xllm_py.model.catalog.DEFAULT_MODEL
    served_model_name: str | None = None
    # Context limit for validation; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # How long shutdown waits for the HTTP server, then for each other component.
    http_shutdown_s: float = 10.0
    component_shutdown_s: float = 5.0
    registry: RegistryConfig = dataclasses.field(default_factory=RegistryConfig)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    relay: RelayConfig = dataclasses.field(default_factory=RelayConfig)
    elastic: ElasticConfig = dataclasses.field(default_factory=ElasticConfig)
    api: APILimits = dataclasses.field(default_factory=APILimits)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    # The Batch API's files, batches and journals (xllm_service/batch/), shared by every
    # service of the cluster; "": <temp dir>/xllm-batches/<etcd namespace> (one host).
    batch_dir: str = ""
    # The Responses API's stored responses (in etcd: every service of the cluster reads them).
    responses: ResponseStoreLimits = dataclasses.field(default_factory=ResponseStoreLimits)

    def __post_init__(self) -> None:
        if self.etcd_ttl_s <= 0:
            raise ValueError(f"etcd_ttl_s must be > 0, got {self.etcd_ttl_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def batch_root(self) -> str:
        """batch_dir, or the default one of this etcd namespace on this host."""
        if self.batch_dir:
            return self.batch_dir
        import tempfile

        space = "".join(c if c.isalnum() or c in "-_." else "_"
                        for c in self.etcd_namespace) or "default"
        return os.path.join(tempfile.gettempdir(), "xllm-batches", space)

    @property
    def model_name(self) -> str:
        """The model id in the API: --served-model-name, else the model path's last part."""
        return self.served_model_name or (self.model.rstrip("/").rsplit("/", 1)[-1] or self.model)
