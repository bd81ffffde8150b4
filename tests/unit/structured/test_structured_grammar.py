"""Grammars and matchers (llguidance) on the tiny model's vocabulary, and the token mask
the sampler applies: the mask allows exactly what the matcher accepts, greedy and
sampled rows only ever pick an allowed token, rows without a constraint are untouched,
logprobs stay of the raw logits."""
import json

import numpy as np
import pytest
import torch

from tests.unit.sampling_rows import srow
from xllm_py.engine.sampler import Sampler
from xllm_py.model.tiny import ensure_tiny_model
from xllm_py.model.tokenizer import Tokenizer
from xllm_py.structured import grammar
from xllm_py.structured.compiler import (
    GrammarCompiler, TokenMask, fill_bitmask, fill_guess_bitmask)
from xllm_py.structured.spec import GrammarSpec
from xllm_py.structured.token_mask import apply_token_mask

ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size", "ok"],
         "properties": {"color": {"enum": ["red", "green", "blue"]},
                        "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(ensure_tiny_model("tiny", with_weights=False))


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    yield c
    c.close()


def _allowed(bitmask_row, vocab):
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.nonzero(bits)[0].tolist())


@pytest.mark.parametrize("spec,problem", [
    (GrammarSpec.json_schema(ENUMS), None),
    (GrammarSpec("json_object"), None),
    (GrammarSpec("regex", r"\d{3}"), None),
    (GrammarSpec.choices(['a "q"', "back\\slash", "new\nline"]), None),
    (GrammarSpec("grammar", 'start: "yes" | "no"'), None),
    (GrammarSpec("grammar", 'root ::= "a" | "b"'), None),
    (GrammarSpec("regex", "(ab"), "unclosed group"),
    (GrammarSpec("grammar", "start: foo"), "foo"),
    (GrammarSpec("json", '{"type": "objectx"}'), "objectx"),
    (GrammarSpec("json", "[1]"), "must be an object"),
    (GrammarSpec("choice", '["a", 3]'), "strings"),
])
def test_check_names_the_problem(spec, problem):
    found = grammar.check(spec)
    assert (found is None) if problem is None else (problem in found), found
    assert grammar.is_checked(spec)


def test_choices_with_special_characters_match_exactly(tok, compiler):
    options = ['a "q"', "back\\slash", "ünï", "new\nline", "x|y(z)*"]
    spec = GrammarSpec.choices(options)
    for option in options:
        g = compiler.matcher(spec)
        assert g.advance(tok.encode(option, add_special_tokens=False)) and not g.problem
    g = compiler.matcher(spec)
    assert g.advance(tok.encode("nope", add_special_tokens=False)) and g.problem


