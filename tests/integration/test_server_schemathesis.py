"""Property-based API tests generated from the app's own OpenAPI (schemathesis, in process).

Checks every documented operation: no 5xx, status codes and bodies conform to the schema. The
store holds a live job (fake trainer) named like the OpenAPI path examples, and a finished one, so
the generated requests reach 200s as well as 404s and 422s.

Each operation runs as its own hypothesis test over `operation.as_strategy()`: schemathesis'
pytest fixture integration (`from_fixture`) does not work with pytest 9.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.engines.fake_trainer import FakeTrainer
from lorarl.server import LocalStore, create_app
from tests.unit.server.test_server_local import make_job, write_run

OPERATIONS = [
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{namespace}/{name}"),
    ("GET", "/v1/jobs/{namespace}/{name}/metrics"),
    ("GET", "/v1/jobs/{namespace}/{name}/samples"),
    ("GET", "/healthz"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    with FakeTrainer(job="quickstart") as trainer:
        trainer.step(3)
        store = LocalStore()
        store.add(make_job("quickstart"), trainer.url)
        run_dir = tmp_path_factory.mktemp("run")
        write_run(run_dir, steps=4)
        store.add_finished(make_job("finished"), run_dir)
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(store))


def test_every_operation_is_covered(api_schema) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_operation_conforms_to_schema(api_schema, method: str, path: str) -> None:
    operation = api_schema[path][method]
    statuses: list[int] = []

    # the schema's own examples (namespace `local`, name `quickstart`) plus generated data
    cases = st.one_of(operation.as_strategy(), *operation.get_strategies_from_examples())

    @given(case=cases)
    @settings(
        max_examples=15,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        statuses.append(case.call_and_validate().status_code)

    check()
    assert statuses, f"{method} {path}: no request was generated"
    if "{name}" in path:  # the path examples name the live job: a 200 must be among them
        assert 200 in statuses and 404 in statuses
