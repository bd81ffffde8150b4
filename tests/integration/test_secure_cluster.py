"""A PD cluster under mutual TLS and API keys (`--tls-*`, `--api-key`): the HTTP APIs answer
401 without a key; every internal gRPC service (XllmRpcService, DisaggPDService,
WorkerService) and etcd refuse callers without a cluster certificate; a KV pull from a peer
that has not linked (no transfer key) is refused; greedy output equals a MIX engine's; no
key shows up in any log."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from tests.integration.cluster_harness import Harness
from xllm_py.cluster.certs import make_cluster_certs
from xllm_py.cluster.etcd_client import INSTANCE_PREFIX, MASTER_KEY, EtcdClient, EtcdError
from xllm_py.cluster.etcd_server import EmbeddedEtcd
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole, TransferConfig
from xllm_py.kv_transfer import TransferError, create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.tls import TLSConfig, channel_credentials
from xllm_py.utils.grpc_channels import open_channel
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

API_KEY = "sk-secure-cluster-test-key"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "alpha beta gamma delta " * 6, "Hi"]


def _flags(issued) -> list[str]:
    return ["--tls-cert", issued.cert, "--tls-key", issued.key, "--tls-ca", issued.ca,
            "--etcd-cacert", issued.ca, "--etcd-cert", issued.cert, "--etcd-key", issued.key]


def _tls(issued) -> TLSConfig:
    return TLSConfig(cert=issued.cert, key=issued.key, ca=issued.ca)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("secure")
    certs = make_cluster_certs(root / "certs", names=("etcd", "service", "engine"))
    outsider = make_cluster_certs(root / "outsider", names=("engine",))["engine"]
    key_file = root / "api-keys"
    key_file.write_text(f"# test\n{API_KEY}\n")
    etcd = EmbeddedEtcd(tls=_tls(certs["etcd"])).start()
    h = Harness(etcd.endpoint, "secure/", root / "logs")
    common = ["--block-size", "8", "--num-blocks", "512", "--api-key-file", str(key_file)]
    mix_port = free_port()
    mix = spawn("mix-ref", "xllm_py.engine", engine_args("MIX", mix_port, extra=common),
                h.log_dir, http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    try:
        svc = h.service(extra=[*_flags(certs["service"]), "--api-key", API_KEY])
        prefill = h.engine("PREFILL", "prefill", extra=[*common, *_flags(certs["engine"])])
        decode = h.engine("DECODE", "decode", extra=[*common, *_flags(certs["engine"])])
        for p in (mix, prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        yield {"h": h, "svc": svc, "mix": mix, "prefill": prefill, "decode": decode,
               "certs": certs, "outsider": outsider, "etcd": etcd}
    finally:
        h.stop()
        etcd.stop()


def _openai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


async def _members(secure) -> tuple[str, list[InstanceMeta]]:
    """(service rpc address, engines' metas), read from etcd as a cluster member."""
    client = EtcdClient(secure["etcd"].endpoint, namespace="secure/",
                        tls=_tls(secure["certs"]["service"]))
    await client.connect()
    try:
        master = (await client.get(MASTER_KEY)).value.decode()
        kvs, _ = await client.get_prefix(INSTANCE_PREFIX)
        metas = [InstanceMeta.from_json(kv.value) for kv in kvs
                 if kv.key.split(":")[1] in ("PREFILL", "DECODE")]
    finally:
        await client.close()
    assert len(metas) == 2
    return master, metas


def test_http_apis_need_the_key_and_probes_stay_open(secure) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for proc in (secure["svc"], secure["mix"]):
        url = proc.http_url
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for path in ("/health", "/readiness", "/metrics"):
            assert httpx.get(url + path, timeout=10).status_code == 200, (url, path)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text


def test_greedy_pd_under_tls_equals_mix(secure) -> None:
    pd, mix = _openai(secure["svc"].http_url, API_KEY), _openai(secure["mix"].http_url, API_KEY)
    body = {"ignore_eos": True, "return_token_ids": True}
    for prompt in PROMPTS:
        got = pd.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body=body).choices[0]
        want = mix.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body=body).choices[0]
        assert got.model_extra["token_ids"] == want.model_extra["token_ids"], prompt
        assert got.text == want.text


