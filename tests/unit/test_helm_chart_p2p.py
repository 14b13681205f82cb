"""The chart with ``connector.type: p2p``: engine pods advertise their pod IP and the p2p
port, the p2p knobs reach every process as PDSERVE_* twins, and a store beside p2p is
deployed and wired exactly as it would be on its own."""

from __future__ import annotations

from tests.unit.helm_support import RELEASE, ci, container, env_of, find, kinds, render


def _config(objs: list) -> dict:
    return find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]


def test_p2p_with_a_store() -> None:
    objs = render(ci("p2p"))
    data = _config(objs)
    assert data["PDSERVE_CONNECTOR"] == "p2p" and data["PDSERVE_KV_STORE"] == "redis"
    assert data["PDSERVE_P2P_PORT"] == "5557"
    assert (data["PDSERVE_P2P_LEASE_SECONDS"], data["PDSERVE_P2P_TIMEOUT"]) == ("20", "5")
    assert data["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "PDSERVE_REDIS_URL" not in data  # it carries the password: env from a Secret
    assert find(objs, "StatefulSet", f"{RELEASE}-pdserve-redis")  # the fallback store
    for role in ("prefill", "decode"):
        pod = container(find(objs, "Deployment", f"{RELEASE}-pdserve-{role}"))
        assert env_of(pod)["PDSERVE_REDIS_URL"].startswith("redis://:$(REDIS_PASSWORD)@")
        assert env_of(pod)["PDSERVE_P2P_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {p["name"]: p["containerPort"] for p in pod["ports"]}
        assert ports["p2p"] == 5557


def test_p2p_alone_deploys_no_store() -> None:
    objs = render(sets=("connector.type=p2p",))
    data = _config(objs)
    assert data["PDSERVE_KV_STORE"] == "none"
    assert not {"PDSERVE_REDIS_URL", "PDSERVE_KV_PATH", "PDSERVE_LMCACHE_URL"} & set(data)
    assert not [s for s in kinds(objs, "StatefulSet") if "redis" in s["metadata"]["name"]]
    assert not kinds(objs, "PersistentVolumeClaim")


def test_store_connectors_have_no_p2p_settings() -> None:
    objs = render()
    data = _config(objs)
    assert not [k for k in data if k.startswith("PDSERVE_P2P")]
    pod = container(find(objs, "Deployment", f"{RELEASE}-pdserve-decode"))
    assert "PDSERVE_P2P_HOST" not in env_of(pod)
    assert "p2p" not in {p["name"] for p in pod["ports"]}
