"""`pdserve serve` with no layout flags picks the layout for the hardware it finds (docs/guides/layouts.md); any layout flag, or a YAML/`build_app` config, keeps exactly what it says."""

from __future__ import annotations

import pytest

from deployments.config import ServeConfig
from deployments.serve_cli import Hardware, cpu_bf16, pick_layout, with_layout


def test_a_cpu_host_gets_one_colocated_worker_with_a_thread_per_core(capsys):
    settings = with_layout({}, Hardware(cpus=2, gpus=0))
    cfg = ServeConfig.from_dict(settings)
    assert cfg.colocated and cfg.num_decode_workers == 1
    assert cfg.engine.num_threads == 2 and cfg.worker_num_cpus == 2.0 and cfg.engine.device == "cpu"
    out = capsys.readouterr().out
    assert "2 CPU cores, no GPU: colocated, 1 worker x 2 threads" in out
    assert "--prefill-workers 1 --decode-workers 1" in out  # the disaggregated layout, one flag away


def test_gpus_per_pool_get_the_disaggregated_layout():
    cfg = ServeConfig.from_dict(with_layout({}, Hardware(cpus=16, gpus=4)))
    assert (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.worker_num_gpus) == (2, 2, 1.0)
    assert cfg.engine.device == "cuda"
    one = ServeConfig.from_dict(with_layout({}, Hardware(cpus=8, gpus=1)))
    assert one.colocated and one.worker_num_gpus == 1.0


def test_a_cpu_cluster_gets_a_colocated_worker_per_node():
    layout, text = pick_layout(Hardware(cpus=8, gpus=0, nodes=3))
    assert layout["num_decode_workers"] == 3 and layout["num_threads"] == 8 and "3 workers x 8 threads" in text


@pytest.mark.parametrize("given", [{"num_prefill_workers": 1}, {"num_threads": 1}, {"num_decode_workers": 2},
                                   {"worker_num_cpus": 0.5}, {"prefill_resources": {"prefill": 0.01}}])
def test_any_layout_setting_keeps_the_layout_as_given(given, capsys):
    assert with_layout(dict(given), Hardware(cpus=2, gpus=0)) == given
    assert capsys.readouterr().out == ""


def test_device_cpu_on_a_gpu_host_picks_the_cpu_layout():
    settings = with_layout({"device": "cpu"}, Hardware(cpus=4, gpus=2))
    assert settings["num_prefill_workers"] == 0 and settings["num_threads"] == 4 and settings["device"] == "cpu"


@pytest.mark.parametrize("bf16", ["AMX", "AVX512-BF16"])
def test_a_cpu_that_multiplies_bf16_in_hardware_serves_in_bfloat16_unless_told(capsys, bf16):
    """bf16 matrix products run in hardware there (2-6x fp32's rate); `--dtype` decides otherwise."""
    hw = Hardware(cpus=2, gpus=0, cpu_bf16=bf16)
    cfg = ServeConfig.from_dict(with_layout({}, hw))
    assert cfg.engine.dtype == "bfloat16" and cfg.colocated
    assert f"dtype bfloat16 (this CPU multiplies bf16 matrices in hardware, {bf16})" in capsys.readouterr().out
    assert ServeConfig.from_dict(with_layout({"dtype": "float32"}, hw)).engine.dtype == "float32"
    # A layout flag keeps the layout as given; the dtype is picked all the same.
    assert with_layout({"num_prefill_workers": 1}, hw) == {"num_prefill_workers": 1, "dtype": "bfloat16"}


def test_cpu_flags_name_the_bf16_instructions(tmp_path):
    def flags(line):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {line}\n")
        return cpu_bf16(str(tmp_path / "cpuinfo"))
    assert flags("fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile") == "AMX"
    assert flags("fpu sse avx2 avx512f avx512_bf16") == "AVX512-BF16"
    assert flags("fpu sse avx2 avx512f avx512_vnni") == ""  # bf16 only emulated: slower than fp32


def test_without_bf16_hardware_or_on_a_gpu_the_dtype_is_the_engines_auto(capsys):
    assert "dtype" not in with_layout({}, Hardware(cpus=2, gpus=0))  # fp32: bf16 math is no faster there
    gpu = ServeConfig.from_dict(with_layout({}, Hardware(cpus=16, gpus=1, cpu_bf16="AMX")))
    assert gpu.engine.device == "cuda" and gpu.engine.dtype == "bfloat16"  # auto on CUDA
    assert "dtype bfloat16 (this CPU" not in capsys.readouterr().out
