"""Workload generators: lengths in tokens, seeding, prefix sharing, JSONL parsing.

Tokenizers are built here with the `tokenizers` library: a word-level one (one token per
word, so lengths are exact) and a small byte-level BPE (merges, like real models).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve.bench.workloads import (
    HFCodec,
    LengthRange,
    WordCodec,
    WorkloadSpec,
    build_prompts,
    load_codec,
    random_text,
)

WORDS = [f"w{i}" for i in range(200)]


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    corpus = [
        " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta", "serve", "decode", "the"])
            for _ in range(30)
        )
        for _ in range(200)
    ]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


def test_length_range_parse() -> None:
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse(7) == LengthRange(7, 7)
    assert LengthRange.parse("64:256") == LengthRange(64, 256)
    assert LengthRange.parse("64-256") == LengthRange(64, 256)
    for bad in ("", "a", "0", "5:2", "1:2:3", "-3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)
    rng = random.Random(0)
    draws = [LengthRange(3, 5).sample(rng) for _ in range(300)]
    assert set(draws) == {3, 4, 5}


def test_random_fixed_lengths_exact(word_tokenizer: PreTrainedTokenizerFast) -> None:
    codec = HFCodec(word_tokenizer)
    spec = WorkloadSpec(kind="random", num_prompts=20, input_len="37", output_len="9", seed=1)
    prompts = build_prompts(spec, codec)
    assert len(prompts) == 20
    for p in prompts:
        assert p.prompt_len == 37 == len(word_tokenizer.encode(p.text, add_special_tokens=False))
        assert p.max_tokens == 9
        assert "[UNK]" not in p.text  # special tokens never sampled
    assert [p.text for p in prompts] == [p.text for p in build_prompts(spec, codec)]
    other = build_prompts(WorkloadSpec(num_prompts=20, input_len="37", seed=2), codec)
    assert [p.text for p in prompts] != [p.text for p in other]


def test_random_ranges_uniform(word_tokenizer: PreTrainedTokenizerFast) -> None:
    codec = HFCodec(word_tokenizer)
    spec = WorkloadSpec(num_prompts=400, input_len="10:20", output_len="1:4", seed=3)
    prompts = build_prompts(spec, codec)
    ins = [p.prompt_len for p in prompts]
    outs = [p.max_tokens for p in prompts]
    assert min(ins) >= 10 and max(ins) <= 20 and set(ins) == set(range(10, 21))
    assert set(outs) == {1, 2, 3, 4}
    # uniform on 11 values: each count ~ Binomial(400, 1/11), mean 36.4, sd 5.8
    assert all(abs(ins.count(v) - 400 / 11) < 5 * 5.8 for v in range(10, 21))


def test_bpe_lengths_close(bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    codec = HFCodec(bpe_tokenizer)
    rng = random.Random(5)
    for n in (1, 16, 100):
        text, got = random_text(codec, n, rng)
        assert got == len(codec.encode(text))
        assert abs(got - n) <= max(1, n // 20)


def test_sharegpt_lengths_lognormal(word_tokenizer: PreTrainedTokenizerFast) -> None:
    codec = HFCodec(word_tokenizer)
    spec = WorkloadSpec(kind="sharegpt", num_prompts=300, input_len="40", output_len="20")
    prompts = build_prompts(spec, codec)
    ins = sorted(p.prompt_len for p in prompts)
    outs = sorted(p.max_tokens for p in prompts)
    assert ins[0] >= 4 and ins[-1] <= 320 and outs[0] >= 1 and outs[-1] <= 80
    # the median of 300 lognormal draws lies near the given median (sd of the log-median
    # is ~ 1.25 sigma / sqrt(n) = 0.072 for the input), and the spread is wide
    assert 40 * 0.7 < ins[150] < 40 / 0.7
    assert 20 * 0.75 < outs[150] < 20 / 0.75
    assert ins[-1] > 3 * ins[0]
    with pytest.raises(ValueError, match="fixed lengths"):
        build_prompts(WorkloadSpec(kind="sharegpt", input_len="10:20"), codec)


@pytest.mark.parametrize("tok_name", ["word_tokenizer", "bpe_tokenizer"])
def test_prefix_groups_share_token_prefixes(tok_name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(tok_name)
    codec = HFCodec(tok)
    spec = WorkloadSpec(
        kind="prefix", num_prompts=24, prefix_len=48, num_prefixes=3, input_len="8", seed=4
    )
    prompts = build_prompts(spec, codec)
    groups = [p.group for p in prompts]
    assert sorted(g if g is not None else -1 for g in groups) == sorted([0, 1, 2] * 8)
    ids = [codec.encode(p.text) for p in prompts]

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for i in range(len(prompts)):
        for j in range(i + 1, len(prompts)):
            shared = common(ids[i], ids[j])
            if groups[i] == groups[j]:
                assert shared >= 46  # the whole prefix (give or take a merged edge token)
            else:
                assert shared < 10
    assert all(p.prompt_len == len(x) for p, x in zip(prompts, ids, strict=True))


def test_jsonl_prompts(tmp_path: Path, word_tokenizer: PreTrainedTokenizerFast) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "w1 w2 w3", "max_tokens": 5}, {"prompt": "w4 w5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    spec = WorkloadSpec(kind="jsonl", path=str(path), num_prompts=5, output_len="7")
    prompts = build_prompts(spec, HFCodec(word_tokenizer))
    assert [(p.text, p.prompt_len, p.max_tokens) for p in prompts[:2]] == [
        ("w1 w2 w3", 3, 5),
        ("w4 w5", 2, 7),
    ]
    assert [p.text for p in prompts] == ["w1 w2 w3", "w4 w5"] * 2 + ["w1 w2 w3"]


@pytest.mark.parametrize(
    ("content", "msg"),
    [
        ("not json\n", r"p\.jsonl:1: not valid JSON"),
        ('{"text": "x"}\n', r":1: expected an object"),
        ('{"prompt": "a"}\n{"prompt": "b", "max_tokens": 0}\n', r":2: \"max_tokens\""),
        ('{"prompt": "a", "max_tokens": true}\n', "max_tokens"),
        ("\n\n", "no prompts"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, content: str, msg: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=msg):
        build_prompts(WorkloadSpec(kind="jsonl", path=str(path)), WordCodec())


def test_spec_validation() -> None:
    for spec, msg in (
        (WorkloadSpec(kind="nope"), "unknown workload"),
        (WorkloadSpec(num_prompts=0), "number of prompts"),
        (WorkloadSpec(kind="jsonl"), "needs a path"),
        (WorkloadSpec(kind="jsonl", path="/nonexistent/x.jsonl"), "does not exist"),
        (WorkloadSpec(kind="prefix", num_prefixes=0), "num_prefixes"),
        (WorkloadSpec(input_len="x"), "input length"),
    ):
        with pytest.raises(ValueError, match=msg):
            build_prompts(spec, WordCodec())


def test_word_fallback_and_tokenizer_dir(
    tmp_path: Path, word_tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = build_prompts(WorkloadSpec(num_prompts=3, input_len="12"), load_codec(None))
    assert all(len(p.text.split()) == 12 == p.prompt_len for p in prompts)
    word_tokenizer.save_pretrained(tmp_path / "tok")
    codec = load_codec(str(tmp_path / "tok"))
    assert codec.encode("w3 w4") == word_tokenizer.encode("w3 w4", add_special_tokens=False)
    with pytest.raises(ValueError, match="not a directory"):
        load_codec(str(tmp_path / "missing"))


def test_chat_conversations_grow_and_share_system_prompts() -> None:
    codec = WordCodec()
    spec = WorkloadSpec(
        kind="chat",
        num_prompts=10,
        prefix_len=20,
        num_prefixes=2,
        num_turns=3,
        input_len="5",
        output_len="4",
        seed=1,
    )
    prompts = build_prompts(spec, codec)
    assert len(prompts) == 10
    conversations = 4  # ceil(10 / 3); round by round: turn 0 of all four, then turn 1...
    assert [p.group for p in prompts] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    for i, p in enumerate(prompts):
        later = prompts[i + conversations] if i + conversations < len(prompts) else None
        if later is not None:  # the next turn extends this prompt (plus an answer)
            assert later.text.startswith(p.text) and len(later.text) > len(p.text)
        assert p.max_tokens == 4
    system = [p.text.split("\n")[0] for p in prompts[:conversations]]
    assert system[0] == system[2] != system[1] == system[3]
    assert len(system[0].split()) == 20
    assert build_prompts(spec, codec)[5].text == prompts[5].text  # seeded
    with pytest.raises(ValueError, match="num_turns"):
        WorkloadSpec(kind="chat", num_turns=0).validate()
