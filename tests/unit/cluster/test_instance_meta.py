import json

import pytest

from xllm_py.cluster.instance_meta import SCHEMA_VERSION, InstanceMeta, InstanceMetaError
from xllm_py.config import InstanceRole


def make_meta(**overrides) -> InstanceMeta:
    fields = dict(
        name="127.0.0.1:9001",
        type=InstanceRole.DECODE,
        rpc_address="127.0.0.1:9101",
        cluster_ids=[11, 12],
        addrs=["127.0.0.1:7001", "127.0.0.1:7002"],
        ports=[7001, 7002],
        dp_size=1,
        incarnation_id="inc-1",
        register_ts_ms=1_700_000_000_000,
        kv_split_size=1,
        model="tiny-llama",
        block_size=16,
        kv_layout="2LNBHD",
        kv_dtype="float32",
        tp_size=2,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        num_blocks=512,
        http_address="127.0.0.1:9001",
        worker_rpc_addrs=["127.0.0.1:7101", "127.0.0.1:7102"],
        draining=True,
    )
    fields.update(overrides)
    return InstanceMeta(**fields)


def test_json_roundtrip_keeps_every_field():
    meta = make_meta()
    back = InstanceMeta.from_json(meta.to_json())
    assert back == meta
    data = json.loads(meta.to_json())
    assert data["type"] == "DECODE"
    assert data["schema_version"] == SCHEMA_VERSION


def test_json_unknown_keys_ignored_and_missing_optional_defaulted():
    data = {"name": "a:1", "type": "prefill", "from_the_future": {"x": 1}, "schema_version": 7}
    meta = InstanceMeta.from_json(json.dumps(data))
    assert meta.type is InstanceRole.PREFILL
    assert meta.schema_version == 7
    assert meta.dp_size == 1 and meta.tp_size == 1
    assert meta.cluster_ids == [] and meta.model == ""


def test_json_null_values_take_defaults_and_enum_number_accepted():
    meta = InstanceMeta.from_json(json.dumps({"name": "a:1", "type": 2, "dp_size": None, "ports": None}))
    assert meta.type is InstanceRole.DECODE
    assert meta.dp_size == 1 and meta.ports == []


@pytest.mark.parametrize("missing", ["name", "type"])
def test_json_missing_required_key_is_a_clear_error(missing):
    data = json.loads(make_meta().to_json())
    del data[missing]
    with pytest.raises(InstanceMetaError, match=missing):
        InstanceMeta.from_json(json.dumps(data))


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"name": "a:1", "type": "GPU"}', "unknown instance role"),
        ('{"name": "a:1", "type": "MIX", "block_size": "big"}', "block_size"),
        ('{"name": "a:1", "type": "MIX", "draining": "no"}', "draining"),
    ],
)
def test_json_bad_values_raise_instance_meta_error(text, match):
    with pytest.raises(InstanceMetaError, match=match):
        InstanceMeta.from_json(text)


def test_compatible_peers_have_no_problems():
    assert make_meta(tp_size=1).compatibility_problems(
        make_meta(name="b:2", type=InstanceRole.PREFILL, tp_size=1)) == []


def test_compatibility_problems_name_each_difference():
    a = make_meta(tp_size=1)
    b = make_meta(name="b:2", model="other", block_size=32, kv_dtype="bfloat16", num_kv_heads=8,
                  tp_size=1)
    problems = a.compatibility_problems(b)
    assert len(problems) == 4
    joined = "\n".join(problems)
    for field in ("model", "block_size", "kv_dtype", "num_kv_heads"):
        assert field in joined
    assert "'tiny-llama'" in joined and "'other'" in joined


@pytest.mark.parametrize("heads,ours,theirs,ok", [
    (2, 2, 1, True), (2, 1, 2, True), (2, 2, 2, True), (2, 4, 1, True), (6, 4, 2, False),
    (6, 2, 4, False), (6, 4, 4, False)])
def test_tensor_parallel_pairs_are_refused_only_when_heads_cannot_map(heads, ours, theirs, ok):
    problems = make_meta(tp_size=ours, num_kv_heads=heads).compatibility_problems(
        make_meta(name="b:2", tp_size=theirs, num_kv_heads=heads))
    if ok:
        assert problems == []
    else:
        assert len(problems) == 1
        assert f"(TP {theirs} x PP 1), decode 127.0.0.1:9001 (TP {ours} x PP 1)" in problems[0]
        assert "6 KV heads cannot be split over 4 ranks" in problems[0]


def rank_kv(layers, heads, tp, pp, partition=None):
    from xllm_py.model.kv_layout import kv_layout

    return [[*r.layers, *r.heads] for r in kv_layout(layers, heads, tp, pp, partition).ranks]


def test_registered_rank_spans_are_the_layout_and_survive_json_and_proto():
    from xllm_py.rpc.cluster import instance_meta_from_proto, instance_meta_to_proto

    meta = make_meta(tp_size=2, pp_size=2, rank_kv=rank_kv(6, 2, 2, 2, (4, 2)),
                     cluster_ids=[1, 2, 3, 4])
    assert meta.rank_layout().ranks[2].layers == (4, 6) and meta.rank_layout().num_layers == 6
    for back in (InstanceMeta.from_json(meta.to_json()),
                 instance_meta_from_proto(instance_meta_to_proto(meta))):
        assert (back.pp_size, back.rank_kv) == (2, meta.rank_kv)
    with pytest.raises(InstanceMetaError, match="4 integers"):
        InstanceMeta.from_json('{"name": "a", "type": "DECODE", "rank_kv": [[0, 1, 0]]}')


def test_a_pairing_whose_registered_layers_differ_is_refused_at_link_time():
    decode = make_meta(tp_size=1, pp_size=2, rank_kv=rank_kv(6, 2, 1, 2))
    assert decode.compatibility_problems(make_meta(
        name="b:2", type=InstanceRole.PREFILL, tp_size=2, rank_kv=rank_kv(6, 2, 2, 1))) == []
    problems = decode.compatibility_problems(make_meta(
        name="b:2", type=InstanceRole.PREFILL, tp_size=1, rank_kv=rank_kv(4, 2, 1, 1)))
    assert len(problems) == 1 and "different layer counts: prefill 4, decode 6" in problems[0]
    # a peer that registers no spans (an older writer): both sides as it sees them
    assert decode.compatibility_problems(make_meta(
        name="b:2", type=InstanceRole.PREFILL, tp_size=1, pp_size=1)) != []  # PP 2 vs pool
    tp_decode = make_meta(tp_size=2, num_layers=3, rank_kv=rank_kv(18, 2, 2, 1))  # 3 pool slots
    assert tp_decode.compatibility_problems(make_meta(
        name="b:2", type=InstanceRole.PREFILL, tp_size=1, num_layers=3)) == []


def test_compatibility_skips_fields_unknown_to_either_side():
    assert make_meta(tp_size=1).compatibility_problems(
        make_meta(name="b:2", model="", head_dim=0, tp_size=1)) == []


def test_with_new_incarnation_changes_id_and_time():
    meta = make_meta()
    fresh = meta.with_new_incarnation()
    assert fresh.incarnation_id != meta.incarnation_id and len(fresh.incarnation_id) == 32
    assert fresh.register_ts_ms > meta.register_ts_ms
    assert fresh.name == meta.name
