"""PD disaggregation on an engine (what xLLM's DisaggPDScheduler and DisaggPDService do).

  role.py        PDRole: ClusterNode builds one for a PREFILL or DECODE: the role's side,
                 its links, connector and metrics, and their loops
  prefill.py     PrefillSide: queue -> dispatch to a decode -> prefill -> hand-over
  decode.py      DecodeSide: allocate -> take over -> pull -> decode; orphans, cancel
  links.py       Links: which peers are linked for KV transfer (prelink, LinkInstance)
  connector.py   PDConnector: the engine's KV connector, the PD code's only way to the engine
  phases.py      the PD records of a request; their phases are RequestStatus values
  peers.py       PDPeers: the RPCs made to other processes; xllm_py/rpc/pd_peers.py: over gRPC
  metrics.py     PDMetrics (prometheus_client)
  service.py     DisaggPDServicer: the DisaggPDService on every engine, which dispatches
                 to its role's handler (handlers.py: EngineHandler, PrefillHandler,
                 DecodeHandler)
  prefill_pacing.py  PrefillPacer: the prefill's online queue, its order and pacing

The messages the PD code exchanges with peers (HandOver, Placement, KVMove, PeerLink)
are domain types in xllm_py/pd_messages.py, below the engine, so that the wire layer
(xllm_py/rpc/pd.py) and TP (xllm_py/parallel/) use them without importing the engine.
"""
