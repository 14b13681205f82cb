"""The chart with ``engine.tensorParallelSize``: every engine pod requests one GPU per rank
(whatever the pool's resources said), gets the size as PDSERVE_TENSOR_PARALLEL_SIZE, a
larger /dev/shm for NCCL, and with p2p one control port per rank; a size of 0 is refused."""

from __future__ import annotations

from tests.unit.helm_support import RELEASE, ci, container, env_of, find, helm, render, render_text


def _pods(objs: list) -> dict:
    return {
        role: find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")["spec"]["template"]["spec"]
        for role in ("prefill", "decode")
    }


def test_each_engine_pod_gets_n_gpus_and_the_flag() -> None:
    objs = render(ci("tensor-parallel"))
    data = find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]
    assert data["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    for role, pod in _pods(objs).items():
        c = container({"spec": {"template": {"spec": pod}}}, role)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert c["resources"]["requests"]["cpu"] == "4"  # the rest of the pool's resources
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (ports["p2p"], ports["p2p-1"]) == (5557, 5558)
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def test_default_is_one_gpu_and_cpu_engines_keep_their_resources() -> None:
    for role, pod in _pods(render(ci("default"))).items():
        c = container({"spec": {"template": {"spec": pod}}}, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "p2p-1" not in {p["name"] for p in c.get("ports", [])}
    cpu = render(sets=("engine.tensorParallelSize=2", "engine.device=cpu"))
    for role, pod in _pods(cpu).items():
        c = container({"spec": {"template": {"spec": pod}}}, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # untouched: no GPUs used


def test_bad_sizes_are_refused() -> None:
    for bad in ("engine.tensorParallelSize=0", "engine.shmSizeLimit=lots"):
        args = ["template", RELEASE, str(ci("default").parents[1]), "--set", bad]
        proc = helm(*args, check=False)
        assert proc.returncode != 0, bad
        assert bad.split("=")[0].split(".")[1] in proc.stderr, proc.stderr
    assert "PDSERVE_TENSOR_PARALLEL_SIZE" in render_text(ci("default"))


def test_each_pool_may_have_its_own_size() -> None:
    """prefill/decode.tensorParallelSize (issue 38): the pool's pods request its GPUs, get
    its size by environment (over the shared ConfigMap's) and its ranks' p2p ports."""
    objs = render(ci("tensor-parallel"), sets=("decode.tensorParallelSize=1",))
    pods = _pods(objs)
    prefill = container({"spec": {"template": {"spec": pods["prefill"]}}}, "prefill")
    decode = container({"spec": {"template": {"spec": pods["decode"]}}}, "decode")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "PDSERVE_TENSOR_PARALLEL_SIZE" not in env_of(prefill)  # the shared 2
    assert env_of(decode)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "1"
    assert "p2p-1" in {p["name"] for p in prefill["ports"]}
    assert "p2p-1" not in {p["name"] for p in decode["ports"]}
    wider = render(ci("default"), sets=("prefill.tensorParallelSize=4",))
    pods = _pods(wider)
    prefill = container({"spec": {"template": {"spec": pods["prefill"]}}}, "prefill")
    assert env_of(prefill)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "4"
    args = ["template", RELEASE, str(ci("default").parents[1])]
    refused = helm(*args, "--set", "decode.tensorParallelSize=0", check=False)
    assert refused.returncode != 0 and "tensorParallelSize" in refused.stderr
