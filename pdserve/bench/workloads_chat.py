"""The `chat` workload of `pdserve bench serve`: multi-turn conversations that share system
prompts and grow turn by turn (prefix caching and cache-aware routing, docs/router.md
"Routing on held blocks").

`num_prefixes` system prompts of `prefix_len` tokens; conversations take them in turn.
Each conversation has `num_turns` turns; turn t's prompt is the system prompt, every
earlier (user, assistant) exchange, then the new user message:

    <system>\nUser: <u0>\nAssistant: <a0>\nUser: <u1>\n...\nUser: <ut>\nAssistant:

so turn t's prompt is a prefix of turn t+1's. User messages are `input_len` tokens,
assistant replies in the history `output_len` (the same as the output asked for; they are
seeded random text, not the model's own answer, so the engines' cached output blocks do not
match the next turn: only the prompt is reused). Prompts go round by round (every
conversation's turn 0, then every turn 1, ...): with fewer requests in flight than
conversations, a turn's answer has finished before the next turn of its conversation is
sent, as with real users.
"""

from __future__ import annotations

import math
import random

from pdserve.bench.workload_spec import LengthRange, Prompt, TextCodec, WorkloadSpec, random_text


def chat_prompts(
    spec: WorkloadSpec,
    codec: TextCodec,
    rng: random.Random,
    in_range: LengthRange,
    out_range: LengthRange,
) -> list[Prompt]:
    if spec.num_turns < 1:
        raise ValueError(f"chat workload needs num_turns >= 1, got {spec.num_turns}")
    systems = [random_text(codec, spec.prefix_len, rng)[0] for _ in range(spec.num_prefixes)]
    conversations = math.ceil(spec.num_prompts / spec.num_turns)
    history = [f"{systems[c % len(systems)]}\n" for c in range(conversations)]
    prompts: list[Prompt] = []
    for _turn in range(spec.num_turns):
        for c in range(conversations):
            if len(prompts) == spec.num_prompts:
                return prompts
            user, _ = random_text(codec, in_range.sample(rng), rng)
            max_tokens = out_range.sample(rng)
            text = f"{history[c]}User: {user}\nAssistant:"
            prompts.append(Prompt(text, len(codec.encode(text)), max_tokens, c))
            reply, _ = random_text(codec, max_tokens, rng)
            history[c] = f"{text} {reply}\n"
    return prompts
