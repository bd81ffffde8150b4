"""Which layers each pipeline rank holds (rank 0: the last stage), what is refused, and
the engine's flag and settings-file key."""
from __future__ import annotations

import dataclasses

import pytest

from xllm_py.config import EngineConfig, InstanceRole
from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.model.config import ModelConfig
from xllm_py.model.kv_layout import kv_layout, pp_layer_ranges, worker_rank
from xllm_py.model.tiny import ensure_tiny_model
from xllm_py.parallel.pipeline import pp_error, rank_layers, rank_of, stage_of


@pytest.fixture(scope="module")
def mc() -> ModelConfig:
    return ModelConfig.from_dir(ensure_tiny_model("tiny", with_weights=False))  # 4 layers


def test_rank_0_runs_the_last_stage_and_the_others_the_stages_before(mc):
    assert [stage_of(r, 3) for r in range(3)] == [2, 0, 1]
    assert [rank_of(s, 3) for s in range(3)] == [1, 2, 0]
    config = EngineConfig(model="tiny", pipeline_parallel_size=3, pp_layer_partition=(2, 1, 1))
    assert [rank_layers(config, mc, r) for r in range(3)] == [(3, 4), (0, 2), (2, 3)]
    assert rank_layers(EngineConfig(model="tiny"), mc, 0) == (0, 4)


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 3), (2, 2), (2, 3), (4, 2), (3, 4)])
def test_the_stage_a_process_runs_holds_the_kv_its_worker_is_sent(tp, pp):
    """A KV move addressed to a layout rank's worker (kv_layout.worker_rank) reaches the
    process that runs that rank's stage with its TP index (pipeline.stage_of)."""
    layout = kv_layout(12, 12, tp, pp)
    workers = [worker_rank(layout, i) for i in range(tp * pp)]
    assert sorted(workers) == list(range(tp * pp))
    for i, rank in enumerate(workers):
        stage, tp_rank = divmod(i, tp)
        assert stage_of(rank, pp, tp) == stage and rank % tp == tp_rank
        assert rank_of(stage, pp, tp, tp_rank) == rank
        assert layout.ranks[i].layers == pp_layer_ranges(12, pp)[stage]


def test_models_and_splits_the_stages_cannot_run_say_why(mc):
    two = EngineConfig(model="tiny", pipeline_parallel_size=2)
    assert pp_error(two, mc) is None
    hybrid = dataclasses.replace(mc, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                 sliding_window=64)
    assert pp_error(two, hybrid) is None  # stages of sliding layers, full ones, or both
    assert pp_error(dataclasses.replace(two, role=InstanceRole.PREFILL), hybrid) is None
    assert "into 5 stages" in pp_error(EngineConfig(model="tiny", pipeline_parallel_size=5), mc)


def test_the_flag_and_the_partition_in_the_settings_file(tmp_path):
    file = tmp_path / "s.yaml"
    file.write_text("pp_layer_partition: '3,1'\n")
    config = config_from_args(build_parser().parse_args(["--pp", "2", "--config", str(file)]))
    assert (config.pipeline_parallel_size, config.pp_layer_partition) == (2, (3, 1))
    file.write_text("pp_layer_partition: '3,0'\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pp", "2", "--config", str(file)])
