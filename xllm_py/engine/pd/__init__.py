"""PD disaggregation on an engine (xLLM's DisaggPDScheduler and DisaggPDService).

  scheduler.py   DisaggPDScheduler: the facade ClusterNode builds for a PREFILL or DECODE role
  prefill.py     PrefillSide: queue -> dispatch to a decode -> prefill -> hand-over
  decode.py      DecodeSide: allocate -> take over -> pull -> decode; orphans, cancel
  links.py       Links: which peers are linked for KV transfer (prelink, LinkInstance)
  connector.py   PDConnector: the engine's KV connector, the PD code's only way to the engine
  phases.py      the PD records of a request; their phases are RequestStatus values
  peers.py       PDPeers: the RPCs made to other processes; xllm_py/rpc/pd_peers.py: over gRPC
  metrics.py     PDMetrics (prometheus_client)
  config.py      PDSchedulerConfig
  service.py     DisaggPDServicer: the DisaggPDService on every engine

The messages the PD code exchanges with peers (HandOver, Placement, KVMove, PeerLink)
are domain types in xllm_py/pd_messages.py, below the engine, so that the wire layer
(xllm_py/rpc/pd.py) and TP (xllm_py/parallel/) use them without importing the engine.
"""
