"""The API fuzzed from its own OpenAPI document (schemathesis): no 500, no hang, every refusal with a stable code.

Every operation of the published document gets generated requests, valid
ones and deliberately invalid ones, sent with a key of a team of its own whose
limits keep a lucky valid create from starting many sandboxes.  A response
must not be a server error, must come within its timeout, must conform to
the document (status and body), and a refusal must be JSON with a code.

The operations are read from the committed document (``docs/openapi.json``,
which ``tests/django/test_openapi.py`` keeps equal to what the server
publishes), so each is a test of its own; the requests are generated from
the running server's document.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import schemathesis.checks
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = [pytest.mark.root, pytest.mark.slow]
DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
CODE = re.compile(r"^[a-z][a-z0-9_]*$")
# What the system answers truthfully under a fuzzer, not failures: no room for yet another
# sandbox, a host that does not hold what was asked for.
HONEST_503 = {"no_capacity", "host_unavailable", "snapshot_unavailable", "broker_unavailable"}
EXAMPLES = 30
OPERATIONS = [result.ok().label for result in schemathesis.openapi.from_path(str(DOCUMENT)).get_all_operations()]


@pytest.fixture(scope="module")
def fuzz_key(stack: Any) -> str:
    team = stack.new_team("Fuzz", max_sandboxes=3, max_launch_count=3, requests_per_second=100000, max_ttl_s=120)
    return str(team.key)


@pytest.fixture(scope="module")
def published(stack: Any) -> Any:
    return schemathesis.openapi.from_url(f"{stack.url}/api/v1/openapi.json")


def check(case: schemathesis.Case, base_url: str, key: str) -> None:
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    where = f"{case.method} {case.formatted_path} {case.query or ''}: {response.status_code} {response.text[:400]}"
    if response.status_code >= 400:
        error = response.json().get("error", {})
        assert CODE.match(str(error.get("code", ""))) and error.get("message"), where
    assert response.status_code < 500 or (response.status_code == 503 and response.json()["error"]["code"] in HONEST_503), where
    # Conformance: a status the document lists, a body of the shape it promises, invalid input refused.
    # Not "valid input accepted": the document cannot say which cursors this API gave out, or what a
    # team's limits allow, so a well-formed request may rightly be refused (with a code, checked above).
    case.validate_response(
        response, headers={"Authorization": f"Bearer {key}"}, excluded_checks=[schemathesis.checks.positive_data_acceptance]
    )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_request_breaks_the_api(label: str, mode: GenerationMode, stack: Any, published: Any, fuzz_key: str) -> None:
    operation = published.find_operation_by_label(label)
    assert operation is not None, f"the server no longer publishes {label}"

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def requests(case: schemathesis.Case) -> None:
        check(case, stack.url, fuzz_key)

    requests()
