"""EtcdClient: the small registry interface xllm-py uses, over `aetcd` (asyncio etcd v3).

Keys (an optional namespace prefixes every key; callers pass un-namespaced keys and get
un-namespaced keys back):
    XLLM:<ROLE>:<name>      an engine instance, JSON InstanceMeta, on the instance's lease
    XLLM:SERVICE:<addr>     a service process, on its lease
    XLLM:SERVICE:MASTER     the master service; value = its rpc address; create-if-absent

Every call carries a deadline (`timeout_s`). Failures surface as `EtcdError`.
`LeasedKey` (cluster/leased_key.py) keeps one key alive on a lease.

Members: the endpoint may list several members of one etcd cluster (`h1:p1,h2:p2`). The
client talks to one at a time; a call that finds its member unreachable (refused,
unavailable, past its share of the deadline) moves to the next member and tries again while
the call's deadline lasts, so one dead member (the leader included) takes nothing down. A write that
is not idempotent (a transaction, a lease grant) is sent again only where its member
refused it: a member that went silent may have committed it first. Leases and
revisions are cluster-wide: a keep-alive goes on through the new member, and a watch
resumes on it from the revision after the last event it delivered.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
from collections.abc import AsyncIterator

import aetcd
import aetcd.client
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from xllm_py.config import InstanceRole, etcd_credentials_from_env
from xllm_py.tls import EtcdTLSConfig, TLSConfig, etcd_channel_credentials
from xllm_py.utils.aio import wait_for
from xllm_py.utils.cli import parse_etcd_endpoints

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


# aetcd errors that say "this member did not answer": another member may.
_UNREACHABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError,
                aetcd.exceptions.WatchTimeoutError, asyncio.TimeoutError)


def _describe(error: BaseException) -> str:
    return "no answer within the deadline" if isinstance(error, asyncio.TimeoutError) else repr(error)


# Compare/put/get builders for transactions (what aetcd.Client.transactions holds).
_TX = aetcd.client.Transactions()


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
        """`endpoint`: one member `host:port` or several, comma-separated."""
        self.endpoints = parse_etcd_endpoints(endpoint)
        self.namespace = namespace
        self.timeout_s = timeout_s
        if credentials is None:
            credentials = etcd_credentials_from_env()
        self._credentials = credentials if credentials else (None, None)
        self._channel_credentials = None if tls is None else etcd_channel_credentials(tls)
        # One aetcd client per member, made on first use: a watch stays on the client it
        # was opened on while calls move on, and at most one client per member exists.
        self._clients: list[aetcd.Client | None] = [None] * len(self.endpoints)
        self._closed = False
        self._current = 0
        self.num_rotations = 0

    @property
    def endpoint(self) -> str:
        """The member calls go to now (error messages name it)."""
        return self.endpoints[self._current]

    def _make_client(self, endpoint: str) -> aetcd.Client:
        host, _, port = endpoint.rpartition(":")
        user, password = self._credentials
        kwargs = dict(
            host=host,
            port=int(port),
            username=user,
            password=password,
            timeout=self.timeout_s,  # aetcd passes it as the deadline of every unary call
            connect_wait_timeout=max(1, math.ceil(self.timeout_s)),
        )
        return (aetcd.Client(**kwargs) if self._channel_credentials is None
                else _TLSClient(self._channel_credentials, **kwargs))

    @property
    def _client(self) -> aetcd.Client:
        if self._closed:
            # A task still running through shutdown would otherwise open a channel
            # nobody closes.
            raise EtcdError(f"etcd {self.endpoint}: client closed")
        client = self._clients[self._current]
        if client is None:
            client = self._clients[self._current] = self._make_client(self.endpoint)
        return client

    def _rotate(self, failed: aetcd.Client) -> bool:
        """Move to the next member if `failed` is still the current client (two calls
        failing together move once). False with a single member: nowhere to go."""
        if len(self.endpoints) == 1:
            return False
        if self._clients[self._current] is failed:
            before = self.endpoint
            self._current = (self._current + 1) % len(self.endpoints)
            self.num_rotations += 1
            logger.warning("etcd member %s unreachable; moving to %s", before, self.endpoint)
        return True

    # ------------------------------------------------------------------ keys

    def _k(self, key: str) -> bytes:
        return (self.namespace + key).encode()

    def _strip(self, raw: bytes) -> str:
        key = raw.decode(errors="replace")
        return key[len(self.namespace):] if self.namespace and key.startswith(self.namespace) else key

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> None:
        await self._call(lambda c: c.connect())

    async def close(self) -> None:
        """Final: later calls raise EtcdError."""
        self._closed = True
        clients, self._clients = self._clients, [None] * len(self.endpoints)
        for endpoint, client in zip(self.endpoints, clients):
            if client is None:
                continue
            try:
                await wait_for(client.close(), self.timeout_s)
            except Exception as e:  # closing must not raise out of shutdown paths
                logger.warning("closing etcd client %s: %r", endpoint, e)

    async def __aenter__(self) -> "EtcdClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, call, idempotent: bool = True):  # type: ignore[no-untyped-def]
        """`call(aetcd_client)` under one outer deadline for the whole call; a member
        that does not answer hands the rest of the deadline to the next member (each
        member tried at most once). aetcd errors map to EtcdError.

        `idempotent=False` (a transaction, a lease grant): a member that went silent may
        have committed before it did, so the call is not sent again elsewhere; only a
        refused connection moves it on."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s + 0.5
        # A member that hangs (a host gone without refusing) keeps only its share, so the
        # next one still has time to answer; the last one tried keeps what is left, and
        # so does a call that is not sent again.
        share = max(0.5, self.timeout_s / len(self.endpoints))
        for attempt in range(len(self.endpoints)):
            client = self._client
            endpoint = self.endpoint
            remaining = deadline - asyncio.get_running_loop().time()
            if idempotent and attempt < len(self.endpoints) - 1:
                remaining = min(share, remaining)
            try:
                return await wait_for(call(client), max(0.05, remaining))
            except _UNREACHABLE as e:
                error = e
                if (not self._rotate(client) or deadline - asyncio.get_running_loop().time() < 0.05
                        or not idempotent and not isinstance(e, aetcd.exceptions.ConnectionFailedError)):
                    break
                logger.info("etcd %s: %s; retrying on %s", endpoint, _describe(e), self.endpoint)
            except aetcd.exceptions.ClientError as e:
                raise EtcdError(f"etcd {endpoint}: {type(e).__name__}: {e}") from e
        if isinstance(error, asyncio.TimeoutError):
            raise EtcdError(f"etcd {endpoint}: deadline of {self.timeout_s}s exceeded") from error
        raise EtcdError(f"etcd {endpoint}: {type(error).__name__}: {error}") from error

    # ------------------------------------------------------------------ kv

    async def put(self, key: str, value: str | bytes, lease_id: int | None = None) -> int:
        """Returns the revision of the write."""
        data = value.encode() if isinstance(value, str) else value
        resp = await self._call(lambda c: c.put(self._k(key), data, lease=lease_id))
        return resp.header.revision

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call(lambda c: c.get(self._k(key)))
        if resp is None:
            return None
        return KeyValue(key, resp.value, resp.mod_revision, resp.lease)

    async def get_prefix(self, prefix: str, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` and the store revision they were read at
        (`keys_only`: values left empty)."""
        resp = await self._call(lambda c: c.get_prefix(self._k(prefix), keys_only=keys_only))
        kvs = [KeyValue(self._strip(kv.key), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs]
        return kvs, resp.header.revision

    async def store_identity(self) -> tuple[int, int]:
        """(cluster_id, current revision): a wiped or replaced etcd shows a new cluster id
        or a revision that went backwards, which an open watch never reports."""
        resp = await self._call(lambda c: c.get_prefix(self._k("\x00xllm-identity"), keys_only=True))
        return resp.header.cluster_id, resp.header.revision

    async def delete(self, key: str) -> bool:
        resp = await self._call(lambda c: c.delete(self._k(key)))
        return bool(resp and resp.deleted)

    async def put_if_absent(self, key: str, value: str | bytes, lease_id: int | None = None) -> tuple[bool, bytes | None]:
        """Create `key` only if it does not exist (one transaction).

        Returns (created, current value): the value just written or the one that won.
        A key that already holds this value on this lease counts as created: a member
        that committed and then lost its reply leaves exactly that for the next try.
        """
        data = value.encode() if isinstance(value, str) else value
        k = self._k(key)
        tx = _TX
        succeeded, responses = await self._call(
            lambda c: c.transaction(
                compare=[tx.version(k) == 0],
                success=[tx.put(k, data, lease=lease_id)],
                failure=[tx.get(k)],
            ),
            idempotent=False,
        )
        if succeeded:
            return True, data
        if not responses or not responses[0]:
            return False, None
        current, kv = responses[0][0]
        return current == data and kv.lease == (lease_id or 0), current

    async def delete_if_value(self, key: str, value: str | bytes) -> bool:
        """Delete `key` only while it still holds `value` (a master resigning)."""
        data = value.encode() if isinstance(value, str) else value
        k = self._k(key)
        tx = _TX
        succeeded, _ = await self._call(
            lambda c: c.transaction(compare=[tx.value(k) == data], success=[tx.delete(k)], failure=[]),
            idempotent=False,
        )
        return bool(succeeded)

    # ------------------------------------------------------------------ leases

    async def grant_lease(self, ttl_s: float) -> int:
        lease = await self._call(lambda c: c.lease(lease_ttl_seconds(ttl_s)), idempotent=False)
        return lease.id

    async def refresh_lease(self, lease_id: int) -> int:
        """One keepalive; returns the remaining TTL in seconds, <= 0 if the lease is gone."""
        reply = await self._call(lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(lambda c: c.revoke_lease(lease_id))
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # ------------------------------------------------------------------ watch

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """PUT/DELETE events under `prefix` from `start_revision` (inclusive).

        Runs until the caller stops iterating. A stream that breaks because its member is
        gone reopens on the next member from the revision after the last event delivered
        (each member at most once between two events). Raises EtcdError when that does
        not mend it (every member gone, revision compacted): the caller resyncs with
        get_prefix and watches again from the new revision.
        """
        next_revision = start_revision
        reopens = 0
        while True:
            watch = await self._call(
                lambda c: c.watch_prefix(self._k(prefix), start_revision=next_revision))
            # The member the stream opened on (_call may have moved on to open it).
            client, endpoint = self._client, self.endpoint
            try:
                async for ev in watch:
                    kind = EventKind.PUT if ev.kind == "PUT" else EventKind.DELETE
                    next_revision = ev.kv.mod_revision + 1
                    reopens = 0
                    yield WatchEvent(
                        kind=kind,
                        key=self._strip(ev.kv.key),
                        value=ev.kv.value if kind is EventKind.PUT else b"",
                        revision=ev.kv.mod_revision,
                    )
                # The iterator ends without an error only when the client shuts down.
                error: BaseException = EtcdError(f"etcd {endpoint}: watch on {prefix!r} ended")
            except _UNREACHABLE as e:
                error = e
            except aetcd.exceptions.ClientError as e:
                raise EtcdError(f"etcd {endpoint}: watch on {prefix!r} broke: {e}") from e
            except Exception as e:  # aetcd delivers raw grpc errors into the iterator
                if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                    raise
                error = e
            finally:
                try:
                    await wait_for(watch.cancel(), self.timeout_s)
                except Exception:  # the stream may already be gone
                    pass
            # Reopen only where a member was given up on, and only while one is left untried.
            reopens += 1
            if (not isinstance(error, _UNREACHABLE) and not _grpc_unavailable(error)) \
                    or not self._rotate(client) or reopens >= len(self.endpoints):
                raise EtcdError(f"etcd {endpoint}: watch on {prefix!r} broke: {error!r}") from error
            logger.info("etcd %s: watch on %r broke (%r); reopening on %s from revision %s",
                        endpoint, prefix, error, self.endpoint, next_revision)


def _grpc_unavailable(error: BaseException) -> bool:
    """A raw grpc error the watcher delivered that says the member is gone."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
