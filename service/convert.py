"""Protobuf ↔ engine conversions and request validation, shared by both servicers.

Protobuf stays at this edge: servicers turn messages into engine objects here, and engine
outputs back into messages. Every validation failure is a ``ValueError`` whose message names
the field (the interceptor maps it to INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve_api.v1 import pdserve_pb2 as pb
from service.errors import IncompatibleKvHandle

if TYPE_CHECKING:
    from engine.core.outputs import KvSaveResult, RequestOutput, TokenLogprob
    from engine.core.request import RemoteKV
    from engine.core.sampling_params import SamplingParams


def sampling_params_from_proto(
    msg: pb.SamplingParams, *, max_tokens: int | None = None
) -> SamplingParams:
    """Engine ``SamplingParams`` from the wire message (raises ValueError on bad ranges).

    proto3 cannot tell "unset" from zero for plain scalars, so zero means "the OpenAI
    default" for top_p (1.0) and repetition_penalty (1.0), and top_k 0 means off (-1).
    ``max_tokens`` overrides the message's (prefill always samples exactly one token).
    """
    from engine.core.guided_spec import GuidedSpec
    from engine.core.sampling_params import SamplingParams

    want_logprobs = msg.return_logprobs or msg.logprobs > 0
    min_tokens = int(msg.min_tokens)
    if max_tokens is not None:  # a prefill samples the first token: the rule applies to it
        min_tokens = min(min_tokens, max_tokens)
    return SamplingParams(
        max_tokens=int(msg.max_tokens) if max_tokens is None else max_tokens,
        min_tokens=min_tokens,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        top_k=int(msg.top_k) if msg.top_k else -1,
        min_p=float(msg.min_p),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=[int(t) for t in msg.stop_token_ids],
        ignore_eos=bool(msg.ignore_eos),
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty else 1.0,
        logprobs=int(msg.logprobs) if want_logprobs else None,
        skip_special_tokens=bool(msg.skip_special_tokens),
        include_stop_str_in_output=bool(msg.include_stop_str_in_output),
        # GuidedSpec raises ValueError on an unknown kind or malformed value; the engine
        # raises it (with the parser's message) for a schema/regex/grammar that won't parse.
        guided=GuidedSpec(msg.guided_kind, msg.guided_value) if msg.guided_kind else None,
        logit_bias={int(t): float(b) for t, b in msg.logit_bias.items()},
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
    )


def token_ids(name: str, ids: Sequence[int], *, allow_empty: bool = False) -> list[int]:
    """The ids as a list; ValueError when empty (unless allowed). Range and length checks
    against the model (vocabulary, context) are the engine's, which raises ValueError too."""
    out = [int(t) for t in ids]
    if not out and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    return out


def logprobs_to_proto(items: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    """Wire logprobs (chosen token plus its top alternatives, best first)."""
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in items or ()
    ]


def phase_timings(
    out: RequestOutput, *, compute_s: float = 0.0, kv_save_s: float = 0.0
) -> pb.PhaseTimings:
    """Timings for a chunk: the engine's queue and KV-load figures plus the service's own."""
    return pb.PhaseTimings(
        queue_s=out.queue_seconds,
        compute_s=max(0.0, compute_s),
        kv_save_s=kv_save_s,
        kv_load_s=out.kv_load_seconds,
        kv_blocks_loaded=out.kv_blocks_loaded,
        kv_blocks_recomputed=out.kv_blocks_recomputed,
        kv_blocks_local=out.kv_blocks_local,
        kv_bytes_loaded=out.kv_bytes_loaded,
    )


def kv_handle_fields(engine: Any) -> dict[str, Any]:
    """This engine's compatibility fields, as they appear in a ``KvHandle``."""
    layout = engine.kv_layout
    return {
        "model_fingerprint": engine.model_fingerprint,
        "layout_version": int(layout.version),
        "dtype": str(layout.dtype),
        "block_size": int(layout.block_size),
    }


def check_handle_compatible(handle: pb.KvHandle, engine: Any) -> None:
    """ValueError naming every field in which ``handle`` differs from this engine's layout.

    Reading blocks of another model, layout, dtype or block size would silently produce
    garbage, so an incompatible handle is always refused (whatever ``--kv-load-failure``
    says): it means the prefill and decode pools are misconfigured, which recomputing
    would hide. A handle of the same model split over another tensor- or pipeline-parallel
    grid is taken: the load re-cuts its blocks (``handle_reshard``).
    """
    mine = kv_handle_fields(engine)
    theirs = {key: getattr(handle, key) for key in mine}
    diffs = [f"{key} {theirs[key]!r} != {mine[key]!r}" for key in mine if theirs[key] != mine[key]]
    if diffs == [
        f"model_fingerprint {theirs['model_fingerprint']!r} != {mine['model_fingerprint']!r}"
    ]:
        try:
            handle_reshard(handle, engine)
            diffs = []
        except ValueError as e:
            diffs = [str(e)]
    if diffs:
        from engine.kv.fingerprint import kv_kind_of

        theirs_kind, mine_kind = (
            kv_kind_of(handle.model_fingerprint),
            kv_kind_of(engine.model_fingerprint),
        )
        if theirs_kind != mine_kind:  # a DeepSeek pool paired with another model's
            diffs.insert(
                0,
                f"KV cache kind {theirs_kind} (prefill) != {mine_kind} (this decode instance)",
            )
        raise IncompatibleKvHandle(
            "incompatible kv_handle (the prefill instance runs a different model or KV layout): "
            + "; ".join(diffs)
        )
    if handle.num_tokens < 1 or not (handle.block_keys or handle.transfer_id):
        raise ValueError(
            "kv_handle has no blocks (num_tokens and block_keys, or a p2p transfer_id, must be set)"
        )
    if handle.transfer_id and not handle.source_address:
        raise ValueError("kv_handle names a p2p transfer_id but no source_address")


def kv_handle(engine: Any, saved: KvSaveResult, connector: str) -> pb.KvHandle:
    """The handle a prefill streams for its committed KV: store keys, and for a held (p2p)
    save the address to pull from and the lease's transfer id."""
    return pb.KvHandle(
        **kv_handle_fields(engine),
        block_keys=saved.block_keys,
        num_tokens=saved.num_tokens,
        connector=connector,
        source_address=saved.source_address,
        transfer_id=saved.transfer_id,
    )


def handle_reshard(handle: pb.KvHandle, engine: Any) -> dict[str, Any] | None:
    """How this engine's loads re-cut a handle of another grid (JSON, None for its own);
    ValueError naming both sides when they cannot (docs/design.md §3, "KV between unlike
    grids")."""
    from engine.kv.reshard import plan_reshard

    config = engine.config
    reshard = plan_reshard(
        handle.model_fingerprint,
        engine.model_fingerprint,
        engine.args,
        config.pipeline_parallel_size,
        config.tensor_parallel_size,
        handle.connector,
    )
    return None if reshard is None else reshard.to_json()


def remote_kv_from_handle(handle: pb.KvHandle, prompt_len: int, engine: Any) -> RemoteKV:
    """The engine's ``RemoteKV`` for a (compatible) handle; ValueError when it covers more
    tokens than the prompt has."""
    from engine.core.request import RemoteKV

    if handle.num_tokens > prompt_len:
        raise ValueError(
            f"kv_handle covers {handle.num_tokens} tokens but the prompt has only {prompt_len}"
        )
    return RemoteKV(
        list(handle.block_keys),
        int(handle.num_tokens),
        handle.source_address,
        handle.transfer_id,
        handle_reshard(handle, engine),
    )
