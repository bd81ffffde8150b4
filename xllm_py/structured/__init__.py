"""Structured outputs: a request's grammar (spec.py, pure Python), its
llguidance form and checks (grammar.py), the engine's compiled matchers (compiler.py) and
the token mask applied in the sampler (token_mask.py, torch)."""
