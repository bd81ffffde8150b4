"""PD between instances of different TP (service + PREFILL + DECODE processes, real etcd,
tcp and ucx transfer): P TP 2 + D TP 1, P TP 1 + D TP 2 and P TP 2 + D TP 2, in PULL and PUSH
(tcp: all six; ucx: head slices once each way and each mode, whole blocks rank to rank),
give the greedy tokens of a MIX TP 1 engine on the same prompts (crossing KV blocks);
each decode rank received exactly the bytes of its own KV heads (transfer logs of its
worker, or of the prefill workers that pushed into it); every pool returns to 0 blocks."""
from __future__ import annotations

import re

import pytest

from tests.integration.cluster_harness import Harness, client, metric, wait_drained
from tests.integration.test_tensor_parallel import MAX_TOKENS, _generate_tiny

pytestmark = pytest.mark.integration

BLOCK = 8
# tiny: 4 layers, head_dim 64, float32: one KV head of one block, K and V
HEAD_BLOCK_BYTES = 2 * 4 * BLOCK * 64 * 4
NUM_KV_HEADS = 2
PROMPTS = [list(range(40, 40 + n)) for n in (5, 8, 9, 23, 33)]


_LINE = re.compile(r"^.*?(\[tp(\d+)\])?\s*xllm_py\.kv_transfer\.kv_worker: kv (pull|push) "
                   r"req=\S* peer=(\S+) blocks=(\d+) runs=\d+ bytes=(\d+)", re.M)
_TOOK = re.compile(r"PD decode took over request \S+ from \S+: (\d+) blocks")


def _moves(log: str, op: str) -> list[tuple[int, str, int, int]]:
    """(rank, peer address, blocks, bytes) of each successful transfer in an engine log."""
    return [(int(m.group(2) or 0), m.group(4), int(m.group(5)), int(m.group(6)))
            for m in _LINE.finditer(log) if m.group(3) == op]


CASES = [(p, d, "tcp", mode) for p, d in ((2, 1), (1, 2), (2, 2)) for mode in ("PULL", "PUSH")]
# ucx: head slices (each TP direction once, PULL and PUSH once each; engines on one host
# map each other's pools: the mapped path; the iov and tag paths: test_ucx_head_slices.py),
# and whole blocks between equal TP
CASES += [(2, 1, "ucx", "PULL"), (1, 2, "ucx", "PUSH"), (2, 2, "ucx", "PULL"), (2, 2, "ucx", "PUSH")]


@pytest.mark.parametrize("p_tp,d_tp,backend,mode", CASES)
def test_pd_across_tp_equals_mix(etcd_server, tmp_path, p_tp, d_tp, backend, mode):
    ref, _ = _generate_tiny(PROMPTS)  # MIX TP 1, in this process
    h = Harness(etcd_server.endpoint, f"pd-tp-{p_tp}{d_tp}{backend}{mode}/", tmp_path)
    common = ["--block-size", str(BLOCK), "--kv-cache-transfer-mode", mode,
              "--kv-transfer-backend", backend, "--num-blocks", "128"]
    try:
        svc, prefill, decode = h.pd_tp_cluster(common, p_tp, d_tp)
        c = client(svc)
        for prompt, (tokens, logprobs) in zip(PROMPTS, ref):
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            choice = r.choices[0]
            assert choice.model_extra["token_ids"] == tokens, f"prompt of {len(prompt)} tokens"
            assert max(abs(x - y) for x, y in zip(choice.logprobs.token_logprobs, logprobs)) < 1e-4
        import asyncio

        asyncio.run(wait_drained([prefill.http_url, decode.http_url], timeout_s=20))
        dlog = decode.log_path.read_text(errors="replace")
        blocks = sum(int(b) for b in _TOOK.findall(dlog))
        assert blocks >= sum((len(p) + BLOCK - 1) // BLOCK for p in PROMPTS) - len(PROMPTS)
        own = HEAD_BLOCK_BYTES * NUM_KV_HEADS // d_tp  # one decode rank's heads of a block
        if mode == "PULL":  # each decode rank's worker logged what it pulled
            received = {r: 0 for r in range(d_tp)}
            for rank, _, _, nbytes in _moves(dlog, "pull"):
                received[rank] += nbytes
        else:  # the prefill ranks' workers logged what they pushed, per decode address
            addrs = re.findall(r"\[tp(\d+)\].*KV worker \w+: \w+ transfer at ([\w.]+:\d+)|"
                               r"KV worker \w+: \w+ transfer at ([\w.]+:\d+)", dlog)
            port_rank = {}
            for tp_rank, addr_r, addr0 in addrs:
                port_rank[(addr_r or addr0).rsplit(":", 1)[1]] = int(tp_rank or 0)
            received = {r: 0 for r in range(d_tp)}
            for _, peer, _, nbytes in _moves(prefill.log_path.read_text(errors="replace"),
                                             "push"):
                received[port_rank[peer.rsplit(":", 1)[1]]] += nbytes
        print(f"\n{mode} P TP {p_tp} + D TP {d_tp}: {blocks} blocks handed over; bytes "
              f"received per decode rank {received} (own heads: {own} per block)")
        assert received == {r: blocks * own for r in range(d_tp)}
        if backend == "ucx":  # engines on one host: the peer's pool mapped, every move a memcpy
            mover = dlog if mode == "PULL" else prefill.log_path.read_text(errors="replace")
            assert set(re.findall(r"kv (?:pull|push) req=\S* .* path=(\w+)", mover)) == {"mapped"}
        for e in (prefill, decode):
            assert metric(e.http_url, "xllm_kv_cache_blocks_used") == 0
    finally:
        h.stop()
