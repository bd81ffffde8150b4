"""OutputProcessor: n / best_of grouping, stop strings across tokens, usage, migration."""
from __future__ import annotations

import pytest

from xllm_py.engine.output_processor import OutputProcessor, child_id
from xllm_py.model.tiny import ensure_tiny_model
from xllm_py.model.tokenizer import Tokenizer
from xllm_py.outputs import TokenLogprob


class Sink:
    def __init__(self) -> None:
        self.outputs = []

    def emit(self, out) -> None:
        self.outputs.append(out)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(ensure_tiny_model("tiny"))


def add(proc, sink, prompt, **kw):
    args = dict(n=1, best_of=1, stop=[], include_stop_str=False, skip_special_tokens=True,
                want_logprobs=False)
    args.update(kw)
    proc.add_parent("r", prompt, sink, **args)


def test_n_choices_grouped_with_usage(tok):
    proc, sink = OutputProcessor(tok), Sink()
    prompt = tok.encode("Hello", add_special_tokens=False)
    words = tok.encode(" the cat sat", add_special_tokens=False)
    add(proc, sink, prompt, n=2, best_of=2)
    deltas = [proc.process(child_id("r", i), words[:1], None, None, None, None) for i in (0, 1)]
    proc.emit_step(deltas, "r")
    deltas = [proc.process(child_id("r", i), words[1:], None, "length", None, None)
              for i in (0, 1)]
    proc.emit_step(deltas, "r")
    first, last = sink.outputs
    assert first.prompt_token_ids == prompt and last.prompt_token_ids is None
    assert [d.index for d in first.outputs] == [0, 1]
    assert last.finished and last.num_generated_tokens == 2 * len(words)
    assert last.num_prompt_tokens == len(prompt)
    text = "".join(o.outputs[0].text for o in sink.outputs)
    assert text == tok.decode(words)
    assert "r" not in proc  # finished parents are dropped


def test_stop_string_spanning_tokens(tok):
    proc, sink = OutputProcessor(tok), Sink()
    ids = tok.encode(" once upon a time there", add_special_tokens=False)
    full = tok.decode(ids)
    stop = full[3:9]  # crosses token boundaries
    add(proc, sink, [1, 2], stop=[stop])
    stopped = []
    for t in ids:
        d = proc.process(child_id("r", 0), [t], None, None, None,
                         lambda rid, s: stopped.append((rid, s)))
        proc.emit_step([d], "r")
        if d.finish_reason:
            break
    assert stopped == [(child_id("r", 0), stop)]
    assert "".join(o.outputs[0].text for o in sink.outputs) == full[: full.index(stop)]
    assert sink.outputs[-1].outputs[0].finish_reason == "stop"
    assert sink.outputs[-1].outputs[0].stop_reason == stop


def test_best_of_emits_the_most_likely_sequences(tok):
    proc, sink = OutputProcessor(tok), Sink()
    add(proc, sink, [1, 2], n=1, best_of=3)
    for i, lp in enumerate((-3.0, -0.5, -2.0)):
        d = proc.process(child_id("r", i), [10 + i], [TokenLogprob(10 + i, lp)], "length",
                         None, None)
        proc.emit_step([d], "r")
    (out,) = sink.outputs  # buffered until every sequence finished
    assert out.finished and [d.token_ids for d in out.outputs] == [[11]]
    assert out.outputs[0].index == 0 and out.outputs[0].logprobs is None


def test_migrated_request_reports_client_usage(tok):
    proc, sink = OutputProcessor(tok), Sink()
    add(proc, sink, [1, 2, 3, 4, 5], num_prompt_tokens=3, generated_offset=2)
    d = proc.process(child_id("r", 0), [7], None, "length", None, None)
    proc.emit_step([d], "r")
    (out,) = sink.outputs
    assert out.num_prompt_tokens == 3 and out.num_generated_tokens == 3
    assert out.prompt_token_ids is None  # the service already has the prompt


def test_failure_reaches_the_sink(tok):
    proc, sink = OutputProcessor(tok), Sink()
    add(proc, sink, [1, 2])
    proc.fail_parent("r", 502, "KV pull failed")
    (out,) = sink.outputs
    assert out.failed and out.error_code == 502 and out.finished


class FinalOnlySink(Sink):
    final_only = True


