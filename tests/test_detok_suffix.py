"""A request's detokenizer primed with its prompt's last tokens streams the text vLLM's whole-prompt priming does, and
never the prompt itself.

vLLM decodes each request's whole prompt on its first token (hybrid_pd/connector/vllm/detok_suffix.py; 3.85 ms at
8,000 prompt tokens on an H100, docs/performance.md); our plugin primes the stream with the last tokens instead. The
fix is only worth having if no streamed text changes: checked here against vLLM's own detokenizer, and for the
tokenizers' decoders our models and the families' published ones use (byte-level BPE; Metaspace, SentencePiece-like),
on text prompts in several scripts and on random ids, special tokens skipped or not. One change is meant: where the
prompt's text ends in U+FFFD, vLLM's stream repeats the whole prompt with the first token; ours gives what vLLM's gives
less that repeat.
"""

from __future__ import annotations

import os
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybrid_pd.connector.vllm import detok_suffix
from hybrid_pd.default_model import ensure_default_model

_SCRIPTS = ["abcdefghijklmnopqrstuvwxyz", "äöüßéèêàçñ", "абвгдежзий", "的一是不了人我在有他", "😀🚀🎉👍🔥", "0123456789", " .,;:!?-\n"]


def _text(rng: random.Random, chars: int) -> str:
    words = ("".join(rng.choice(rng.choice(_SCRIPTS)) for _ in range(rng.randint(1, 8))) for _ in range(chars // 4 + 1))
    return " ".join(words)[:chars]


def _trained(kind: str) -> tokenizers.Tokenizer:
    """A small tokenizer of the decoder family ``kind``, trained here (no hub): byte-level BPE or Metaspace BPE."""
    rng = random.Random(7)
    if kind == "byte-level":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"])
    else:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([_text(rng, 400) for _ in range(300)], trainer)
    return tok


def _tokenizer(kind: str) -> tokenizers.Tokenizer:
    if kind == "ours":
        return tokenizers.Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
    return _trained(kind)


def _prompts(tok: tokenizers.Tokenizer, rng: random.Random, n: int):
    """(prompt ids, skip special tokens): text of several scripts cut anywhere, and random ids (special ones among them)."""
    for i in range(n):
        if i % 3:
            ids = tok.encode(_text(rng, rng.choice([40, 300, 2000]))).ids
        else:
            ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.choice([30, 200, 1000]))]
        yield ids, bool(i % 2)


def _deltas(stream, tok: tokenizers.Tokenizer, generated: list[int]) -> list[str | None]:
    out = []
    for token in generated:
        try:
            out.append(stream.step(tok, token))
        except Exception as e:  # vLLM resets the stream on this error; what matters is that both raise it alike
            out.append(f"{type(e).__name__}: {e}")
    return out


def _unrepeated(whole: list[str | None], prompt_text: str) -> list[str | None]:
    """A stream's texts with the prompt's own text cut from the first (what vLLM's stream repeats after a U+FFFD end)."""
    first = next((i for i, text in enumerate(whole) if text is not None and not text.startswith(("OverflowError", "Exception"))), None)
    if first is None:
        return whole
    text = whole[first]
    return [*whole[:first], text[len(os.path.commonprefix([text, prompt_text])) :], *whole[first + 1 :]]


@pytest.mark.parametrize("kind", ["ours", "byte-level", "metaspace"])
def test_a_stream_primed_as_priming_says_emits_what_one_primed_with_the_whole_prompt_does_less_a_repeated_prompt(kind):
    tok, rng = _tokenizer(kind), random.Random(kind)
    primed = unrepeated = 0
    for ids, skip in _prompts(tok, rng, 600):
        how = detok_suffix.priming(tok, ids, skip)
        if how is None:
            continue
        primed += 1
        generated = [rng.randrange(tok.get_vocab_size()) for _ in range(24)]
        whole = _deltas(tokenizers.decoders.DecodeStream(ids=ids, skip_special_tokens=skip), tok, generated)
        if how.said is not None:  # vLLM's stream repeats the prompt: the reference is its texts less the prompt's
            unrepeated += 1
            whole = _unrepeated(whole, tok.decode(ids, skip_special_tokens=skip))
        assert _deltas(how.stream(skip), tok, generated) == whole, (ids[-30:], generated)
    assert primed > 300  # most prompts take the suffix: the comparison covers them, not only the fallbacks
    assert unrepeated > 10 or kind == "metaspace"  # and the prompts whose text ends in U+FFFD (none from a BPE of whole characters)


