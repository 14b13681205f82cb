"""``common/grpc_tls.py``: the mTLS files are checked at startup with errors that name the
flag, identities match the allow-list by any certificate name, and ``pdserve up`` passes
its certificate to every service and the router (and probes them over mTLS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.grpc_tls import TlsFiles, identity_allowed, parse_allowed, peer_identity
from tests.tls_certs import Pki, make_pki
from tests.unit.test_launcher_gpus import flag, plan


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_none_set_is_tls_off_and_all_three_load(pki: Pki) -> None:
    assert TlsFiles.load("", "", "") is None
    files = pki.service.files()
    assert files.cert.startswith(b"-----BEGIN CERTIFICATE") and b"PRIVATE KEY" in files.key
    assert files.server_credentials() is not None and files.channel_credentials() is not None


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"key"}, "--grpc-tls-cert, --grpc-tls-ca missing"),
        ({"cert", "key"}, "--grpc-tls-ca missing"),
        ({"ca"}, "--grpc-tls-cert, --grpc-tls-key missing"),
    ],
)
def test_partial_settings_name_what_is_missing(pki: Pki, given: set[str], missing: str) -> None:
    paths = {"cert": pki.service.cert, "key": pki.service.key, "ca": pki.ca}
    chosen = {name: str(paths[name]) if name in given else "" for name in paths}
    with pytest.raises(ValueError, match=missing):
        TlsFiles.load(chosen["cert"], chosen["key"], chosen["ca"])


def test_unreadable_or_wrong_files_are_refused_with_the_flag(pki: Pki, tmp_path: Path) -> None:
    cert, key, ca = str(pki.service.cert), str(pki.service.key), str(pki.ca)
    with pytest.raises(ValueError, match=r"--grpc-tls-cert .*/nope.crt: cannot read it"):
        TlsFiles.load(str(tmp_path / "nope.crt"), key, ca)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not pem\n")
    with pytest.raises(ValueError, match="--grpc-tls-ca .*not a PEM file"):
        TlsFiles.load(cert, key, str(garbage))
    with pytest.raises(ValueError, match="not a certificate and its matching private key"):
        TlsFiles.load(cert, str(pki.router.key), ca)  # another certificate's key
    with pytest.raises(ValueError, match="--grpc-tls-ca .*no CA certificate"):
        TlsFiles.load(cert, key, str(pki.router.key))  # a key, not a certificate


class _Context:
    def __init__(self, names: list[bytes] | None) -> None:
        self._names = names

    def peer_identities(self) -> list[bytes] | None:
        return self._names


def test_identities_and_the_allow_list() -> None:
    assert peer_identity(_Context(None)) == ""  # plaintext: everyone alike
    identity = peer_identity(_Context([b"router.pdserve.test", b"10.0.0.7"]))
    assert identity == "10.0.0.7,router.pdserve.test"
    allowed = parse_allowed(" router.pdserve.test , ,operator ")
    assert allowed == ("router.pdserve.test", "operator")
    assert identity_allowed(identity, allowed)
    assert not identity_allowed("stranger.pdserve.test", allowed)
    assert not identity_allowed("", allowed)


def test_up_passes_the_certificate_to_every_service_and_the_router(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pki.service
    argv = ["--grpc-tls-cert", str(pair.cert), "--grpc-tls-key", str(pair.key)]
    argv += ["--grpc-tls-ca", str(pair.ca), "--grpc-tls-server-name", "localhost"]
    children = plan(tmp_path, [*argv, "--decode", "2"], monkeypatch)
    for name in ("prefill-0", "decode-0", "decode-1", "router"):
        child = children[name]
        assert flag(child, "--grpc-tls-cert") == str(pair.cert), name
        assert flag(child, "--grpc-tls-key") == str(pair.key), name
        assert flag(child, "--grpc-tls-ca") == str(pair.ca), name
    assert flag(children["router"], "--grpc-tls-server-name") == "localhost"
    assert flag(children["decode-0"], "--grpc-tls-server-name") is None  # a router flag only
    plain = plan(tmp_path / "plain", [], monkeypatch)
    assert all(flag(child, "--grpc-tls-cert") is None for child in plain.values())
