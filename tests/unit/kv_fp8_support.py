"""Teacher-forced logits of an engine's model through its own paged KV cache, for the
fp8-KV accuracy tests (CPU torch path here, Triton on the GPU in tests/gpu/)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata


def run_sequence(runner: object, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(tokens) - chunks[0] + 1, vocab]``: the prompt ``tokens[:sum
    (chunks)]`` is prefilled in ``chunks`` (the later chunks attend to the earlier ones
    through the cache), then every further token is fed one decode step at a time. Row 0
    predicts the token after the prompt, row i the one after ``tokens[prompt + i - 1]``.
    Uses blocks 1.. of ``runner.kv_cache`` (one request)."""
    model, cache = runner.model, runner.kv_cache  # type: ignore[attr-defined]
    bs, dev = runner.block_size, runner.device  # type: ignore[attr-defined]
    table = torch.arange(1, 2 + len(tokens) // bs, dtype=torch.int32, device=dev)[None]
    if table.shape[1] >= cache.shape[2]:
        raise ValueError("the runner's cache has too few blocks for this sequence")

    def step(start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, device=dev)
        n = end - start
        meta = AttentionMetadata(
            slot_mapping=table[0, pos // bs].long() * bs + pos % bs,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            block_tables=table,
            max_query_len=n,
            max_seq_len=end,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[end],
        )
        ids = torch.tensor(tokens[start:end], device=dev)
        return model.compute_logits(model(ids, pos, cache, meta)[-1:]).float()

    rows, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            last = step(start, start + size)
            start += size
        rows.append(last)
        for t in range(start, len(tokens)):
            rows.append(step(t, t + 1))
    return torch.cat(rows)


@dataclass(slots=True)
class Agreement:
    """fp8-vs-reference comparison of teacher-forced logits."""

    positions: int
    top1_agree: int
    max_abs_err: float  # max |logit_fp8 - logit_ref| over every position and token
    rms_err: float  # root mean square of logit_fp8 - logit_ref
    logit_std: float  # std of the reference logits (the scale the errors are judged against)
    max_flip_margin: float  # widest reference top-1/top-2 margin among the flipped positions

    @property
    def rate(self) -> float:
        return self.top1_agree / self.positions


def compare(ref: torch.Tensor, test: torch.Tensor) -> Agreement:
    """Top-1 agreement and logit error of ``test`` against ``ref`` (same shape)."""
    diff = test - ref
    top2 = ref.topk(2, dim=1).values
    margin = top2[:, 0] - top2[:, 1]
    flips = ref.argmax(1) != test.argmax(1)
    return Agreement(
        positions=ref.shape[0],
        top1_agree=int((~flips).sum()),
        max_abs_err=float(diff.abs().max()),
        rms_err=float(diff.pow(2).mean().sqrt()),
        logit_std=float(ref.std()),
        max_flip_margin=float(margin[flips].max()) if bool(flips.any()) else 0.0,
    )


def check_agreement(
    results: list[Agreement], ref_name: str, *, rms_frac: float, max_frac: float
) -> None:
    """Assert the fp8-KV bounds over several sequences: top-1 agreement >= 90 %, and the
    rms / max logit error under ``rms_frac`` / ``max_frac`` of the reference logits' std.
    Prints the measured values (the docs quote them)."""
    positions = sum(c.positions for c in results)
    agree = sum(c.top1_agree for c in results)
    std = min(c.logit_std for c in results)
    rms = max(c.rms_err for c in results)
    worst = max(c.max_abs_err for c in results)
    margin = max(c.max_flip_margin for c in results)
    print(
        f"fp8 KV vs {ref_name} KV: top-1 {agree}/{positions} = {agree / positions:.3f}, "
        f"rms dlogit {rms:.4f}, max |dlogit| {worst:.4f}, min logit std {std:.4f}, "
        f"widest flipped margin {margin:.4f}"
    )
    assert agree / positions >= 0.9, "greedy agreement of fp8 KV below 90 %"
    assert rms < rms_frac * std, "fp8 logit error (rms) is not small against the logit spread"
    assert worst < max_frac * std, "fp8 logit error (max) is not small against the logit spread"
