"""The one redaction (:mod:`shared.redaction`): every form a secret takes in a text is masked, nothing else moves,
and a second pass changes nothing."""

from __future__ import annotations

import logging

import pytest

from shared.redaction import redact, redacted_error
from shared.telemetry import RedactingFormatter, split_labels

CASES = [
    ("GET http://user:s3cret-Pass@host:8080/score failed", "GET http://user:***@host:8080/score failed"),
    ("redis://:hunter2hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("cloning https://ghp_abcdefghijklmnop@github.com/x", "cloning https://***@github.com/x"),
    ("headers {'Authorization': 'Bearer tok-123456789'}", "headers {'Authorization': 'Bearer ***'}"),
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
    ("x-api-key=abcdef012345&page=2", "x-api-key=***&page=2"),
    ("https://h/score?token=abc123&x=1", "https://h/score?token=***&x=1"),
    ("sent Bearer abcdefgh12345678 to it", "sent Bearer *** to it"),
    ("password: 'pw with spaces'", "password: '***'"),
    ('{"api_key": "k-1", "n": 2}', '{"api_key": "***", "n": 2}'),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_every_form_of_a_secret_is_masked(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "completions.0: behaviour_logprobs holds NaN at 1 (flat index)",
        "http://127.0.0.1:8001/weights/update answered 503",
        "max_tokens: 256, token_ids has 12 entries",
        "reward judge on group 3f2a: HTTP 500 after 2 attempts: body 'boom'",
    ],
)
def test_a_text_without_secrets_is_unchanged(text):
    assert redact(text) == text


def test_an_exception_and_a_log_line_with_its_traceback_are_redacted():
    try:
        raise ConnectionError("cannot reach http://judge:PLANTED-secret@10.0.0.9/score")
    except ConnectionError as exc:
        assert redacted_error(exc) == "ConnectionError: cannot reach http://judge:***@10.0.0.9/score"
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "call to %s failed", ("http://a:PLANTED-2@h",), None
        )
        record.exc_info = (type(exc), exc, exc.__traceback__)
        line = RedactingFormatter("%(message)s").format(record)
    assert "PLANTED" not in line and "http://a:***@h" in line and "Traceback" in line


def test_a_reward_functions_name_is_redacted_in_its_metric_label():
    assert split_labels("rewards/http://u:PLANTED@h/mean") == ("rewards/mean", {"function": "http://u:***@h"})
