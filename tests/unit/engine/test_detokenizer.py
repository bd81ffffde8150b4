"""IncrementalDetokenizer with a real byte-level BPE tokenizer; StopChecker across deltas."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xllm_py.engine.detokenizer import IncrementalDetokenizer, StopChecker

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tokenizer! 12345 and more ASCII text.",
    "café naïve résumé déjà vu über straße",
    "日本語のテキストを分割します。中文字符也可以。",
    "emoji: 😀 🎉 👍🏽 🚀 and the family 👨‍👩‍👧",
]
TEXTS = CORPUS + [
    "Ünïcödé mixed 漢字 with 🎉 emoji 🚀 and café",
    "新しい文章 😀😀 résumé",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def test_tokenizer_splits_multibyte_characters(tokenizer):
    ids = tokenizer.encode("日本語 😀").ids
    # Some single tokens are partial characters: the test below would be vacuous otherwise.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text).ids
    prompt = tokenizer.encode("Prompt: 中文").ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = stream(detok, ids, chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text
    assert "".join(deltas) == full
    assert detok.output_text == full
    assert detok.output_token_ids == ids
    assert all("\ufffd" not in d for d in deltas)


def test_prompt_ending_mid_character(tokenizer):
    ids = tokenizer.encode("x😀y").ids
    # Split inside the emoji: the prompt ends with a partial character.
    cut = next(i for i in range(1, len(ids))
               if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    rest = ids[cut:]
    assert "".join(stream(detok, rest)) == tokenizer.decode(rest)


def test_incomplete_character_held_until_flush(tokenizer):
    ids = tokenizer.encode("ab😀").ids
    partial = ids[:-1]
    assert tokenizer.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add_tokens([i]) for i in partial]
    assert "".join(deltas) == "ab"
    # The request ends on half a character: flush releases what decode() gives.
    assert "ab" + detok.flush() == tokenizer.decode(partial)


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode("café").ids + [eos] + tokenizer.encode(" 漢字").ids
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "café<|endoftext|> 漢字"
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(stream(skipped, ids)) == "café 漢字"


def test_special_tokens_in_prompt_context(tokenizer):
    im_start = tokenizer.token_to_id("<|im_start|>")
    prompt = tokenizer.encode("user").ids + [im_start]
    ids = tokenizer.encode("日本").ids
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        assert "".join(stream(detok, ids)) == "日本"


def test_bad_tokenizer_raises():
    with pytest.raises(ValueError, match="decode"):
        IncrementalDetokenizer(object(), [])


def run_stop(checker: StopChecker, deltas: list[str]) -> tuple[str, str | None]:
    out = []
    for d in deltas:
        text, matched = checker.add(d)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    out.append(checker.flush())
    return "".join(out), None


def test_stop_string_across_deltas():
    checker = StopChecker(["STOP"])
    assert checker.add("hello S") == ("hello ", None)
    assert checker.add("T") == ("", None)
    assert checker.add("OP and more") == ("", "STOP")
    assert checker.stopped and checker.stop_reason == "STOP"
    assert checker.add("later") == ("", None)
    assert checker.flush() == ""


def test_include_stop_str_in_output():
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert run_stop(checker, ["abc ST", "OPdef"]) == ("abc STOP", "STOP")


def test_false_start_is_released():
    checker = StopChecker(["</end>"])
    assert checker.add("a </e") == ("a ", None)
    assert checker.add("x") == ("</ex", None)
    assert checker.add("</en") == ("", None)
    assert checker.flush() == "</en"


def test_hold_back_is_bounded():
    checker = StopChecker(["abcd"])
    text, matched = checker.add("zzzabc")
    assert (text, matched) == ("zzz", None)  # at most len("abcd") - 1 chars held


def test_stop_detection_is_independent_of_chunking():
    text = "one two <stop> three </s> four"
    stops = ["</s>", "two <st", "<stop>"]
    expected = ("one ", "two <st")
    for size in range(1, len(text) + 1):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert run_stop(StopChecker(stops), chunks) == expected


def test_earliest_completing_match_wins():
    # "bc" completes before "abcd" does.
    assert run_stop(StopChecker(["abcd", "bc"]), ["xabcd"]) == ("xa", "bc")
    # Same end: the longer one wins, so less text is emitted.
    assert run_stop(StopChecker(["cd", "abcd"]), ["xabcdy"]) == ("x", "abcd")


def test_no_stop_strings_passes_through():
    checker = StopChecker([])
    assert checker.add("anything") == ("anything", None)
    assert checker.flush() == ""


def test_bad_stop_strings_raise():
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker([""])
    with pytest.raises(ValueError, match="list"):
        StopChecker("STOP")


def test_detokenizer_and_stop_checker_together(tokenizer):
    text = "café 日本語 😀 STOP after"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, [])
    checker = StopChecker(["語 😀 ST"])
    emitted, matched = [], None
    for token_id in ids:
        out, matched = checker.add(detok.add_tokens([token_id]))
        emitted.append(out)
        if matched:
            break
    assert matched == "語 😀 ST"
    assert "".join(emitted) == "café 日本"
