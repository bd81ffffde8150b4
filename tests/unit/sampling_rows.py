"""`srow(**kw)`: a sampler row from SamplingParams' keywords and the row's history ones."""
from xllm_py.engine.sampler import SamplingRow
from xllm_py.sampling_params import SamplingParams

_HISTORY = ("num_output_tokens_so_far", "output_token_ids", "prompt_token_ids")


def srow(**kw) -> SamplingRow:
    history = {name: kw.pop(name) for name in _HISTORY if name in kw}
    return SamplingRow(SamplingParams(**kw), **history)
