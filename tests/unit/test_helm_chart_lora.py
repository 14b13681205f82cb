"""The chart's ``lora`` values: the engines get the LoRA env twins (modules below the
adapters' mount, absolute paths kept) and the adapters' volume read-only; the router gets
the runtime-update switch only when asked; off by default; bad values refused."""

from __future__ import annotations

from tests.unit.helm_support import RELEASE, container, find, helm, render

LORA = (
    "lora.enabled=true",
    "lora.modules.sql=sql-v2",
    "lora.modules.chat=/opt/chat",
    "lora.volume.persistentVolumeClaim.claimName=adapters",
    "lora.maxLoras=8",
    "lora.allowRuntimeUpdating=true",
)


def test_engines_mount_the_adapters_and_get_the_flags() -> None:
    objs = render(sets=LORA)
    data = find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]
    assert data["PDSERVE_ENABLE_LORA"] == "1" and data["PDSERVE_MAX_LORAS"] == "8"
    assert data["PDSERVE_MAX_LORA_RANK"] == "16" and "PDSERVE_MAX_CPU_LORAS" not in data
    assert data["PDSERVE_LORA_MODULES"] == "chat=/opt/chat sql=/adapters/sql-v2"
    assert data["PDSERVE_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    for role in ("prefill", "decode"):
        dep = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        mounts = {m["name"]: m for m in container(dep, role)["volumeMounts"]}
        assert mounts["lora-adapters"] == {
            "name": "lora-adapters",
            "mountPath": "/adapters",
            "readOnly": True,
        }
        vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert vols["lora-adapters"]["persistentVolumeClaim"] == {"claimName": "adapters"}


def test_off_by_default() -> None:
    objs = render()
    data = find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]
    assert not any("LORA" in k for k in data)
    dep = find(objs, "Deployment", f"{RELEASE}-pdserve-decode")
    assert "lora-adapters" not in {m["name"] for m in container(dep, "decode")["volumeMounts"]}


def test_bad_values_are_refused() -> None:
    from tests.unit.helm_support import CHART

    for bad in ("lora.maxLoras=0", "lora.maxLoraRank=1000", "lora.mountPath=adapters"):
        proc = helm("template", RELEASE, str(CHART), "--set", "lora.enabled=true", "--set", bad,
                    check=False)  # fmt: skip
        assert proc.returncode != 0 and "lora" in proc.stderr, (bad, proc.stderr)
