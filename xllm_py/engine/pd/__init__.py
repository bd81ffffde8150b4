"""PD disaggregation on an engine (xLLM's DisaggPDScheduler and DisaggPDService).

  scheduler.py   DisaggPDScheduler: the facade ClusterNode builds for a PREFILL or DECODE role
  prefill.py     PrefillSide: queue -> dispatch to a decode -> prefill -> hand-over
  decode.py      DecodeSide: allocate -> take over -> pull -> decode; orphans, cancel
  links.py       Links: which peers are linked for KV transfer (prelink, LinkInstance)
  phases.py      PrefillPhase / DecodePhase: one state machine per side of a PD request
  peers.py       PDPeers: the RPCs made to other processes; grpc_peers.py: over gRPC
  messages.py    HandOver, Placement, KVMove, PeerLink (wire forms: xllm_py/rpc/pd.py)
  metrics.py     PDMetrics (prometheus_client)
  config.py      PDSchedulerConfig
  service.py     DisaggPDServicer: the DisaggPDService on every engine

Import the modules, not this package: it stays empty so that xllm_py.rpc.pd can use
messages.py without loading the engine.
"""
