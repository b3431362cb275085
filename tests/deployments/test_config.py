"""ServeConfig: the ingress scales with Serve's own autoscaling when its max exceeds its start size; the
prefill settings reach the engines they are meant for; the CLI flags, the YAML keys and docs/reference/settings.md's
tables are all made from the dataclass fields, so they name the same settings."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from deployments.app import build_app, build_grpc_app
from deployments.cli import build_parser
from deployments.config import ServeConfig, ServeConfigError, serve_settings
from deployments.config_fields import Kind, Setting
from deployments.console import process_map
from deployments.serve_cli import LaunchOptions, launch_settings, split_args
from engine import EngineConfig
from engine.errors import EngineConfigError

ROOT = Path(__file__).resolve().parents[2]


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
    with pytest.raises(ServeConfigError, match="ingress"):
        ServeConfig(**bad)


def test_prefill_settings_reach_the_right_engines():
    cfg = ServeConfig(decode_max_prefill_tokens=96)
    assert cfg.engine_config("decode").max_prefill_tokens_per_step == 96
    assert cfg.engine_config("prefill").max_prefill_tokens_per_step is None
    # Colocated, a decode worker is the whole engine: no separate prompt cap.
    assert ServeConfig(num_prefill_workers=0).engine_config("decode").max_prefill_tokens_per_step is None
    with pytest.raises(ServeConfigError, match="local_prefill_max_tokens"):
        ServeConfig(local_prefill_max_tokens=-1)
    with pytest.raises(ServeConfigError, match="decode_max_prefill_tokens must be > 0"):
        ServeConfig(decode_max_prefill_tokens=0)
    # The server sets the engine's own cap per role: asking for it by the engine's name says what to use.
    with pytest.raises(ServeConfigError, match="set decode_max_prefill_tokens instead"):
        ServeConfig.from_dict({"max_prefill_tokens_per_step": 64})


def test_kv_cache_dtype_reaches_every_engine_and_a_bad_one_is_a_clean_cli_error(capsys):
    cfg = ServeConfig.from_dict(dict(kv_cache_dtype="bfloat16"))
    assert cfg.engine_config("decode").kv_cache_dtype == "bfloat16"
    assert cfg.engine_config("prefill").kv_cache_dtype == "bfloat16"  # both pools: the KV that moves matches
    from deployments.cli import main

    assert main(["serve", "--kv-cache-dtype", "int4"]) == 2  # refused before Ray starts
    err = capsys.readouterr().err
    assert "kv_cache_dtype='int4'" in err and "Traceback" not in err
    assert err.count("\n") == 1  # one line


# --- one source of truth: flags == YAML keys ------------------------------------------------------

# A valid value other than the default for each setting whose generic pick (below) would not do.
SAMPLES = {"speculative_method": "ngram", "prefill_min_workers": 1, "decode_min_workers": 1, "num_prefill_workers": 2, "prefill_max_workers": 3,
           "decode_max_workers": 3, "ingress_max_replicas": 3, "dtype": "bfloat16", "kv_cache_dtype": "float16",
           "device": "cuda", "batching": "static", "num_threads": 2, "scheduling_policy": "priority",
           "gpu_memory_utilization": 0.5, "ops_backend": "torch", "kv_cache_memory_mb": 4096,
           "trace_exporter": "file:/tmp/pdserve-trace",
           "api_keys_file": "docs/examples/api_keys.json", "ttft_target_ms": 500.0, "tpot_target_ms": 50.0}


def _sample(s: Setting):
    """(value, command-line text) different from the default."""
    if s.name in SAMPLES:
        value = SAMPLES[s.name]
    elif s.kind is Kind.BOOL:
        value = not s.default
    elif s.kind is Kind.INT:
        value = 2 * (s.default or 1) + 1
    elif s.kind is Kind.FLOAT:
        value = s.default + 0.5
    elif s.kind is Kind.RESOURCES:
        value = {"prefill": 0.5}
    else:
        value = f"x-{s.name}"
    return value, (json.dumps(value) if s.kind is Kind.RESOURCES else str(value))


def _parse_serve(argv: list[str]) -> tuple[LaunchOptions, dict]:
    return split_args(build_parser().parse_args(["serve", *argv]))


def _serve_flags() -> list[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return [o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"]


@pytest.mark.parametrize("s", serve_settings(), ids=lambda s: s.name)
def test_every_flag_sets_the_same_as_its_yaml_key(s: Setting, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    value, text = _sample(s)
    for key, flag in zip(s.keys, s.flags):
        from_yaml = ServeConfig.from_dict({key: value})
        assert from_yaml != ServeConfig(), f"{key} changed nothing"
        if not s.cli:  # a tuning knob: YAML only, no flag
            with pytest.raises(SystemExit):
                _parse_serve([flag, text])
            continue
        if s.kind is Kind.BOOL:
            argv = [flag if value else "--no-" + flag[2:]]
        else:
            argv = [flag, text]
        _, settings = _parse_serve(argv)
        assert settings == {s.name: value}
        assert ServeConfig.from_dict(settings) == from_yaml


def test_every_flag_is_a_setting_or_a_launch_option():
    keys = {k for s in serve_settings() if s.cli for k in s.keys}
    launch = {s.name for s in launch_settings()}
    bools = {k for s in (*serve_settings(), *launch_settings()) if s.kind is Kind.BOOL for k in s.keys}
    names = set()
    for flag in _serve_flags():
        name = flag[2:].replace("-", "_")
        names.add(name[3:] if name.startswith("no_") and name[3:] in bools else name)
    assert names == keys | launch
    # ...and every YAML key that is not a flag is a declared tuning knob (tensor_parallel_size is not a
    # server setting at all: the server sets it per role from prefill_tp / decode_tp).
    assert {s.name for s in serve_settings() if not s.cli} == {"gguf_file", "num_kv_blocks", "batching",
                                                                "max_wait_s", "seed", "cache_dir", "ops_backend"}


def test_tensor_parallel_degree_is_per_role():
    cfg = ServeConfig.from_dict({"prefill_tp": 2, "decode_tp": 4})
    assert cfg.engine_config("prefill").tensor_parallel_size == 2
    assert cfg.engine_config("decode").tensor_parallel_size == 4
    assert _parse_serve(["--prefill-tp", "2", "--decode-tp", "4"])[1] == {"prefill_tp": 2, "decode_tp": 4}
    assert process_map("disagg", cfg).endswith("prefill(1, cpu, tp 2) =gloo=> decode(1, cpu, tp 4)")
    with pytest.raises(ServeConfigError, match="set prefill_tp and decode_tp instead"):
        ServeConfig.from_dict({"tensor_parallel_size": 2})
    with pytest.raises(ServeConfigError, match="decode_tp must be an integer >= 1, got 0"):
        ServeConfig.from_dict({"decode_tp": 0})
    with pytest.raises(ServeConfigError, match="worker_num_cpus or worker_num_gpus"):
        ServeConfig.from_dict({"prefill_tp": 2, "worker_num_cpus": 0})
    with pytest.raises(ServeConfigError, match="prefill_tp and decode_tp"):
        ServeConfig(engine=EngineConfig(tensor_parallel_size=2))


def test_the_defaults_of_the_flags_are_the_defaults_of_the_config(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    launch, settings = _parse_serve([])
    assert settings == {} and launch == LaunchOptions()
    assert ServeConfig.from_dict(settings) == ServeConfig()
    assert ServeConfig().engine.num_threads == 1  # a worker's engine: one thread unless told otherwise


def test_launcher_flags_and_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "k1")
    launch, settings = _parse_serve(["--address", "auto", "--grpc-port", "0", "--cluster-resources",
                                     "--decode-resources", '{"decode": 2}'])
    assert launch == LaunchOptions(address="auto", grpc_port=0, cluster_resources=True)
    assert settings == {"api_key": "k1", "prefill_resources": {"prefill": 0.01}, "decode_resources": {"decode": 2}}
    assert _parse_serve(["--api-key", "k2"])[1]["api_key"] == "k2"  # the flag wins over the environment
    with pytest.raises(ServeConfigError, match="unknown setting 'grpc_port'"):
        ServeConfig.from_dict({"grpc_port": 9000})  # serve_config.yaml has Serve's own grpc_options


@pytest.mark.parametrize("args, message", [
    ({"num_decode_workers": "2"}, "num_decode_workers: expected an integer, got '2'"),
    ({"kv_backup": "no"}, "kv_backup: expected a boolean"),
    ({"worker_num_cpus": True}, "worker_num_cpus: expected a number"),
    ({"max_model_len": 1.5}, "max_model_len: expected an integer or none"),
    ({"prefill_resources": {"prefill": "1"}}, "prefill_resources: expected a JSON object"),
    ({"batching": "fancy"}, "batching: expected one of static, dynamic, continuous"),
    ({"num_decode_worker": 2}, "unknown setting 'num_decode_worker': did you mean num_decode_workers"),
    ({"prefill_workers": 1, "num_prefill_workers": 2}, "set the same setting: keep one"),
    ({"engine": {"no_such_field": 1}}, "engine: "),
])
def test_a_bad_yaml_value_names_the_setting(args, message):
    with pytest.raises(ServeConfigError, match=re.escape(message)):
        build_app(args)


def test_config_errors_stay_engine_config_errors_and_the_cli_prints_one_line(capsys):
    assert issubclass(ServeConfigError, EngineConfigError) and issubclass(ServeConfigError, ValueError)
    from deployments.cli import main

    assert main(["serve", "--decode-workers", "0"]) == 2
    assert capsys.readouterr().err == "pdserve: error: num_decode_workers must be >= 1, got 0\n"
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--max-num-seqs", "many"])
    assert exc.value.code == 2
    assert "argument --max-num-seqs: expected an integer, got 'many'" in capsys.readouterr().err


def test_the_config_round_trips_through_to_dict():
    cfg = ServeConfig.from_dict({"num_prefill_workers": 0, "max_num_seqs": 8, "prefill_min_workers": 0,
                                 "prefill_max_workers": 0, "decode_resources": {"decode": 1}})
    assert ServeConfig.from_dict(cfg.to_dict()) == cfg


def test_readme_documents_every_setting_as_the_fields_say():
    spec = importlib.util.spec_from_file_location("settings_tables", ROOT / "scripts" / "settings_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    readme = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert tables.update(readme) == readme, "docs/reference/settings.md's settings tables are stale: run scripts/settings_tables.py"
    for s in (*serve_settings(), *launch_settings()):
        assert (f"`{s.flags[0]}`" if s.cli and s.kind is not Kind.BOOL else f"`{s.name}`" if not s.cli
                else f"`--[no-]{s.name.replace('_', '-')}`") in readme, s.name
