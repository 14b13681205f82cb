"""benchmarks/gpu/pd_two_gpu_report.py: the benchmark's model directory (synthetic full-vocabulary
tokenizer, read by the router, the engine's tokenizer loader and bench serve) and the report
arithmetic over bench serve result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu.pd_two_gpu_report import collect, kv_bytes_per_token, make_model, render
from engine.core.detokenizer import load_tokenizer
from router.tokenizer import PromptProcessor

REPO = Path(__file__).resolve().parents[2]
CONFIG_8B = REPO / "benchmarks/configs/llama-3.1-8b/config.json"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(CONFIG_8B, tmp_path_factory.mktemp("model"), tiny=True)


def test_tiny_model_keeps_the_8b_vocabulary_and_special_ids(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (
        128256,
        128000,
        128001,
    )
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 64)
    assert kv_bytes_per_token(config, 4) == 2 * 2 * 2 * 16 * 4
    full = json.loads(CONFIG_8B.read_text())
    assert kv_bytes_per_token(full, 2) == 128 * 1024  # 32 layers x K,V x 8 heads x 128 x bf16


def test_router_and_engine_tokenizers_agree_on_every_word(tiny_model: Path) -> None:
    ids = [0, 5, 49151, 49152, 127999, 128002, 128255]
    text = " ".join(f"t{i}" for i in ids)
    router = PromptProcessor.from_model_dir(tiny_model, max_model_len=4608)
    engine = load_tokenizer(str(tiny_model))
    assert engine is not None and len(engine) == 128256
    assert list(engine.encode(text, add_special_tokens=False)) == ids
    assert router.encode(text) == ids
    assert engine.decode(ids) == text
    # generated ids decode to one word each, so every decode step yields visible text
    assert engine.decode([7, 128255]) == "t7 t128255"
    assert engine.decode([7, 128001, 8], skip_special_tokens=True) == "t7 t8"
    assert router.eos_token_id == 128001


def test_bad_special_ids_are_refused(tmp_path: Path) -> None:
    config = json.loads(CONFIG_8B.read_text())
    config["eos_token_id"] = config["vocab_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token_id"):
        make_model(path, tmp_path / "model", tiny=True)


def _request(ttft: float, tpot: float, save: float, load: float) -> dict[str, Any]:
    return {
        "ok": True,
        "ttft": ttft,
        "tpot": tpot,
        "timings": {"kv_save": save, "kv_load": load, "ttft": ttft},
    }


def _stats(p50: float, p99: float) -> dict[str, float]:
    return {"mean": p50, "p50": p50, "p90": p99, "p99": p99, "count": 10}


def _bench(rate: float, itl_p99: float, requests: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {
        "duration_s": 10.0,
        "completed": len(requests),
        "failed": 0,
        "errors": {},
        "request_throughput": len(requests) / 10.0,
        "output_throughput": 25.6 * len(requests),
        "goodput": 0.2,
        "good_requests": 2,
        "ttft_ms": _stats(100.0, 200.0),
        "itl_ms": _stats(10.0, itl_p99),
        "tpot_ms": _stats(12.0, 20.0),
        "e2e_ms": _stats(3000.0, 4000.0),
    }
    return {"runs": [{"request_rate": rate, "summary": summary, "requests": requests}]}


def test_report_rows_kv_percentiles_goodput_grid_and_ratios(tmp_path: Path) -> None:
    pd_reqs = [
        _request(0.1, 0.010, 0.2, 0.1),
        _request(0.1, 0.020, 0.4, 0.2),
        _request(0.1, 0.030, 0.6, 0.3),
    ]
    for name, benches in {
        "pd-fs": [_bench(2.0, 15.0, pd_reqs), _bench(1.0, 12.0, pd_reqs)],
        "colocated": [_bench(1.0, 60.0, pd_reqs[:2]), _bench(2.0, 150.0, pd_reqs[:2])],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "status").write_text("ok: ready after 50s\n")
        for i, doc in enumerate(benches):
            (tmp_path / name / f"bench-{i}.json").write_text(json.dumps(doc))
    results = collect(tmp_path, [15.0, 25.0])
    pd = results["pd-fs"]["rows"]
    assert [r["rate"] for r in pd] == [1.0, 2.0]  # sorted by rate, whatever the file order
    kv = pd[0]["kv"]
    assert kv["requests"] == 3
    assert kv["kv_save_p50"] == pytest.approx(400.0)
    assert kv["kv_load_p50"] == pytest.approx(200.0)
    assert kv["kv_total_p50"] == pytest.approx(600.0)
    # 300, 600, 900 ms: rank 1.98 interpolates between the 2nd and 3rd value
    assert kv["kv_total_p99"] == pytest.approx(600.0 + 0.98 * 300.0)
    # TPOTs 10, 20, 30 ms over a 10 s run: 1 request within 15 ms, 2 within 25 ms
    assert pd[0]["goodput_at_tpot_ms"] == {"15": pytest.approx(0.1), "25": pytest.approx(0.2)}
    assert results["pd-redis"] == {
        "label": "1P+1D, redis (loopback)",
        "status": "not run",
        "rows": [],
    }

    md = render(results, {"title": "T", "slo": "TPOT ≤ 25 ms"}, 512.0, [15.0, 25.0])
    assert md.startswith("# T\n")
    assert "- 1P+1D, redis (loopback): not run" in md
    assert "- 1.0 req/s: colocated ÷ P/D(fs): ITL p99 5.00x, TTFT p50 1.00x, TPOT p50 1.00x" in md
    assert "- 2.0 req/s: colocated ÷ P/D(fs): ITL p99 10.00x" in md
    # 512 MiB in 0.6 s at the p50 is 0.89 GB/s
    assert (
        "| 1P+1D, fs on /dev/shm | 1.0 | 3 | 400.0 / 596.0 | 200.0 / 298.0 | 600.0 / 894.0 | 0.89 |"
        in md
    )
