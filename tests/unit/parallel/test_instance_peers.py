"""InstancePeers: the other engines' RPCs go to its PDServiceClient, KV moves and links to
the right rank's KVWorkerClient (fakes here that record what they are asked)."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.parallel.instance_peers import InstancePeers
from xllm_py.pd_messages import KVMove, OfflinePull, PeerLink
from xllm_py.status import Status, StatusError


class Worker:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closed = False

    async def pull_kv(self, move, heads=None) -> None:
        self.calls.append(("pull", move, heads))

    async def push_kv(self, move, heads=None) -> None:
        self.calls.append(("push", move, heads))

    async def link_cluster(self, link) -> None:
        self.calls.append(("link", link))

    async def close(self) -> None:
        self.closed = True


class Engines:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    async def link_instance(self, decode, prefill) -> None:
        self.calls.append(f"link {decode.name}")

    async def send_pull_signal(self, prefill, pull) -> int:
        self.calls.append(f"pull signal {prefill.name}")
        return 3

    async def close(self) -> None:
        self.closed = True


def meta(name: str, role: InstanceRole, tp: int) -> InstanceMeta:
    return InstanceMeta(name=name, type=role, tp_size=tp, num_kv_heads=2,
                        cluster_ids=[100 * tp + r for r in range(tp)],
                        addrs=[f"{name}-t{r}" for r in range(tp)],
                        transfer_keys=[f"{name}-k{r}" for r in range(tp)])


async def test_between_two_tp1_instances_a_move_goes_as_it_is_to_rank_0s_worker() -> None:
    w0, engines = Worker(), Engines()
    peers = InstancePeers(meta("d", InstanceRole.DECODE, 1), engines, [w0])
    move = KVMove("r1", 7, "p-t0", [1, 2], [3, 4], "key")
    await peers.pull_kv(move)
    await peers.link_cluster(PeerLink("p", [100], ["p-t0"], None))
    assert w0.calls == [("pull", move, None), ("link", PeerLink("p", [100], ["p-t0"], None))]
    assert await peers.send_pull_signal(meta("p", InstanceRole.PREFILL, 1),
                                        OfflinePull("d", 1, 64)) == 3
    await peers.close()
    assert engines.calls == ["pull signal p"] and engines.closed and w0.closed


async def test_a_tp2_decode_links_and_pulls_each_ranks_heads_on_that_ranks_worker() -> None:
    workers = [Worker(), Worker()]
    peers = InstancePeers(meta("d", InstanceRole.DECODE, 2), Engines(), workers)
    prefill = meta("p", InstanceRole.PREFILL, 1)  # holds both KV heads
    await peers.link_cluster(PeerLink("p", prefill.cluster_ids, prefill.addrs, prefill))
    for w in workers:  # each decode rank reads a head of the prefill's one rank
        (op, link), = w.calls
        assert (op, link.cluster_ids, link.addrs) == ("link", [100], ["p-t0"])
        assert link.meta.transfer_keys == ["p-k0"] and link.meta.num_kv_heads == 0
    for w in workers:
        w.calls.clear()
    await peers.pull_kv(KVMove("r1", 100, "p-t0", [1, 2], [5, 6]))
    for rank, w in enumerate(workers):  # decode rank r reads the prefill's head r
        (op, move, heads), = w.calls
        assert (op, heads) == ("pull", (rank, 0, 1))
        assert (move.cluster_id, move.addr, move.transfer_key) == (100, "p-t0", "p-k0")
        assert (move.src_blocks, move.dst_blocks) == ([1, 2], [5, 6])


async def test_a_tp1_prefill_pushes_into_each_rank_of_a_tp2_decode() -> None:
    w0 = Worker()
    peers = InstancePeers(meta("p", InstanceRole.PREFILL, 1), Engines(), [w0])
    decode = meta("d", InstanceRole.DECODE, 2)
    await peers.link_instance(decode, meta("p", InstanceRole.PREFILL, 1))
    await peers.push_kv(KVMove("r2", 200, "d-t0", [1], [9]))
    assert sorted((m.addr, m.transfer_key, heads) for _, m, heads in w0.calls) == [
        ("d-t0", "d-k0", (0, 0, 1)), ("d-t1", "d-k1", (1, 0, 1))]


async def test_a_tp_move_from_an_unlinked_peer_is_bad_gateway() -> None:
    workers = [Worker(), Worker()]
    peers = InstancePeers(meta("d", InstanceRole.DECODE, 2), Engines(), workers)
    with pytest.raises(StatusError) as err:
        await peers.pull_kv(KVMove("r3", 999, "x", [1], [1]))
    assert err.value.status is Status.BAD_GATEWAY and "cluster id 999" in err.value.message
    assert workers[0].calls == workers[1].calls == []


def pp2(name: str, role: InstanceRole, stages: list[list[int]]) -> InstanceMeta:
    """A PP 2 instance whose stages hold ``stages`` (rank_kv, stage order); its workers
    are registered in process order: worker 0 (the engine) runs the last stage."""
    m = meta(name, role, 2)
    m.pp_size, m.tp_size, m.rank_kv = 2, 1, stages
    return m


async def test_a_pp2_decode_pulls_each_stages_layers_into_that_stages_worker() -> None:
    workers = [Worker(), Worker()]  # worker 0: stage 1 (layers 2-3), worker 1: stage 0
    peers = InstancePeers(pp2("d", InstanceRole.DECODE, [[0, 2, 0, 2], [2, 4, 0, 2]]),
                          Engines(), workers)
    prefill = meta("p", InstanceRole.PREFILL, 2)
    prefill.rank_kv = [[0, 4, 0, 1], [0, 4, 1, 2]]  # TP 2: a KV head each
    await peers.link_cluster(PeerLink("p", prefill.cluster_ids, prefill.addrs, prefill))
    for w in workers:  # each stage reads both prefill ranks; the pools' layers not compared
        (op, link), = w.calls
        assert (op, link.addrs, link.meta.transfer_keys) == ("link", ["p-t0", "p-t1"],
                                                              ["p-k0", "p-k1"])
        assert link.meta.num_layers == link.meta.num_kv_heads == 0
        w.calls.clear()
    await peers.pull_kv(KVMove("r4", 200, "p-t0", [1, 2], [5, 6]))
    # (src_head, dst_head, heads, src_layer, dst_layer, layers): the prefill pools hold
    # every layer, each stage's pool starts at its first
    assert sorted((m.addr, heads) for _, m, heads in workers[1].calls) == [
        ("p-t0", (0, 0, 1, 0, 0, 2)), ("p-t1", (0, 1, 1, 0, 0, 2))]
    assert sorted((m.addr, heads) for _, m, heads in workers[0].calls) == [
        ("p-t0", (0, 0, 1, 2, 0, 2)), ("p-t1", (0, 1, 1, 2, 0, 2))]


async def test_a_layout_that_cannot_be_planned_is_refused_at_link_before_any_worker_links(
        ) -> None:
    workers = [Worker(), Worker()]
    peers = InstancePeers(pp2("d", InstanceRole.DECODE, [[0, 2, 0, 2], [2, 4, 0, 2]]),
                          Engines(), workers)
    prefill = pp2("p", InstanceRole.PREFILL, [[0, 2, 0, 2], [2, 3, 0, 2]])  # 3 layers
    with pytest.raises(StatusError) as err:
        await peers.link_cluster(PeerLink("p", prefill.cluster_ids, prefill.addrs, prefill))
    assert err.value.status is Status.FAILED_PRECONDITION
    assert "no KV hand-over from p to d" in err.value.message
    assert "different layer counts: prefill 3, decode 4" in err.value.message
    assert workers[0].calls == workers[1].calls == []


async def test_a_hybrid_models_stages_pull_each_kv_groups_blocks_into_their_slots() -> None:
    """6 layers (sliding 0, 1: group 1; full 2, 5: group 0; sliding 3, 4: group 2), D PP 2
    (3, 3) from a TP 1 prefill: each stage a move per group it holds layers of, with that
    group's blocks of the hand-over (KVMove.group_blocks) and its pool's slots."""
    workers = [Worker(), Worker()]
    decode = pp2("d", InstanceRole.DECODE, [[0, 3, 0, 2], [3, 6, 0, 2]])
    peers = InstancePeers(decode, Engines(), workers, layer_windows=(6, 6, 0, 6, 6, 0))
    prefill = meta("p", InstanceRole.PREFILL, 1)
    prefill.rank_kv = [[0, 6, 0, 2]]
    await peers.link_cluster(PeerLink("p", prefill.cluster_ids, prefill.addrs, prefill))
    for w in workers:
        w.calls.clear()
    await peers.pull_kv(KVMove("r5", 100, "p-t0", [1, 2, 3, 4, 5], [11, 12, 13, 14, 15],
                               group_blocks=(3, 1, 1)))
    got = [[(m.src_blocks, m.dst_blocks, heads) for _, m, heads in w.calls] for w in workers]
    assert got[1] == [([1, 2, 3], [11, 12, 13], (0, 0, 2, 0, 0, 1)),  # layer 2: slot 0
                      ([4], [14], (0, 0, 2, 0, 0, 2))]  # layers 0, 1
    assert got[0] == [([1, 2, 3], [11, 12, 13], (0, 0, 2, 1, 1, 1)),  # layer 5: slot 1
                      ([5], [15], (0, 0, 2, 0, 0, 2))]  # layers 3, 4
    for w in workers:
        w.calls.clear()
    await peers.pull_kv(KVMove("r6", 100, "p-t0", [7], [17], group_blocks=(1,)))  # group 0's
    assert [len(w.calls) for w in workers] == [1, 1]
    with pytest.raises(StatusError) as err:  # which blocks are whose is not known
        await peers.pull_kv(KVMove("r7", 100, "p-t0", [1, 2], [3, 4]))
    assert err.value.status is Status.INTERNAL and "group sizes" in err.value.message
