"""ServeConfig: the ingress scales with Serve's own autoscaling when its max exceeds its start size; the
prefill settings reach the engines they are meant for."""

from __future__ import annotations

import pytest

from deployments.app import build_app, build_grpc_app
from deployments.config import ServeConfig
from engine.errors import EngineConfigError


def test_ingress_autoscales_on_ongoing_requests_when_max_exceeds_start():
    for build in (build_app, build_grpc_app):
        auto = build({"ingress_max_replicas": 3, "ingress_target_ongoing_requests": 16})._bound_deployment
        cfg = auto._deployment_config.autoscaling_config
        assert (cfg.min_replicas, cfg.max_replicas, cfg.target_ongoing_requests) == (1, 3, 16)
        fixed = build({"ingress_replicas": 2})._bound_deployment._deployment_config
        assert fixed.autoscaling_config is None and fixed.num_replicas == 2


@pytest.mark.parametrize("bad", [{"ingress_replicas": 0}, {"ingress_replicas": 2, "ingress_max_replicas": 1},
                                 {"ingress_target_ongoing_requests": 0}])
def test_bad_ingress_settings_name_the_field(bad):
    with pytest.raises(EngineConfigError, match="ingress"):
        ServeConfig(**bad)


def test_prefill_settings_reach_the_right_engines():
    cfg = ServeConfig(decode_max_prefill_tokens=96)
    assert cfg.engine_config("decode").max_prefill_tokens_per_step == 96
    assert cfg.engine_config("prefill").max_prefill_tokens_per_step is None
    # Colocated, a decode worker is the whole engine: no separate prompt cap.
    assert ServeConfig(num_prefill_workers=0).engine_config("decode").max_prefill_tokens_per_step is None
    with pytest.raises(EngineConfigError, match="local_prefill_max_tokens"):
        ServeConfig(local_prefill_max_tokens=-1)
    with pytest.raises(EngineConfigError, match="max_prefill_tokens_per_step"):
        ServeConfig(decode_max_prefill_tokens=0)


def test_kv_cache_dtype_reaches_every_engine_and_a_bad_one_is_a_clean_cli_error(capsys):
    cfg = ServeConfig.from_dict(dict(kv_cache_dtype="bfloat16"))
    assert cfg.engine_config("decode").kv_cache_dtype == "bfloat16"
    assert cfg.engine_config("prefill").kv_cache_dtype == "bfloat16"  # both pools: the KV that moves matches
    from deployments.cli import main

    assert main(["serve", "--kv-cache-dtype", "int4"]) == 2  # refused before Ray starts
    err = capsys.readouterr().err
    assert "kv_cache_dtype='int4'" in err and "Traceback" not in err
