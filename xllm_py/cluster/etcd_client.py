"""EtcdClient: the small registry interface xllm-py uses, over `aetcd` (asyncio etcd v3).

Keys (an optional namespace prefixes every key; callers pass un-namespaced keys and get
un-namespaced keys back):
    XLLM:<ROLE>:<name>      an engine instance, JSON InstanceMeta, on the instance's lease
    XLLM:SERVICE:<addr>     a service process, on its lease
    XLLM:SERVICE:MASTER     the master service; value = its rpc address; create-if-absent

Every call carries a deadline (`timeout_s`). Failures surface as `EtcdError`.
`LeasedKey` keeps one key alive on a lease and puts it back when it disappears.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
from collections.abc import AsyncIterator

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from xllm_py.config import InstanceRole, etcd_credentials_from_env
from xllm_py.tls import EtcdTLSConfig, TLSConfig, etcd_channel_credentials
from xllm_py.utils.aio import cancel_and_wait, wait_for

logger = logging.getLogger(__name__)

INSTANCE_PREFIX = "XLLM:"
SERVICE_PREFIX = "XLLM:SERVICE:"
MASTER_KEY = "XLLM:SERVICE:MASTER"


def instance_key(role: InstanceRole | str, name: str) -> str:
    role_value = role.value if isinstance(role, InstanceRole) else InstanceRole.parse(role).value
    return f"XLLM:{role_value}:{name}"


def service_key(addr: str) -> str:
    return f"{SERVICE_PREFIX}{addr}"


def parse_instance_key(key: str) -> tuple[InstanceRole, str] | None:
    """`XLLM:<ROLE>:<name>` -> (role, name); None for service keys and anything else."""
    parts = key.split(":", 2)
    if len(parts) != 3 or parts[0] != "XLLM" or not parts[2]:
        return None
    try:
        return InstanceRole(parts[1]), parts[2]
    except ValueError:
        return None


class EtcdError(RuntimeError):
    """An etcd call failed (unreachable, deadline exceeded, auth, compacted revision...)."""


class EventKind(str, enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: EventKind
    key: str
    value: bytes  # empty for DELETE
    revision: int


def lease_ttl_seconds(ttl_s: float) -> int:
    """etcd leases are whole seconds; etcd itself raises anything below its minimum (2 s)."""
    return max(1, math.ceil(ttl_s))


class _TLSClient(aetcd.Client):
    """aetcd opens only plaintext channels: this one opens a mutual-TLS channel and then
    sets up the same stubs as `aetcd.Client.connect` (aetcd 1.0.0a4; a unit test starts a
    TLS etcd and does a round trip through it, so a changed aetcd fails loudly)."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs) -> None:
        super().__init__(**kwargs)
        self._channel_credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = aetcd.rpc.secure_channel(target, self._channel_credentials,
                                                    options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdClient:
    """Async etcd client. `credentials=None` takes ETCD_USERNAME/ETCD_PASSWORD from the env;
    `tls` reaches an etcd that serves https (EtcdTLSConfig; a TLSConfig: with that
    identity)."""

    def __init__(
        self,
        endpoint: str,
        namespace: str = "",
        credentials: tuple[str, str] | None = None,
        timeout_s: float = 2.0,
        tls: EtcdTLSConfig | TLSConfig | None = None,
    ) -> None:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
        host = host.removeprefix("http://").removeprefix("https://")
        self.endpoint = endpoint
        self.namespace = namespace
        self.timeout_s = timeout_s
        if credentials is None:
            credentials = etcd_credentials_from_env()
        user, password = credentials if credentials else (None, None)
        kwargs = dict(
            host=host,
            port=int(port),
            username=user,
            password=password,
            timeout=timeout_s,  # aetcd passes it as the deadline of every unary call
            connect_wait_timeout=max(1, math.ceil(timeout_s)),
        )
        self._client = (aetcd.Client(**kwargs) if tls is None
                        else _TLSClient(etcd_channel_credentials(tls), **kwargs))

    # ------------------------------------------------------------------ keys

    def _k(self, key: str) -> bytes:
        return (self.namespace + key).encode()

    def _strip(self, raw: bytes) -> str:
        key = raw.decode(errors="replace")
        return key[len(self.namespace):] if self.namespace and key.startswith(self.namespace) else key

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> None:
        await self._call(self._client.connect())

    async def close(self) -> None:
        try:
            await wait_for(self._client.close(), self.timeout_s)
        except Exception as e:  # closing must not raise out of shutdown paths
            logger.warning("closing etcd client %s: %r", self.endpoint, e)

    async def __aenter__(self) -> "EtcdClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, coro):  # type: ignore[no-untyped-def]
        """Await an aetcd call under an outer deadline; map its errors to EtcdError."""
        try:
            return await wait_for(coro, self.timeout_s + 0.5)
        except asyncio.TimeoutError as e:
            raise EtcdError(f"etcd {self.endpoint}: deadline of {self.timeout_s}s exceeded") from e
        except aetcd.exceptions.ClientError as e:
            raise EtcdError(f"etcd {self.endpoint}: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ kv

    async def put(self, key: str, value: str | bytes, lease_id: int | None = None) -> int:
        """Returns the revision of the write."""
        data = value.encode() if isinstance(value, str) else value
        resp = await self._call(self._client.put(self._k(key), data, lease=lease_id))
        return resp.header.revision

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call(self._client.get(self._k(key)))
        if resp is None:
            return None
        return KeyValue(key, resp.value, resp.mod_revision, resp.lease)

    async def get_prefix(self, prefix: str, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` and the store revision they were read at
        (`keys_only`: values left empty)."""
        resp = await self._call(self._client.get_prefix(self._k(prefix), keys_only=keys_only))
        kvs = [KeyValue(self._strip(kv.key), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs]
        return kvs, resp.header.revision

    async def store_identity(self) -> tuple[int, int]:
        """(cluster_id, current revision): a wiped or replaced etcd shows a new cluster id
        or a revision that went backwards, which an open watch never reports."""
        resp = await self._call(self._client.get_prefix(self._k("\x00xllm-identity"), keys_only=True))
        return resp.header.cluster_id, resp.header.revision

    async def delete(self, key: str) -> bool:
        resp = await self._call(self._client.delete(self._k(key)))
        return bool(resp and resp.deleted)

    async def put_if_absent(self, key: str, value: str | bytes, lease_id: int | None = None) -> tuple[bool, bytes | None]:
        """Create `key` only if it does not exist (one transaction).

        Returns (created, current value): the value just written or the one that won.
        """
        data = value.encode() if isinstance(value, str) else value
        k = self._k(key)
        tx = self._client.transactions
        succeeded, responses = await self._call(
            self._client.transaction(
                compare=[tx.version(k) == 0],
                success=[tx.put(k, data, lease=lease_id)],
                failure=[tx.get(k)],
            )
        )
        if succeeded:
            return True, data
        current = responses[0][0][0] if responses and responses[0] else None
        return False, current

    async def delete_if_value(self, key: str, value: str | bytes) -> bool:
        """Delete `key` only while it still holds `value` (a master resigning)."""
        data = value.encode() if isinstance(value, str) else value
        k = self._k(key)
        tx = self._client.transactions
        succeeded, _ = await self._call(
            self._client.transaction(compare=[tx.value(k) == data], success=[tx.delete(k)], failure=[])
        )
        return bool(succeeded)

    # ------------------------------------------------------------------ leases

    async def grant_lease(self, ttl_s: float) -> int:
        lease = await self._call(self._client.lease(lease_ttl_seconds(ttl_s)))
        return lease.id

    async def refresh_lease(self, lease_id: int) -> int:
        """One keepalive; returns the remaining TTL in seconds, <= 0 if the lease is gone."""
        reply = await self._call(self._client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(self._client.revoke_lease(lease_id))
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # ------------------------------------------------------------------ watch

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """PUT/DELETE events under `prefix` from `start_revision` (inclusive).

        Runs until the caller stops iterating; raises EtcdError when the stream breaks
        (etcd gone, revision compacted): the caller resyncs with get_prefix and watches
        again from the new revision.
        """
        watch = await self._call(self._client.watch_prefix(self._k(prefix), start_revision=start_revision))
        try:
            async for ev in watch:
                kind = EventKind.PUT if ev.kind == "PUT" else EventKind.DELETE
                yield WatchEvent(
                    kind=kind,
                    key=self._strip(ev.kv.key),
                    value=ev.kv.value if kind is EventKind.PUT else b"",
                    revision=ev.kv.mod_revision,
                )
        except aetcd.exceptions.ClientError as e:
            raise EtcdError(f"etcd {self.endpoint}: watch on {prefix!r} broke: {e}") from e
        except Exception as e:  # aetcd delivers raw grpc errors into the iterator
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                raise
            raise EtcdError(f"etcd {self.endpoint}: watch on {prefix!r} broke: {e!r}") from e
        finally:
            try:
                await wait_for(watch.cancel(), self.timeout_s)
            except Exception:  # the stream may already be gone
                pass
        # The iterator ends without an error only when the client shuts down.
        raise EtcdError(f"etcd {self.endpoint}: watch on {prefix!r} ended")


class LeasedKey:
    """Keeps `key = value` alive on its own lease; puts it back when it disappears.

    Each tick (every `interval_s`): refresh the lease; if the lease is gone (expired,
    etcd restarted without its data) grant a new one and put the key; if the key is gone
    or changed (deleted by hand) put it back. `stop()` deletes the key and revokes the
    lease. `stop(delete=False)` only stops refreshing (the key expires with the lease).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        value: str | bytes,
        ttl_s: float,
        interval_s: float | None = None,
    ) -> None:
        self.client = client
        self.key = key
        self._value = value.encode() if isinstance(value, str) else value
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else max(0.1, ttl_s / 3)
        self.lease_id: int | None = None
        self.num_reputs = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def value(self) -> bytes:
        return self._value

    def set_value(self, value: str | bytes) -> None:
        """Change the value; written on the next tick (call `await ensure()` to write now)."""
        self._value = value.encode() if isinstance(value, str) else value
        self._wake.set()

    async def start(self) -> None:
        """Write the key once (raises EtcdError if etcd is unreachable), then keep it alive."""
        await self.ensure()
        self._task = asyncio.create_task(self._loop(), name=f"leased-key {self.key}")

    def start_background(self) -> None:
        """Keep the key alive without a first synchronous write (etcd may be down now)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"leased-key {self.key}")

    async def ensure(self) -> None:
        """One tick: make sure the lease is alive and the key holds our value on it."""
        if self.lease_id is not None:
            ttl = await self.client.refresh_lease(self.lease_id)
            if ttl <= 0:
                logger.warning("lease %x of %s expired; registering again", self.lease_id, self.key)
                self.lease_id = None
        if self.lease_id is None:
            self.lease_id = await self.client.grant_lease(self.ttl_s)
            await self.client.put(self.key, self._value, self.lease_id)
            self.num_reputs += 1
            return
        current = await self.client.get(self.key)
        if current is None or current.value != self._value or current.lease != self.lease_id:
            if current is None:
                logger.warning("key %s disappeared; putting it back", self.key)
            await self.client.put(self.key, self._value, self.lease_id)
            self.num_reputs += 1

    async def _loop(self) -> None:
        while True:
            try:
                await wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.ensure()
            except EtcdError as e:
                logger.warning("keeping %s alive failed (will retry): %s", self.key, e)
            except Exception:
                logger.exception("keeping %s alive failed unexpectedly (will retry)", self.key)

    async def stop(self, delete: bool = True) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if not delete:
            return
        lease_id, self.lease_id = self.lease_id, None
        try:
            await self.client.delete(self.key)
            if lease_id is not None:
                await self.client.revoke_lease(lease_id)
        except EtcdError as e:
            logger.warning("removing %s on stop failed (it expires with its lease): %s", self.key, e)

