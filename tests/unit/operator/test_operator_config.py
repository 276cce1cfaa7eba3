"""Operator settings from the environment: defaults, and errors that name the variable."""

from __future__ import annotations

import pytest

from lorarl.operator.config import ConfigError, OperatorConfig


def test_defaults_match_the_chart_contract() -> None:
    cfg = OperatorConfig.from_env({"LORARL_OPERATOR_NAMESPACE": "ops"})
    assert (cfg.namespace, cfg.webhook_port, cfg.metrics_port, cfg.health_port) == (
        "",
        9443,
        8080,
        8081,
    )
    assert str(cfg.cert_file) == "/tmp/k8s-webhook-server/serving-certs/tls.crt"
    assert cfg.progress_base("team", "job") == "http://job-trainer-0.job.team.svc:8080"
    assert cfg.operator_namespace == "ops"


def test_values_are_read() -> None:
    cfg = OperatorConfig.from_env(
        {
            "LORARL_NAMESPACE": "team",
            "LORARL_WEBHOOK_PORT": "0",
            "LORARL_TIMER_SECONDS": "0.5",
            "LORARL_PROGRESS_URL": "http://127.0.0.1:9/{name}/",
        }
    )
    assert (cfg.namespace, cfg.webhook_port, cfg.timer_seconds) == ("team", 0, 0.5)
    assert cfg.progress_base("ns", "a") == "http://127.0.0.1:9/a"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LORARL_WEBHOOK_PORT": "https"}, "LORARL_WEBHOOK_PORT: must be a port number"),
        ({"LORARL_METRICS_PORT": "70000"}, "LORARL_METRICS_PORT: must be between 0 and 65535"),
        ({"LORARL_TIMER_SECONDS": "0"}, "LORARL_TIMER_SECONDS: must be greater than 0"),
        ({"LORARL_TIMER_SECONDS": "soon"}, "LORARL_TIMER_SECONDS: must be a number of seconds"),
        ({"LORARL_PROGRESS_URL": "http://{job}"}, "LORARL_PROGRESS_URL: only {name} and"),
        ({"LORARL_PROGRESS_URL": "ftp://x"}, "LORARL_PROGRESS_URL: must start with http"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        OperatorConfig.from_env(env)
