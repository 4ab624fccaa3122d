"""Schemathesis against a service's own OpenAPI document: no input may produce an undocumented 5xx (a 503
from /ready, documented as "not ready", is an answer; a 500 never is)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings


def fuzz_operations(schema, *, headers: dict[str, str], max_examples: int, skip: tuple[str, ...] = ()) -> dict:
    """Send generated requests to every operation (but ``skip``); returns status counts per operation."""
    seen: dict[str, dict[int, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        if operation.path in skip:
            continue
        _fuzz_one(operation, name, seen.setdefault(name, {}), headers, max_examples)
    return seen


def _fuzz_one(operation, name: str, counts: dict[int, int], headers: dict[str, str], max_examples: int) -> None:
    documented = {int(code) for code in operation.definition.raw.get("responses", {}) if str(code).isdigit()}

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def run(case):
        response = case.call(headers=headers)
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        status = response.status_code
        assert status < 500 or (status in documented and status != 500), (
            f"{name} answered {status}: {response.text[:300]}"
        )

    run()