def test_priming_keeps_the_whole_prompt_only_where_nothing_is_saved_or_the_suffix_says_nothing():
    tok = _tokenizer("ours")
    text_ids = tok.encode(_text(random.Random(1), 500)).ids
    assert detok_suffix.priming(tok, text_ids, True) == detok_suffix.Priming(text_ids[-detok_suffix.SUFFIX_TOKENS :])
    assert detok_suffix.priming(tok, text_ids[: detok_suffix.SUFFIX_TOKENS], True) is None  # nothing to save
    broken = tok.encode("an emoji 🚀").ids[:-1]  # the prompt ends inside the emoji's bytes
    how = detok_suffix.priming(tok, text_ids + broken, True)
    assert how.ids == (text_ids + broken)[-detok_suffix.SUFFIX_TOKENS :] and how.said.endswith("\ufffd")
    short = tok.encode("beads \ufffd").ids  # short, and its text ends in U+FFFD: still not repeated
    assert detok_suffix.priming(tok, short, True) == detok_suffix.Priming(short, tok.decode(short))


def test_a_prompt_whose_text_ends_in_a_replacement_character_is_not_streamed_back_with_the_first_token():
    """vLLM's own stream holds back text that ends in U+FFFD, so primed with such a prompt its first token's text is the
    whole prompt's; ours is the token's."""
    tok = _tokenizer("ours")
    for prompt in ("Question: Maya has 41 beads \ufffd", "\ufffd", "x" * 200 + " \ufffd"):
        ids, generated = tok.encode(prompt).ids, tok.encode(" Answer: 5").ids
        vllms = _deltas(tokenizers.decoders.DecodeStream(ids=ids, skip_special_tokens=True), tok, generated)
        assert vllms[0].startswith(prompt.strip())  # what vLLM 0.26 and 0.32 stream
        ours = _deltas(detok_suffix.priming(tok, ids, True).stream(True), tok, generated)
        assert "".join(t or "" for t in ours) == " Answer: 5"


def _vllm_stream(monkeypatch, prompt_ids: list[int], generated: list[int], skip: bool) -> tuple[list[str], list[int]]:
    """vLLM's detokenizer for a request: the text of each generated token, and the ids each stream it built was primed with."""
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    made, real = [], tokenizers.decoders.DecodeStream

    def recording(ids=None, skip_special_tokens=False):
        made.append(len(ids or ()))
        return real(ids=ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", recording)
    request = EngineCoreRequest("r", prompt_token_ids=prompt_ids, mm_features=None, sampling_params=SamplingParams(max_tokens=64, skip_special_tokens=skip),
                                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)  # fmt: skip
    detok = IncrementalDetokenizer.from_new_request(get_tokenizer(str(ensure_default_model())), request)
    texts = []
    for token in generated:
        detok.update([token], False)
        texts.append(detok.get_next_output_text(False, True))
    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", real)
    return texts, made


def test_vllms_detokenizer_primed_by_the_fix_streams_the_same_text_from_a_suffix_less_a_repeated_prompt(monkeypatch):
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", FastIncrementalDetokenizer.__init__)  # restored after the test
    tok, rng = _tokenizer("ours"), random.Random(3)
    cases = [(ids, skip, [rng.randrange(tok.get_vocab_size()) for _ in range(16)]) for ids, skip in _prompts(tok, rng, 60)]
    cases.append((tok.encode("Question: Maya has 41 beads \ufffd").ids, True, tok.encode(" Answer: 5").ids))
    stock = [_vllm_stream(monkeypatch, ids, generated, skip) for ids, skip, generated in cases]
    assert detok_suffix.probe() is not None  # this vLLM primes with the whole prompt
    detok_suffix.apply()
    assert detok_suffix.probe() is None  # applied once
    fixed = [_vllm_stream(monkeypatch, ids, generated, skip) for ids, skip, generated in cases]
    repeated = 0
    for (ids, skip, _), (stock_text, stock_made), (fixed_text, fixed_made) in zip(cases, stock, fixed):
        how = detok_suffix.priming(tok, ids, skip)
        if how is not None and how.said is not None:  # vLLM repeats the prompt in its first text; the fix does not
            repeated += 1
            stock_text = [t or "" for t in _unrepeated([t or None for t in stock_text], tok.decode(ids, skip_special_tokens=skip))]
        assert fixed_text == stock_text
        assert stock_made == [len(ids)]  # vLLM's own: the whole prompt
        assert fixed_made[-1] == (len(how.ids) if how is not None else len(ids))
    assert sum(made[-1] <= detok_suffix.SUFFIX_TOKENS for _, made in fixed) > len(cases) // 2
    assert repeated >= 1 and fixed[-1][0] == [" ", "Answer", ":", " ", "5"]