def test_final_only_sink_gets_the_first_tokens_then_one_merged_output(tok):
    proc, sink = OutputProcessor(tok), FinalOnlySink()
    words = tok.encode(" the cat sat on the mat", add_special_tokens=False)
    add(proc, sink, [1, 2], n=2, best_of=2, want_logprobs=True)
    for k, t in enumerate(words):
        end = "length" if k == len(words) - 1 else None
        deltas = [proc.process(child_id("r", i), [t], [TokenLogprob(t, -1.0)], end, None, None)
                  for i in (0, 1)]
        proc.emit_step(deltas, "r")
    first, last = sink.outputs  # nothing in between
    assert [d.token_ids for d in first.outputs] == [words[:1], words[:1]]
    assert first.prompt_token_ids == [1, 2] and not first.finished
    assert last.finished and [d.index for d in last.outputs] == [0, 1]
    for d in last.outputs:
        assert d.token_ids == words[1:]
        assert first.outputs[d.index].text + d.text == tok.decode(words)
        assert [lp.token_id for lp in d.logprobs] == words[1:]
        assert d.finish_reason == "length"
    assert last.num_generated_tokens == 2 * len(words)
    assert "r" not in proc


def test_final_only_sink_with_a_stop_string_and_a_failure(tok):
    proc, sink = OutputProcessor(tok), FinalOnlySink()
    ids = tok.encode(" once upon a time there", add_special_tokens=False)
    full = tok.decode(ids)
    stop = full[8:12]
    add(proc, sink, [1, 2], stop=[stop])
    for t in ids:
        d = proc.process(child_id("r", 0), [t], None, None, None, lambda rid, s: None)
        proc.emit_step([d], "r")
        if d.finish_reason:
            break
    assert len(sink.outputs) == 2
    assert "".join(o.outputs[0].text for o in sink.outputs) == full[: full.index(stop)]
    assert sink.outputs[-1].outputs[0].stop_reason == stop

    proc, sink = OutputProcessor(tok), FinalOnlySink()
    add(proc, sink, [1, 2])
    for t in ids[:3]:
        proc.emit_step([proc.process(child_id("r", 0), [t], None, None, None, None)], "r")
    proc.fail_parent("r", 500, "boom")
    first, failed = sink.outputs  # the held deltas are dropped with the failure
    assert first.outputs[0].token_ids == ids[:1] and failed.failed and failed.finished


def _stream_text(proc, sink, ids) -> bool:
    """Feed ids one by one; True once a stop string ended the request."""
    for t in ids:
        d = proc.process(child_id("r", 0), [t], None, None, None, lambda rid, s: None)
        proc.emit_step([d], "r")
        if d is not None and d.finish_reason:
            return True
    return False


def test_migration_at_any_token_loses_no_text_and_keeps_stop_strings(tok):
    """A request resumed elsewhere (prompt + generated, generated_offset) continues the text
    exactly: characters split across tokens and a stop-string prefix held back when it
    moved are emitted, or stopped, on the new instance as they would have been."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(" naïve 日本語 😀 café, stop here and never after", add_special_tokens=False)
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    stop = "op he"  # spans tokens
    proc, sink = OutputProcessor(tok), Sink()
    add(proc, sink, prompt, stop=[stop])
    assert _stream_text(proc, sink, ids)
    reference = "".join(o.outputs[0].text for o in sink.outputs)
    assert reference.endswith("café, st")
    for cut in range(1, len(ids)):
        before, after = OutputProcessor(tok), OutputProcessor(tok)
        s1, s2 = Sink(), Sink()
        add(before, s1, prompt, stop=[stop])
        if _stream_text(before, s1, ids[:cut]):
            break  # stopped before the move
        add(after, s2, prompt + ids[:cut], stop=[stop], num_prompt_tokens=len(prompt),
            generated_offset=cut)
        assert _stream_text(after, s2, ids[cut:])
        text = "".join(o.outputs[0].text for o in s1.outputs + s2.outputs)
        assert text == reference, f"moved after token {cut}"


def _moved_text(tok, prompt, steps, cut, num_unread=None) -> str:
    """Text a client gets when a request is fed `steps` (lists of token ids, one step
    each) and moves to a new instance after the first `cut` steps."""
    before, after, s1, s2 = OutputProcessor(tok), OutputProcessor(tok), Sink(), Sink()
    add(before, s1, prompt)
    for step in steps[:cut]:
        before.emit_step([before.process(child_id("r", 0), step, None, None, None, None)], "r")
    generated = [t for step in steps[:cut] for t in step]
    add(after, s2, prompt + generated, num_prompt_tokens=len(prompt),
        generated_offset=len(generated), num_unread=num_unread)
    for k, step in enumerate(steps[cut:]):
        end = "length" if cut + k == len(steps) - 1 else None
        after.emit_step([after.process(child_id("r", 0), step, None, end, None, None)], "r")
    return "".join(o.outputs[0].text for o in s1.outputs + s2.outputs)


def test_migration_inside_a_long_run_of_held_back_tokens_loses_no_text(tok):
    """Invalid bytes keep the text ending in U+FFFD, so the old instance can hold back any
    number of tokens (not just the last few): all of them are emitted after the move."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(" ok", add_special_tokens=False) + [255] * 12 + tok.encode(
        " done é end", add_special_tokens=False)
    reference = tok.decode(ids)
    assert reference.count("\ufffd") == 12
    for cut in range(1, len(ids)):
        assert _moved_text(tok, prompt, [[t] for t in ids], cut) == reference, cut


