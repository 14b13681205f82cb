"""The control-plane credentials (common/grpc_token.py; docs/design.md §3 "Control-plane
security"): a proof answers only its own challenge, a call credential opens one instance
for one RPC, within the window, once; a router call refused UNAUTHENTICATED (a restarted
service, not proven yet) fails over instead of answering 500."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from common.grpc_token import CallChecker, call_credential, proof, verified_instance
from router.legs.rpc import fatal_error

TOKEN = "t0ken"


def test_a_proof_answers_its_own_challenge_only() -> None:
    answer = proof(TOKEN, "nonce-1", "inst-a")
    assert verified_instance(TOKEN, "nonce-1", answer) == "inst-a"
    assert verified_instance(TOKEN, "nonce-2", answer) is None  # an old answer
    assert verified_instance("other", "nonce-1", answer) is None  # another run's token
    assert verified_instance(TOKEN, "nonce-1", "inst-b" + answer[6:]) is None


def test_a_call_credential_is_good_once_for_its_instance_and_rpc() -> None:
    checker = CallChecker(TOKEN, instance="inst-a")
    cred = call_credential(TOKEN, "inst-a", "Decode", now=1000.0)
    assert not checker.accepts(cred, "Prefill", now=1000.0)  # another RPC
    assert not CallChecker(TOKEN, instance="inst-b").accepts(cred, "Decode", now=1000.0)
    assert not checker.accepts(cred, "Decode", now=1000.0 + checker.window_s + 1)  # stale
    assert checker.accepts(cred, "Decode", now=1001.0)
    assert not checker.accepts(cred, "Decode", now=1001.0), "a replay must be refused"
    assert not checker.accepts(f"Bearer {TOKEN}", "Decode", now=1001.0)  # not this scheme


def test_unauthenticated_fails_over() -> None:
    exc = AioRpcError(grpc.StatusCode.UNAUTHENTICATED, Metadata(), Metadata(), "old instance")
    assert fatal_error(exc, "decode instance x") is None