def _walk(tok, compiler, spec, seed, limit=400):
    """A random walk over allowed tokens (what a random-weight model does)."""
    g = compiler.matcher(spec)
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, (compiler.ll_tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    tokens = []
    while not g.stopped and len(tokens) < limit:
        fill_bitmask(compiler, [g], bitmask)
        token = int(rng.choice(sorted(_allowed(bitmask[0], tok.vocab_size))))
        assert not g.advance([token]) or not g.problem
        tokens.append(token)
    return tokens


def test_whitespace_is_bounded_under_an_enum_schema(tok, compiler):
    for seed in range(6):
        tokens = _walk(tok, compiler, GrammarSpec.json_schema(ENUMS), seed)
        assert len(tokens) <= 80, len(tokens)
        value = json.loads(tok.decode(tokens))
        assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    compact = _walk(tok, compiler, GrammarSpec.json_schema(ENUMS, ""), 0)
    assert " " not in tok.decode(compact) and "\n" not in tok.decode(compact)


def test_tool_call_grammars_are_compact_json(tok, compiler):
    """tool_choice required / named: no free whitespace for a weak model to wander in."""
    from xllm_py.api.tool_choice import tool_request

    tools = [{"type": "function", "function": {"name": "pick", "parameters": ENUMS}}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        spec = tool_request(tools, choice, False).grammar()
        for seed in range(4):
            text = tok.decode(_walk(tok, compiler, spec, seed))
            assert " " not in text and "\n" not in text, text
            value = json.loads(text)
            args = value[0]["parameters"] if choice == "required" else value
            assert args["color"] in ("red", "green", "blue")


def test_bitmask_of_a_batch_matches_each_matcher_alone(tok, compiler):
    specs = [GrammarSpec.json_schema(ENUMS), GrammarSpec("regex", "[0-9]+"),
             GrammarSpec.choices(["yes", "no"])]
    grammars = [compiler.matcher(s) for s in specs]
    words = (compiler.ll_tokenizer.vocab_size + 31) // 32
    batch = np.zeros((3, words), dtype=np.int32)
    fill_bitmask(compiler, grammars, batch)
    for i, g in enumerate(grammars):
        alone = np.zeros((1, words), dtype=np.int32)
        fill_bitmask(compiler, [g], alone)
        assert (alone[0] == batch[i]).all()
    digits = _allowed(batch[1], tok.vocab_size)
    assert digits and all(tok.decode([t]).isdigit() for t in digits)


def test_guesses_are_cut_where_the_grammar_refuses_or_completes(tok, compiler):
    """num_guessable: the guesses the grammar takes one after another, none completing it
    (the token that does is left to the model's own row); the matcher as it was after."""
    g = compiler.matcher(GrammarSpec("regex", r"\d{3}"))
    digits = tok.encode("123", add_special_tokens=False)
    letter = tok.encode("a", add_special_tokens=False)
    assert len(digits) == 3
    assert g.num_guessable(digits[:2] + letter) == 2
    assert g.num_guessable(letter + digits) == 0
    assert g.num_guessable(digits) == 2  # the third completes \d{3}
    g.advance(digits[:1])
    assert g.num_guessable(digits[1:]) == 1
    assert not g.advance(digits[1:2]) and g.advance(digits[2:]) and not g.problem


def test_guess_masks_are_each_guess_state_and_the_matcher_is_restored(tok, compiler):
    """The mask at guess j is the mask of a matcher advanced over guesses[:j + 1];
    EngineGrammars.mask puts them after the rows at the last tokens."""
    from xllm_py.engine.grammars import EngineGrammars
    from xllm_py.request import Request
    from xllm_py.sampling_params import SamplingParams

    spec = GrammarSpec.json_schema(ENUMS)
    guesses = tok.encode('{"color": "re', add_special_tokens=False)
    words = (compiler.ll_tokenizer.vocab_size + 31) // 32
    g = compiler.matcher(spec)
    assert g.num_guessable(guesses) == len(guesses)
    masks = np.zeros((len(guesses), words), dtype=np.int32)
    fill_guess_bitmask(g, guesses, masks)
    for j in range(len(guesses)):
        walked = compiler.matcher(spec)
        walked.advance(guesses[:j + 1])
        alone = np.zeros((1, words), dtype=np.int32)
        fill_bitmask(compiler, [walked], alone)
        assert (alone[0] == masks[j]).all(), j
    start = np.zeros((1, words), dtype=np.int32)
    fill_bitmask(compiler, [g], start)  # g was not advanced: the mask at "{" again
    assert _allowed(start[0], tok.vocab_size) != _allowed(masks[0], tok.vocab_size)
    fresh = np.zeros((1, words), dtype=np.int32)
    fill_bitmask(compiler, [compiler.matcher(spec)], fresh)
    assert (start == fresh).all()

    grammars = EngineGrammars(tok, tok.vocab_size, tok.eos_token_ids)
    free, bound = (Request(r, [1], SamplingParams()) for r in ("free", "bound"))
    assert grammars.attach([bound], spec) is None
    mask = grammars.mask([free, bound], [(free, [5, 6]), (bound, guesses[:2])])
    assert mask.rows == [1, 4, 5]  # bound's last token, then its two guess rows
    assert (mask.bitmask[0] == start[0]).all() and (mask.bitmask[1:3] == masks[:2]).all()
    assert grammars.mask([free], [(free, [5, 6])]) is None
    grammars.close()


def test_mask_blocks_exactly_the_disallowed_tokens_of_constrained_rows():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab)
    bitmask = np.zeros((1, 3), dtype=np.int32)
    allowed = {0, 31, 32, 69}
    for t in allowed:
        bitmask[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    out = apply_token_mask(logits.clone(), TokenMask([1], bitmask))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist())
    assert finite == allowed


def test_device_unpack_equals_the_cpu_unpack():
    """The GPU path's shifts (run here on the CPU) read the bitmask as numpy does."""
    from xllm_py.structured.token_mask import blocked_cpu, blocked_on_device

    bits = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(3, 5), dtype=np.int32)
    assert torch.equal(blocked_cpu(bits), blocked_on_device(bits, torch.device("cpu")))