def test_migration_after_a_multi_token_step_needs_the_unread_count(tok):
    """A step that makes "a" and half of "é" emits nothing; the text is whole after "a",
    so only the sender knows both tokens are unread (MultiGenerations num_unread_tokens)."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    a, e = tok.encode("a", add_special_tokens=False), tok.encode("é", add_special_tokens=False)
    assert len(a) == 1 and len(e) == 2
    steps = [tok.encode(" x", add_special_tokens=False), a + e[:1], e[1:],
             tok.encode(" y", add_special_tokens=False)]
    assert _moved_text(tok, prompt, steps, 2, num_unread=2) == " xaé y"
    assert _moved_text(tok, prompt, steps, 1, num_unread=0) == " xaé y"
    assert _moved_text(tok, prompt, steps, 3, num_unread=0) == " xaé y"


def _entries(first: int, tokens: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 * (first + i), [(t, -0.5 * (first + i))])
            for i, t in enumerate(tokens)]


def test_prompt_logprobs_go_out_once_with_the_first_output(tok):
    proc, sink = OutputProcessor(tok), Sink()
    prompt = [11, 12, 13, 14, 15]
    add(proc, sink, prompt, want_prompt_logprobs=True)
    rid = child_id("r", 0)
    proc.add_prompt_logprobs(rid, 1, _entries(1, prompt[1:3]))  # two prefill chunks
    proc.add_prompt_logprobs(rid, 3, _entries(3, prompt[3:]))
    with pytest.raises(ValueError, match="outside the prompt"):
        proc.add_prompt_logprobs(rid, 4, _entries(4, [1, 2]))
    proc.emit_step([proc.process(rid, [20], None, None, None, None)], "r")
    proc.emit_step([proc.process(rid, [21], None, "length", None, None)], "r")
    first, last = sink.outputs
    assert first.prompt_logprobs == [None] + _entries(1, prompt[1:])
    assert last.prompt_logprobs is None


def test_prompt_logprobs_of_a_scoring_request_with_n_2_and_no_tokens(tok):
    proc, sink = OutputProcessor(tok), Sink()
    prompt = [11, 12, 13]
    add(proc, sink, prompt, n=2, best_of=2, want_prompt_logprobs=True)
    for i in (0, 1):
        proc.add_prompt_logprobs(child_id("r", i), 1, _entries(1, prompt[1:]))
    # max_tokens 0: each sequence ends after its prefill with no token
    deltas = [proc.process(child_id("r", i), [], None, "length", None, None) for i in (0, 1)]
    proc.emit_step(deltas, "r")
    (out,) = sink.outputs
    assert out.finished and out.num_generated_tokens == 0
    assert [(d.index, d.token_ids, d.text, d.finish_reason) for d in out.outputs] == [
        (0, [], "", "length"), (1, [], "", "length")]
    assert out.prompt_logprobs == [None] + _entries(1, prompt[1:])


def test_no_prompt_logprobs_unless_wanted(tok):
    proc, sink = OutputProcessor(tok), Sink()
    add(proc, sink, [11, 12, 13])
    proc.add_prompt_logprobs(child_id("r", 0), 1, _entries(1, [12, 13]))  # ignored
    proc.emit_step([proc.process(child_id("r", 0), [20], None, "length", None, None)], "r")
    assert sink.outputs[0].prompt_logprobs is None


def test_a_stop_string_ends_a_speculative_steps_tokens_where_it_ends(tok):
    """Several tokens in one step: those after the one completing the stop string are
    neither emitted nor counted (nor their logprobs), as if they came one a step."""
    words = tok.encode(" the cat sat on the mat", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.5 * i) for i, t in enumerate(words)]
    outs = {}
    for per_step in (1, len(words)):
        proc, sink = OutputProcessor(tok), Sink()
        add(proc, sink, tok.encode("Hi", add_special_tokens=False), stop=["sat"],
            want_logprobs=True)
        rid = child_id("r", 0)
        for i in range(0, len(words), per_step):
            delta = proc.process(rid, words[i:i + per_step], lps[i:i + per_step], None, None,
                                 lambda *a: None)
            proc.emit_step([delta], "r")
            if delta.finish_reason is not None:
                break
        final = sink.outputs[-1]
        outs[per_step] = ("".join(d.text for o in sink.outputs for d in o.outputs),
                          [t for o in sink.outputs for d in o.outputs for t in d.token_ids],
                          final.outputs[0].finish_reason, final.num_generated_tokens,
                          [lp for o in sink.outputs for d in o.outputs for lp in d.logprobs])
    assert outs[1] == outs[len(words)]
    assert outs[1][0] == " the cat " and outs[1][2] == "stop"
    assert outs[1][3] == len(outs[1][1]) < len(words)
    assert outs[1][4] == lps[:len(outs[1][1])]
