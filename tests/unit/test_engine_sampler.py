"""Sampler: exact masks on hand-made logits, penalty arithmetic, seeded draws that do not
depend on the batch, logprobs, and the logits-processor hook."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler, apply_penalties, filter_logits, position_seed

NEG_INF = float("-inf")
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def _kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != NEG_INF]


def _req(
    params: SamplingParams, seed: int = 0, prompt: list[int] | None = None, rid: str = "r"
) -> Request:
    return Request(rid, prompt or [1, 2, 3], params, effective_seed=seed)


# -- masks ---------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    assert _kept(filter_logits(logits, 2, 1.0, 0.0)) == [3, 4]
    assert _kept(filter_logits(logits, 1, 1.0, 0.0)) == [3]
    assert _kept(filter_logits(logits, 5, 1.0, 0.0)) == [0, 1, 2, 3, 4]
    assert _kept(filter_logits(logits, -1, 1.0, 0.0)) == [0, 1, 2, 3, 4]
    # Kept values are untouched.
    out = filter_logits(logits, 2, 1.0, 0.0)
    assert out[3].item() == 5.0 and out[4].item() == 4.0


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [0]), (0.6, [0, 1]), (0.75, [0, 1, 2]), (0.9, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3, 4])],
)
def test_top_p_nucleus(top_p: float, kept: list[int]) -> None:
    # A token stays if the mass of the tokens strictly before it is below top_p.
    assert _kept(filter_logits(_logits(PROBS), -1, top_p, 0.0)) == kept


def test_top_p_order_independent_of_vocab_position() -> None:
    shuffled = [PROBS[i] for i in (3, 0, 4, 2, 1)]  # vocab ids 0..4 hold these
    assert _kept(filter_logits(_logits(shuffled), -1, 0.75, 0.0)) == [1, 3, 4]


def test_top_k_then_top_p_renormalises() -> None:
    # top_k=3 leaves [.5,.2,.15] -> renormalised [.588,.235,.176]; mass before the third
    # is .823 >= .8, so top_p drops it (alone, top_p=.8 would keep three).
    assert _kept(filter_logits(_logits(PROBS), 3, 0.8, 0.0)) == [0, 1]
    assert _kept(filter_logits(_logits(PROBS), -1, 0.8, 0.0)) == [0, 1, 2]


@pytest.mark.parametrize(
    ("min_p", "kept"), [(0.35, [0, 1]), (0.25, [0, 1, 2]), (0.11, [0, 1, 2, 3])]
)
def test_min_p_relative_to_top_token(min_p: float, kept: list[int]) -> None:
    assert _kept(filter_logits(_logits(PROBS), -1, 1.0, min_p)) == kept


# -- penalties -----------------------------------------------------------------------------


def test_penalty_arithmetic() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    req = _req(params, prompt=[1, 2])
    for t in (2, 3, 3):
        req.append_output_token(t)
    logits = torch.tensor([1.0, 4.0, -2.0, 6.0, 3.0])
    out = apply_penalties(logits.clone(), req)
    # repetition over prompt+output {1,2,3}: positive / 2, negative * 2;
    # then frequency (count) and presence (seen) over the output only: 2 x1, 3 x2.
    expected = [1.0, 4.0 / 2, -2.0 * 2 - (0.25 * 1 + 0.5), 6.0 / 2 - (0.25 * 2 + 0.5), 3.0]
    assert out.tolist() == pytest.approx(expected)


def test_penalties_ignore_prompt_for_presence_and_frequency() -> None:
    req = _req(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt=[0, 1])
    logits = torch.zeros(3)
    assert apply_penalties(logits.clone(), req).tolist() == [0.0, 0.0, 0.0]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    plain = _req(SamplingParams(temperature=0.0), prompt=[1])
    penalised = _req(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[1])
    assert Sampler()(logits, [plain])[0].token_id == 1
    assert Sampler()(logits, [penalised])[0].token_id == 2


def test_logit_bias_moves_greedy_and_sampled_choices() -> None:
    """+100 makes a token certain, -100 rules the argmax out; the raw logits (and logprobs)
    are untouched, and the bias comes before temperature (a sampled row is pushed too)."""
    raw = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    forced = _req(SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 100.0}))
    banned = _req(SamplingParams(temperature=0.0, logit_bias={1: -100.0}), rid="b")
    sampled = _req(SamplingParams(temperature=2.0, logit_bias={0: 100.0}), seed=9, rid="s")
    tokens = Sampler()(torch.cat([raw, raw, raw]), [forced, banned, sampled])
    assert [t.token_id for t in tokens] == [3, 2, 0]
    assert tokens[0].logprob is not None
    assert tokens[0].logprob.logprob == pytest.approx(raw[0].log_softmax(-1)[3].item())
    assert raw.tolist() == [[0.0, 2.0, 1.5, 0.0]]


@pytest.mark.parametrize(
    ("bias", "message"),
    [({-1: 1.0}, "keys must be token ids"), ({2: 101.0}, r"\[-100, 100\]"), ({2: math.nan}, "100")],
)
def test_logit_bias_is_checked(bias: dict[int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


# -- seeded draws --------------------------------------------------------------------------


def test_seeded_draw_independent_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(6, vocab, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = Sampler()(logits[2:3], [_req(params, seed=1234)])[0].token_id
    batch = [
        _req(SamplingParams(temperature=0.0), rid="greedy"),
        _req(SamplingParams(temperature=1.3, top_k=5), seed=7, rid="other"),
        _req(params, seed=1234, rid="target"),
        _req(SamplingParams(temperature=0.5, min_p=0.1), seed=99, rid="x"),
        _req(SamplingParams(temperature=1.0, presence_penalty=1.0), seed=3, rid="y"),
        _req(SamplingParams(temperature=1.0, logprobs=2), seed=4, rid="z"),
    ]
    assert Sampler()(logits, batch)[2].token_id == alone
    # Same row in another position of a reversed batch: still the same token.
    assert Sampler()(logits[[3, 2]], [batch[3], batch[2]])[1].token_id == alone


def test_draw_depends_on_seed_and_position_only() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the draw is all noise
    params = SamplingParams(temperature=1.0)
    a = [Sampler()(logits, [_req(params, seed=5)])[0].token_id for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same position -> same token
    other_seed = Sampler()(logits, [_req(params, seed=6)])[0].token_id
    longer = _req(params, seed=5, prompt=[1, 2, 3, 4])  # position = num_tokens
    other_pos = Sampler()(logits, [longer])[0].token_id
    assert {a[0], other_seed, other_pos} != {a[0]}
    assert position_seed(5, 3) == position_seed(5, 3) != position_seed(5, 4)


def test_seeded_draws_follow_the_distribution() -> None:
    """Deterministic (seeded) but still a fair sample of softmax(logits)."""
    logits = _logits([0.5, 0.3, 0.2]).unsqueeze(0)
    params = SamplingParams(temperature=1.0)
    counts: Counter[int] = Counter()
    for pos in range(1500):
        req = _req(params, seed=42, prompt=[7] * (pos + 1))
        counts[Sampler()(logits, [req])[0].token_id] += 1
    freqs = [counts[i] / 1500 for i in range(3)]
    assert freqs == pytest.approx([0.5, 0.3, 0.2], abs=0.05)


def test_temperature_zero_and_top_k_one_are_greedy() -> None:
    logits = torch.tensor([[0.1, 0.2, 3.0, 0.3]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=2.0)):
        assert params.greedy
        assert Sampler()(logits, [_req(params, seed=11)])[0].token_id == 2


def test_sampling_respects_masks() -> None:
    logits = torch.tensor([[5.0, 4.9, 4.8, -1.0, -2.0]])
    params = SamplingParams(temperature=5.0, top_k=2)
    seen = {Sampler()(logits, [_req(params, seed=s)])[0].token_id for s in range(200)}
    assert seen == {0, 1}


# -- logprobs and processors ---------------------------------------------------------------


def test_logprobs_top_k_sorted_and_exact() -> None:
    raw = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    req = _req(SamplingParams(temperature=0.0, logprobs=3))
    (tok,) = Sampler()(raw, [req])
    ref = raw[0].log_softmax(-1)
    assert tok.token_id == 1 and tok.logprob is not None
    assert tok.logprob.token_id == 1
    assert tok.logprob.logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in tok.logprob.top] == [1, 2, 0]
    assert [v for _, v in tok.logprob.top] == pytest.approx(
        [ref[1].item(), ref[2].item(), ref[0].item()]
    )
    req0 = _req(SamplingParams(temperature=0.0, logprobs=0))
    (tok0,) = Sampler()(raw, [req0])
    assert tok0.logprob is not None and tok0.logprob.top == []
    req_none = _req(SamplingParams(temperature=0.0))
    assert Sampler()(raw, [req_none])[0].logprob is None


def test_logits_processor_hook_masks_tokens() -> None:
    def only_token_3(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(logits, NEG_INF)
        mask[3] = 0.0
        return logits + mask

    raw = torch.tensor([[9.0, 8.0, 7.0, 0.0]])
    req = _req(SamplingParams(temperature=0.0))
    req.logits_processors.append(only_token_3)
    assert Sampler()(raw, [req])[0].token_id == 3
    sampled = _req(SamplingParams(temperature=1.0), seed=1)
    sampled.logits_processors.append(only_token_3)
    assert Sampler()(raw, [sampled])[0].token_id == 3


def test_batched_path_equals_row_by_row_reference() -> None:
    """The batched general path (one device->host copy per step) picks the tokens and
    logprobs that ``draw`` and ``_logprob`` give one row at a time."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 300, generator=gen) * 3
    batch = [
        _req(SamplingParams(temperature=0.0, logprobs=2), rid="a"),
        _req(SamplingParams(temperature=0.8, top_p=0.9), seed=11, rid="b"),
        _req(SamplingParams(temperature=1.2, top_k=20, logprobs=5), seed=12, rid="c"),
        _req(SamplingParams(temperature=0.0, repetition_penalty=1.3), rid="d"),
        _req(SamplingParams(temperature=0.7, min_p=0.05, logprobs=0), seed=13, rid="e"),
        _req(SamplingParams(temperature=1.0, frequency_penalty=0.5), seed=14, rid="f"),
        _req(SamplingParams(temperature=0.0), rid="g"),
    ]
    batch[5].output_token_ids.extend([4, 4, 9])
    got = Sampler()(logits, batch)
    for i, (request, tok) in enumerate(zip(batch, got, strict=True)):
        want = Sampler.draw(
            Sampler.processed_logits(logits[i], request), request, request.num_tokens
        )
        assert tok.token_id == want, request.request_id
        ref = Sampler._logprob(logits[i], want, request.params.logprobs)
        if ref is None:
            assert tok.logprob is None
        else:
            assert tok.logprob is not None
            assert tok.logprob.logprob == ref.logprob
            assert tok.logprob.top == ref.top
