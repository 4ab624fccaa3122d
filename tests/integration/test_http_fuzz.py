"""Schemathesis against the scorer's and learner's OpenAPI documents (in-process ASGI): no 5xx, and every
control endpoint refuses requests without the bearer token. The generator is fuzzed against its real
process in test_generator.py. The documents are not served (``api_docs`` is off), so they are read from the
apps themselves."""

from __future__ import annotations

import schemathesis

from services.learner.app import LearnerAppState
from services.learner.app import build_app as learner_app
from services.scorer.app import ScorerAppState
from services.scorer.app import build_app as scorer_app
from shared.http import PUBLIC_PROBES
from tests.support.api_fuzz import fuzz_operations

TOKEN = "fuzz-token-" + "x" * 32


def _apps():
    limits = {"api_token": TOKEN, "max_request_bytes": 64 << 10}
    scorer = ScorerAppState(**limits, not_ready_reason=lambda: "")  # running, every breaker closed
    learner = LearnerAppState(**limits)
    return {"scorer": (scorer_app(scorer), scorer), "learner": (learner_app(learner), learner)}


def test_no_input_makes_a_server_error_and_control_needs_the_token():
    for name, (app, state) in _apps().items():
        schema = schemathesis.openapi.from_dict(app.openapi())
        schema.app = app
        anonymous = fuzz_operations(schema, headers={}, max_examples=20)
        for operation, counts in anonymous.items():  # /shutdown, the learner's /status
            if operation.split()[1] not in PUBLIC_PROBES:
                assert set(counts) == {401}, (name, operation, counts)
        wrong = fuzz_operations(schema, headers={"Authorization": "Bearer wrong"}, max_examples=10)
        assert set(wrong["POST /shutdown"]) == {401}, name
        authorised = fuzz_operations(schema, headers={"Authorization": f"Bearer {TOKEN}"}, max_examples=20)
        assert 200 in authorised["GET /health"], name
        assert state.stop.is_set(), f"{name}: an authorised /shutdown should have asked the service to stop"
