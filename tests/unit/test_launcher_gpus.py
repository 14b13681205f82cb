"""`pdserve up --gpus/--gpu-ids` and the engine passthrough flags, checked on the plan that
`build_plan` declares (argv and per-child environment); nothing is started, no GPU needed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from common.grpc_token import ENV as GRPC_TOKEN_ENV
from kv_store.record_mac import ENV as KV_SECRET_ENV
from pdserve import launcher
from pdserve.gpus import assign_gpus, gpu_ids
from pdserve.launcher import build_plan
from pdserve.procs import Child, Launcher, LaunchError
from pdserve.up_args import UpArgs


def parse_up(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parse `pdserve up ARGV` with the real parser, with no PDSERVE_* twins leaking in."""
    for setting in UpArgs.all_settings():
        monkeypatch.delenv(setting.env, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parser = argparse.ArgumentParser(prog="pdserve")
    launcher.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["up", *argv])
    launcher._check_counts(args)
    return args


def plan(tmp_path: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Child]:
    """The declared children by name (store, services, router)."""
    args = parse_up(argv, monkeypatch)
    up = Launcher(args, tmp_path, tmp_path / "logs")
    stores, parts, _env = build_plan(up, str(tmp_path))
    return {child.name: child for child in [*stores, *parts]}


def flag(child: Child, name: str) -> str | None:
    """The value after ``name`` in the child's argv (None when absent; it must not repeat)."""
    hits = [i for i, arg in enumerate(child.argv) if arg == name]
    assert len(hits) <= 1, f"{name} repeated in {child.argv}"
    return child.argv[hits[0] + 1] if hits else None


def gpu_env(child: Child) -> dict[str, str]:
    """The child's own environment without the run's control-plane token and KV secret."""
    return {k: v for k, v in child.env_extra.items() if k not in (GRPC_TOKEN_ENV, KV_SECRET_ENV)}


def test_services_and_router_share_one_token_by_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = plan(tmp_path, ["--connector", "redis", "--decode", "2"], monkeypatch)
    tokens = {n: c.env_extra.get(GRPC_TOKEN_ENV) for n, c in children.items()}
    assert tokens.pop("redis") is None, "the store gets no token"
    assert len(set(tokens.values())) == 1 and all(tokens.values()), tokens
    token = next(iter(tokens.values()))
    assert token is not None and all(token not in " ".join(c.argv) for c in children.values())
    again = plan(tmp_path, ["--connector", "redis"], monkeypatch)
    assert again["router"].env_extra[GRPC_TOKEN_ENV] != token, "a new token per run"


def test_services_share_one_kv_secret_per_run_by_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    children = plan(tmp_path, ["--connector", "redis", "--decode", "2"], monkeypatch)
    secrets = {n: c.env_extra.get(KV_SECRET_ENV) for n, c in children.items()}
    assert secrets.pop("redis") is None and secrets.pop("router") is None
    assert len(set(secrets.values())) == 1 and all(secrets.values()), secrets
    secret = next(iter(secrets.values()))
    assert secret is not None and secret != children["router"].env_extra[GRPC_TOKEN_ENV]
    assert all(secret not in " ".join(c.argv) for c in children.values())
    again = plan(tmp_path, ["--connector", "redis"], monkeypatch)
    assert again["decode-0"].env_extra[KV_SECRET_ENV] != secret, "a new secret per run"
    # A store shared beyond one run: the caller's secret is passed on instead.
    monkeypatch.setenv(KV_SECRET_ENV, "shared-secret")
    given = plan(tmp_path, ["--connector", "redis"], monkeypatch)
    assert given["prefill-0"].env_extra[KV_SECRET_ENV] == "shared-secret"


