"""The simulated engine: the real engine process (scheduler, block pool, prefix cache, PD
protocol, registration, heartbeats, drain, Generations) with the model forward replaced
by a time model measured from a real engine, and no torch. Many fit on one machine, to
test the master with a fleet (benchmarks/bench_fleet.py).

  time_model.py  TimeModel: step time from the batch; JSON profile load/save/fit
  profile.py     `python -m xllm_py.sim.profile`: measure a real engine, write a profile
  runner.py      SimulatedRunner / SimulatedSampler: the ModelRunner and Sampler seams
  storage.py     SimKVStorage: a small payload per KV block (numpy)
  transfer.py    SimKVTransferBackend: moves that payload between engines over TCP
  engine.py      SimulatedEngine: LLMEngine over the pieces above
  host.py        `python -m xllm_py.sim.host`: several simulated engines in one process
  validate.py    `python -m xllm_py.sim.validate`: simulated vs real on one workload
"""
# The simulated engine's KV moves: registered with kv_transfer's factory (which does not
# know the simulator) whenever any part of the simulator is imported.
from xllm_py.sim import transfer  # noqa: F401