async def test_internal_services_refuse_callers_without_a_cluster_certificate(secure) -> None:
    master, metas = await _members(secure)
    ca = open(secure["certs"]["engine"].ca, "rb").read()
    strangers = {
        "plaintext": None,
        "server-checked TLS, no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "another CA's certificate": channel_credentials(_tls(secure["outsider"])),
    }
    member = channel_credentials(_tls(secure["certs"]["service"]))
    worker = metas[0].worker_rpc_addrs[0]
    calls = {  # one harmless call per internal service, and the one an attacker wants
        "XllmRpcService": (master, lambda ch: pb_grpc.XllmRpcServiceStub(ch).GetStaticDecodeList(
            pb.InstanceID(name="x"), timeout=5)),
        "DisaggPDService": (metas[0].rpc_address, lambda ch: pb_grpc.DisaggPDServiceStub(ch).Cancel(
            pb.CancelRequest(req_id="nobody"), timeout=5)),
        "WorkerService": (worker, lambda ch: pb_grpc.WorkerServiceStub(ch).GetCacheInfo(
            pb.Empty(), timeout=5)),
        "WorkerService.PullKVCache": (worker, lambda ch: pb_grpc.WorkerServiceStub(ch).PullKVCache(
            pb.PullKVCacheRequest(addr=metas[1].addrs[0], src_blocks=[0], dst_blocks=[0]),
            timeout=5)),
    }
    for service, (addr, call) in calls.items():
        for who, creds in strangers.items():
            async with open_channel(addr, creds) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call(channel)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, (service, who)
        if service != "WorkerService.PullKVCache":  # a member gets an answer: the cert is the gate
            async with open_channel(addr, member) as channel:
                await call(channel)
    for tls in (None, _tls(secure["outsider"])):  # etcd too
        stranger = EtcdClient(secure["etcd"].endpoint, namespace="secure/", tls=tls, timeout_s=1.0)
        with pytest.raises(EtcdError):
            await stranger.connect()
            await stranger.get(MASTER_KEY)
        await stranger.close()


async def test_kv_pull_from_an_unlinked_peer_is_refused(secure) -> None:
    _, metas = await _members(secure)
    prefill = next(m for m in metas if m.role is InstanceRole.PREFILL)
    assert prefill.transfer_keys and prefill.transfer_keys[0] not in repr(prefill)
    async with open_channel(prefill.worker_rpc_addrs[0],
                            channel_credentials(_tls(secure["certs"]["service"]))) as ch:
        info = await pb_grpc.WorkerServiceStub(ch).GetCacheInfo(pb.Empty(), timeout=5)
    # A stranger with the prefill's exact KV geometry, reaching its UCX listener directly.
    storage = KVCacheStorage(num_layers=info.num_layers, num_blocks=4, block_size=info.block_size,
                             num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                             dtype=info.kv_dtype)
    stranger = create_backend("ucx", storage, TransferConfig(timeout_s=10))
    stranger.start()
    try:
        before = storage.kv.clone()
        for key in ("", "0" * 32):
            stranger.set_peer_key(prefill.addrs[0], key)
            with pytest.raises(TransferError) as exc:
                await stranger.pull(prefill.addrs[0], [0, 1], [0, 1], timeout=10)
            assert exc.value.denied, str(exc.value)
        assert bool((storage.kv == before).all())
        # Control: the key a member reads from TLS etcd opens it (the key was the gate).
        await stranger.link(prefill.addrs[0], timeout=10, key=prefill.transfer_keys[0])
        await stranger.pull(prefill.addrs[0], [0, 1], [0, 1], timeout=10)
    finally:
        await stranger.close()


async def test_no_key_in_any_log(secure) -> None:
    _, metas = await _members(secure)
    secrets_ = [API_KEY, *(k for m in metas for k in m.transfer_keys)]
    logs = list(secure["h"].log_dir.glob("*.log"))
    assert len(logs) == 4 and len(secrets_) == 3
    for log in logs:
        text = log.read_text(errors="replace")
        for s in secrets_:
            assert s not in text, f"a key in {log.name}"