def test_one_prefill_and_one_decode_get_a_gpu_each_and_the_whole_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = plan(tmp_path, ["--device", "cuda", "--gpus", "2"], monkeypatch)
    assert set(children) == {"prefill-0", "decode-0", "router"}
    assert gpu_env(children["prefill-0"]) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert gpu_env(children["decode-0"]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert gpu_env(children["router"]) == {}
    for name in ("prefill-0", "decode-0"):  # alone on its GPU: the engine default (0.9)
        assert flag(children[name], "--gpu-memory-utilization") is None
        assert flag(children[name], "--device") == "cuda"


def test_colocated_replicas_one_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--mode", "colocated", "--prefill", "0", "--decode", "2", "--device", "cuda"]
    children = plan(tmp_path, [*argv, "--gpu-ids", "0,1"], monkeypatch)
    assert set(children) == {"decode-0", "decode-1", "router"}  # colocated: no store
    gpus = [children[f"decode-{i}"].env_extra["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    assert gpus == ["0", "1"]
    assert flag(children["decode-0"], "--connector") is None
    assert flag(children["router"], "--mode") == "colocated"


def test_engines_sharing_a_gpu_split_its_memory_and_only_they(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--device", "cuda", "--prefill", "2", "--decode", "1", "--gpu-ids", "3,5"]
    children = plan(tmp_path, argv, monkeypatch)
    # round-robin in launch order: prefill-0 → 3, prefill-1 → 5, decode-0 → 3
    placed = {
        n: children[n].env_extra["CUDA_VISIBLE_DEVICES"]
        for n in ("prefill-0", "prefill-1", "decode-0")
    }
    assert placed == {"prefill-0": "3", "prefill-1": "5", "decode-0": "3"}
    assert flag(children["prefill-0"], "--gpu-memory-utilization") == "0.450"
    assert flag(children["decode-0"], "--gpu-memory-utilization") == "0.450"
    assert flag(children["prefill-1"], "--gpu-memory-utilization") is None


def test_unpinned_cuda_engines_share_the_default_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = plan(tmp_path, ["--device", "cuda", "--decode", "2"], monkeypatch)
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert gpu_env(children[name]) == {}
        assert flag(children[name], "--gpu-memory-utilization") == "0.300"


@pytest.mark.parametrize(
    ("gpu_ids", "want"),
    [("3,5,7", {"prefill-0": "0.600", "decode-0": "0.600"}), ("3", {"prefill-0": "0.300"})],
)
def test_gpu_memory_utilization_is_per_gpu_and_split_by_its_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_ids: str, want: dict[str, str]
) -> None:
    """vLLM's flag: the fraction of each GPU; engines placed on one GPU share it."""
    argv = ["--device", "cuda", "--gpu-ids", gpu_ids, "--gpu-memory-utilization", "0.6"]
    children = plan(tmp_path, argv, monkeypatch)
    for name, value in want.items():
        assert flag(children[name], "--gpu-memory-utilization") == value, name
    assert flag(children["router"], "--gpu-memory-utilization") is None


def test_seed_reaches_every_engine_and_served_name_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = plan(tmp_path, ["--seed", "7", "--served-model-name", "my-model"], monkeypatch)
    assert flag(children["prefill-0"], "--seed") == flag(children["decode-0"], "--seed") == "7"
    assert flag(children["router"], "--served-model-name") == "my-model"
    assert flag(children["router"], "--seed") is None
    plain = plan(tmp_path / "plain", [], monkeypatch)
    assert flag(plain["decode-0"], "--seed") is None
    assert flag(plain["router"], "--served-model-name") == "smollm2"  # --model as given


def test_engine_flags_pass_through_to_every_engine_and_max_len_to_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--device", "cuda", "--gpus", "2", "--load-format", "dummy", "--dtype", "bfloat16"]
    argv += ["--attention-backend", "triton", "--max-model-len", "8192", "--connector", "redis"]
    argv += ["--redis-url", "redis://127.0.0.1:6399/0"]
    children = plan(tmp_path, argv, monkeypatch)
    for name in ("prefill-0", "decode-0"):
        child = children[name]
        assert flag(child, "--load-format") == "dummy"
        assert flag(child, "--dtype") == "bfloat16"
        assert flag(child, "--attention-backend") == "triton"
        assert flag(child, "--max-model-len") == "8192"
        assert flag(child, "--redis-url") == "redis://127.0.0.1:6399/0"
    assert flag(children["router"], "--max-model-len") == "8192"
    assert flag(children["router"], "--load-format") is None


def test_engine_flags_left_unset_are_not_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    children = plan(tmp_path, [], monkeypatch)
    for name in ("prefill-0", "decode-0", "router"):
        child = children[name]
        for name_ in ("--load-format", "--dtype", "--attention-backend", "--max-model-len"):
            assert flag(child, name_) is None, (name, name_)
        assert gpu_env(child) == {}


def test_gpus_counts_from_the_visible_devices() -> None:
    args = argparse.Namespace(device="cuda", gpus=2, gpu_ids=None)
    assert gpu_ids(args, {"CUDA_VISIBLE_DEVICES": "4,6,7"}) == ["4", "6"]
    assert gpu_ids(args, {}) == ["0", "1"]
    with pytest.raises(LaunchError, match="lists fewer"):
        gpu_ids(args, {"CUDA_VISIBLE_DEVICES": "4"})


@pytest.mark.parametrize(
    ("device", "gpus", "ids", "message"),
    [
        ("cpu", 2, None, "need --device cuda"),
        ("cuda", 2, "0,1", "not both"),
        ("cuda", None, "0,0", "distinct"),
        ("cuda", None, " , ", "distinct"),
    ],
)
def test_gpu_misuse_is_refused(
    device: str, gpus: int | None, ids: str | None, message: str
) -> None:
    with pytest.raises(LaunchError, match=message):
        gpu_ids(argparse.Namespace(device=device, gpus=gpus, gpu_ids=ids), {})


def test_gpus_flag_rejects_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse_up(["--device", "cuda", "--gpus", "0"], monkeypatch)


def test_assign_gpus_round_robin() -> None:
    assert assign_gpus(3, None) == [None, None, None]
    assert assign_gpus(5, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    assert assign_gpus(1, ["0", "1"]) == ["0"]


def test_child_env_extra_reaches_the_process(tmp_path: Path) -> None:
    """The per-child variables are in the started process's environment, over the shared env."""
    out = tmp_path / "env.txt"
    child = Child(
        "echo",
        ["/bin/sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}'],
        tmp_path / "l",
        lambda: True,
    )
    child.env_extra["CUDA_VISIBLE_DEVICES"] = "1"
    child.start({"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert child.proc is not None
    assert child.proc.wait(timeout=30) == 0
    assert out.read_text().strip() == "1"
