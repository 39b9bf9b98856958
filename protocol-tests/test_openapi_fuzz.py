"""Property-based fuzzing of the REST API from the broker's own /openapi.json (schemathesis).

Every documented operation gets generated requests (valid and invalid bodies, paths,
queries), authenticated as alice; each answer must not be a 5xx, must carry a documented
status code and content type, and its body must match the documented schema. Half of the
requests on `/v1/sessions/{id}/...` and `/api/kernels/{id}/...` name a live session of
alice's, so the handlers behind the 404 run too. The broker is this module's own (what the
fuzzer creates dies with it). EXAMPLES bounds the run (the whole test stays under ~3
minutes); set KB_FUZZ_API_EXAMPLES for a longer campaign.
"""
import os
from collections import Counter
import random
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import ALICE, Broker

# Answers by status code, printed at the end (pytest -s) for the figures in BENCHMARKS.md.
STATUSES = Counter()
EXAMPLES = int(os.environ.get("KB_FUZZ_API_EXAMPLES", "10"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzz_broker():
    # Generated requests carry made-up credentials (signed URLs' signatures): counted as
    # failed authentications, they would lock the run's own address out and turn the rest
    # of it into 429s. The lock-out has its own tests (test_e2b_files.py, tests/it auth).
    b = Broker(extra_args=["--max-auth-failures", "0"])
    yield b
    b.stop()


@pytest.fixture(scope="module")
def live_session(fuzz_broker):
    r = fuzz_broker.api("POST", "/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


# WebSocket upgrades are the protocol tests' and the frame fuzzers' (fuzz/).
SKIP_PATHS = re.compile(r"/(stream|channels)$")


def release(broker, path, response):
    """Deletes what a request created (a session, a Jupyter kernel, a replay's session): each
    is a kernel, and alice's kernels share her memory and process limits, so a run that kept
    them would end in kernels that cannot start."""
    if response.status_code != 201 or path.startswith("/v1/sessions/{id}/files"):
        return
    body = response.json()
    if isinstance(body.get("session"), dict):
        body = body["session"]
    created = body.get("id")
    if created:
        prefix = "/api/kernels/" if path.startswith("/api/") else "/v1/sessions/"
        broker.api("DELETE", prefix + created)


def run_operation(op, mode, broker, live_id):
    """Up to EXAMPLES generated requests of one operation; the first failure, shrunk."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        # Half the requests on a session's routes name a live one (the handlers behind the
        # 404 run too); deleting it would turn the rest of the run into 410s, so DELETE
        # keeps the generated ids.
        params = case.path_parameters or {}
        if "id" in params and case.method.upper() != "DELETE":
            if random.Random(repr(params)).random() < 0.5:
                params["id"] = live_id
        headers = {"Authorization": f"token {ALICE}"}
        response = case.call(base_url=broker.url, headers=headers, timeout=120)
        STATUSES[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        finally:
            release(broker, op.path, response)

    run()


# pytest.ini's 300 s is for the default run; a longer campaign gets its own bound.
@pytest.mark.timeout(max(300, EXAMPLES * 30))
def test_openapi_operations(fuzz_broker, live_session):
    schema = schemathesis.openapi.from_url(fuzz_broker.url + "/openapi.json")
    failures, ran = [], 0
    for result in schema.get_all_operations():
        op = result.ok()
        if SKIP_PATHS.search(op.path):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            ran += 1
            try:
                run_operation(op, mode, fuzz_broker, live_session)
            except Unsatisfiable:
                pass  # nothing to make invalid: the operation has no parameters
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - report them all
                # Hypothesis wraps a failure that did not repeat (FlakyFailure) in a group:
                # the inner one says which answer it was.
                inner = "".join(f"\n  {sub}" for sub in getattr(e, "exceptions", ()))
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {e}{inner}")
    print(f"\nschemathesis: {sum(STATUSES.values())} requests in {ran} operation runs;",
          "answers:", dict(sorted(STATUSES.items())))
    assert ran > 40, f"only {ran} operation runs: is /openapi.json complete?"
    assert not failures, "\n\n".join(failures)
