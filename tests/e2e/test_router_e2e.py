"""The router end to end, the OpenAI API: real prefill + decode processes, the router
process, the official ``openai`` client. Tiny random Llama (SmolLM2 tokenizer), fs KV
store, few tokens. The processes are the fixture ``stack`` (tests/e2e/conftest.py);
request lifecycle, limits and metrics are in test_router_lifecycle.py."""

from __future__ import annotations

from router.tokenizer import PromptProcessor
from tests.e2e.router_support import PROMPT, Stack, metric
from tests.e2e.router_support import complete_prompt as complete


def test_completion_and_usage(stack: Stack) -> None:
    proc = PromptProcessor.from_model_dir(stack.model_dir)
    out = complete(
        stack.client(), max_tokens=10, extra_body={"ignore_eos": True, "pdserve_timings": True}
    )
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(proc.encode(PROMPT))
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10
    timings = out.usage.model_extra["pdserve_timings"]  # type: ignore[index]
    assert timings["ttft"] > 0 and timings["e2e"] >= timings["ttft"]
    assert timings["prefill_compute"] > 0


def test_chat_stream_matches_non_stream(stack: Stack) -> None:
    client = stack.client()
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    whole = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert whole.usage is not None and whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_stop_string(stack: Stack) -> None:
    client = stack.client()
    full = complete(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    out = complete(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in complete(
            client, max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert streamed == out.text
    # vLLM's include_stop_str_in_output: the same answer, ending with the stop string, also
    # streamed and on the colocated path.
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}
    want = full[: full.index(stop) + len(stop)]
    for router in (stack.disagg, stack.colocated):
        got = complete(stack.client(router), max_tokens=24, stop=[stop], extra_body=kept)
        assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
        chunks = complete(stack.client(router), max_tokens=24, stop=stop, stream=True,
                          extra_body=kept)  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks) == want


def test_seeded_sampling_is_reproducible_and_choices_differ(stack: Stack) -> None:
    client = stack.client()
    kwargs = {
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 1234,
        "n": 3,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    a = [c.text for c in sorted(complete(client, **kwargs).choices, key=lambda c: c.index)]
    b = [c.text for c in sorted(complete(client, **kwargs).choices, key=lambda c: c.index)]
    assert a == b
    assert len(set(a)) == 3, a
    other = [c.text for c in complete(client, **{**kwargs, "seed": 99}).choices]
    assert other != a
    # Streaming n=3 yields the same choices, interleaved by index.
    streamed: dict[int, str] = {}
    for chunk in complete(client, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == a


def test_greedy_parity_disaggregated_colocated_offline(stack: Stack) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 4,"]
    disagg = [
        complete(
            stack.client(), prompt=p, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True}
        ).choices[0]
        for p in prompts
    ]
    coloc = [
        complete(
            stack.client(stack.colocated),
            prompt=p,
            max_tokens=16,
            logprobs=0,
            extra_body={"ignore_eos": True},
        ).choices[0]
        for p in prompts
    ]
    llm = LLM(str(stack.model_dir), num_kv_blocks=64, max_num_seqs=4)
    offline = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    proc = PromptProcessor.from_model_dir(stack.model_dir)
    for d, c, o in zip(disagg, coloc, offline, strict=True):
        assert d.logprobs is not None and c.logprobs is not None
        expected_tokens = [proc.token_text(t) for t in o.token_ids]
        assert d.logprobs.tokens == expected_tokens
        assert c.logprobs.tokens == expected_tokens
        assert d.text == c.text == o.text


def test_logprobs_shapes(stack: Stack) -> None:
    out = complete(
        stack.client(), max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    ).choices[0]
    assert out.logprobs is not None and out.logprobs.top_logprobs is not None
    assert len(out.logprobs.tokens or []) == 4
    assert all(len(top) == 2 for top in out.logprobs.top_logprobs)
    assert all(lp is not None and lp <= 0 for lp in out.logprobs.token_logprobs or [])
    chat = stack.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_first_token_can_finish_without_decode(stack: Stack) -> None:
    url = stack.decode.metrics_url
    before = metric(url, "pdserve_service_requests_total", rpc="Decode")
    out = complete(stack.client(), max_tokens=1)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 1
    assert metric(url, "pdserve_service_requests_total", rpc="Decode") == before


def test_batch_prompts_with_n_and_echo(stack: Stack) -> None:
    prompts = ["Alpha beta gamma", "One two three"]
    out = complete(
        stack.client(),
        prompt=prompts,
        n=2,
        max_tokens=3,
        echo=True,
        temperature=0.8,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for choice in out.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
        assert len(choice.text) > len(prompts[choice.index // 2])
    assert out.usage is not None and out.usage.completion_tokens == 12
    single = [
        complete(
            stack.client(),
            prompt=p,
            max_tokens=3,
            temperature=0.8,
            seed=5,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for p in prompts
    ]
    by_index = {c.index: c.text for c in out.choices}
    # Choice 0 of each prompt uses the request's seed: same as asking for it alone.
    assert by_index[0] == prompts[0] + single[0]
    assert by_index[2] == prompts[1] + single[1]


def test_sampling_parameters_reach_the_engine(stack: Stack) -> None:
    """Seeded sampling with every knob set: the router (both modes) matches the offline
    engine token for token, so no parameter is lost or altered on the way."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    knobs = {
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.01,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {1000: 3.0, 2000: -4.0},
    }
    offline = LLM(str(stack.model_dir), num_kv_blocks=64, max_num_seqs=4).generate(
        [PROMPT], SamplingParams(max_tokens=16, seed=11, ignore_eos=True, **knobs)
    )[0]
    plain = LLM(str(stack.model_dir), num_kv_blocks=64, max_num_seqs=4).generate(
        [PROMPT], SamplingParams(max_tokens=16, seed=11, ignore_eos=True, temperature=0.9)
    )[0]
    assert plain.text != offline.text, (
        "the knobs must change the sample for this test to mean anything"
    )
    extra = {"ignore_eos": True, "top_k": 40, "min_p": 0.01, "repetition_penalty": 1.3}
    for router in (stack.disagg, stack.colocated):
        out = complete(
            stack.client(router),
            max_tokens=16,
            seed=11,
            temperature=0.9,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={"1000": 3.0, "2000": -4.0},
            extra_body=extra,
        )
        assert out.choices[0].text == offline.text, router.name


def test_logit_bias_forces_and_bans_tokens(stack: Stack) -> None:
    """+100 on a token makes greedy decoding emit only it (completions and chat, both
    modes, as the offline engine does); -100 on greedy's own first token changes it."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(str(stack.model_dir), num_kv_blocks=64, max_num_seqs=4)
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={1000: 100})
    want = llm.generate([PROMPT], forced)[0]
    assert want.token_ids == [1000] * 6
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    ban = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={first: -100})
    want_banned = llm.generate([PROMPT], ban)[0]
    assert want_banned.token_ids[0] != first
    for router in (stack.disagg, stack.colocated):
        client = stack.client(router)
        bias = {"ignore_eos": True}
        out = complete(client, max_tokens=6, logit_bias={"1000": 100}, extra_body=bias)
        assert out.choices[0].text == want.text, router.name
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=6,
            temperature=0.0,
            logit_bias={"1000": 100},
            extra_body=bias,
        )
        assert chat.choices[0].message.content == want.text, router.name
        banned = complete(client, max_tokens=1, logit_bias={str(first): -100}).choices[0].text
        assert banned == want_banned.text, router.name


def test_first_token_split_utf8_character(stack: Stack) -> None:
    """A first token that is half a UTF-8 character: the router holds the replacement
    character back and derives the text itself, matching the offline engine's text."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(str(stack.model_dir), num_kv_blocks=512, max_num_seqs=64)
    proc = PromptProcessor.from_model_dir(stack.model_dir)
    prompt: list[int] | None = None
    for start in range(0, 4000, 400):  # ~0.5 % of first tokens are partial characters
        batch = [[1000 + i, 2000 + i] for i in range(start, start + 400)]
        outs = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
        hits = [
            p
            for p, o in zip(batch, outs, strict=True)
            if proc.decode(o.token_ids).endswith("\ufffd")
        ]
        if hits:
            prompt = hits[0]
            break
    assert prompt is not None, "no prompt whose first token is a partial character"
    expected = llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )[0]
    chunks = [
        c.choices[0].text
        for c in complete(
            stack.client(),
            prompt=prompt,
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    ]
    assert not chunks[0].endswith("\ufffd")
    assert "".join(chunks) == expected.text
    assert (
        complete(stack.client(), prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
        .choices[0]
        .text
        == expected.text
    )


def test_unseeded_batch_prompts_sample_independently(stack: Stack) -> None:
    """Without a client seed each prompt of a batch draws its own (they shared the request's
    one: the same prompt twice came back the same text); with a seed each prompt uses it."""
    same = ["Seven eight nine", "Seven eight nine"]
    kwargs = {
        "prompt": same,
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    unseeded = [c.text for c in complete(stack.client(), **kwargs).choices]
    assert unseeded[0] != unseeded[1], unseeded
    seeded = [c.text for c in complete(stack.client(), seed=7, **kwargs).choices]
    assert seeded[0] == seeded[1], seeded


def test_min_tokens_holds_stop_tokens_back(stack: Stack) -> None:
    """``min_tokens`` reaches the prefill (its first token) and the decode: a stop id that
    greedy emits first is masked until the 4th token, as in the offline engine."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(str(stack.model_dir), num_kv_blocks=64, max_num_seqs=4)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    want = llm.generate(
        [PROMPT],
        SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=4
        ),
    )[0]
    assert len(want.token_ids) >= 4 and first not in want.token_ids[:4]
    extra = {"ignore_eos": True, "stop_token_ids": [first], "min_tokens": 4}
    for router in (stack.disagg, stack.colocated):
        out = complete(stack.client(router), max_tokens=8, extra_body=extra)
        assert out.choices[0].text == want.text, router.name
        assert out.usage is not None and out.usage.completion_tokens == len(want.token_ids)


def test_truncate_prompt_tokens_keeps_the_prompts_end(stack: Stack) -> None:
    """vLLM's ``truncate_prompt_tokens``: the answer is the one to the last k tokens, also
    for a prompt longer than the router's prompt limit (256 here)."""
    proc = PromptProcessor.from_model_dir(stack.model_dir)
    ids = proc.encode(PROMPT * 40)
    assert len(ids) > 256
    out = complete(stack.client(), prompt=PROMPT * 40, extra_body={"truncate_prompt_tokens": 7})
    assert out.usage is not None and out.usage.prompt_tokens == 7
    assert out.choices[0].text == complete(stack.client(), prompt=ids[-7:]).choices[0].text
    chat = stack.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