def test_sampler_picks_only_allowed_tokens_greedy_and_sampled_with_raw_logprobs():
    torch.manual_seed(1)
    vocab = 100
    logits = torch.randn(4, vocab)
    raw = logits.clone()
    bitmask = np.zeros((2, 4), dtype=np.int32)
    bitmask[0, 1] = 1 << 3  # token 35
    bitmask[1, 2] = 0b110  # tokens 65, 66
    rows = [srow(temperature=0.0), srow(temperature=0.0, logprobs=2),
            srow(temperature=1.0, seed=3), srow(temperature=1.0, seed=4)]
    mask = TokenMask([1, 2], bitmask)
    out = Sampler(seed=0)(logits, rows, mask)
    assert out.token_ids[0] == int(raw[0].argmax())
    assert out.token_ids[1] == 35 and out.token_ids[2] in (65, 66)
    expected = torch.log_softmax(raw[1], dim=-1)[35].item()
    assert out.logprobs[1].logprob == pytest.approx(expected)
    assert out.logprobs[1].top[0][0] == int(raw[1].argmax())  # top-k of the raw logits
    for _ in range(20):  # sampled rows under the mask, many draws
        out = Sampler()(raw[:2].clone(), [srow(temperature=2.0)] * 2,
                        TokenMask([0, 1], bitmask))
        assert out.token_ids[0] == 35 and out.token_ids[1] in (65, 66)
    with torch.inference_mode():  # the model's logits are inference tensors
        logits = raw[:2].clone()
    for rows in ([srow(temperature=0.0)] * 2,  # the greedy hot path: in place
                 [srow(temperature=0.0, logprobs=0)] * 2):
        out = Sampler()(logits, rows, TokenMask([1], bitmask[:1]))
        assert out.token_ids == [int(raw[0].argmax()), 35]


def test_masked_greedy_keeps_allowed_picks_and_redoes_the_others():
    from xllm_py.structured.token_mask import masked_greedy

    torch.manual_seed(2)
    logits = torch.randn(3, 64)
    picks = logits.argmax(dim=-1).tolist()
    bitmask = np.zeros((2, 2), dtype=np.int32)
    for t in (picks[0], 7):  # row 0: its own pick allowed, and another token
        bitmask[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    other = (picks[2] + 1) % 64  # row 2: only a token that is not its pick
    bitmask[1, other // 32] |= np.int32(np.uint32(1 << (other % 32)).view(np.int32))
    out = masked_greedy(logits, picks, TokenMask([0, 2], bitmask))
    assert out == [picks[0], picks[1], other]
    full = apply_token_mask(logits.clone(), TokenMask([0, 2], bitmask)).argmax(dim=-1).tolist()
    assert out == full
    # rows that allow few tokens (a gather) and many (masked whole), ties included
    rng = np.random.default_rng(3)
    vocab = 4096
    logits = torch.from_numpy(rng.integers(0, 4, size=(6, vocab)).astype(np.float32))
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(6, vocab // 32), dtype=np.int32)
    bitmask[:3, 4:] = 0  # rows 0-2: four words allowed at most
    picks = logits.argmax(dim=-1).tolist()
    mask = TokenMask(list(range(6)), bitmask)
    full = apply_token_mask(logits.clone(), mask).argmax(dim=-1).tolist()
    assert masked_greedy(logits, picks, mask) == full
