"""`pdserve serve --layout` names a topology (docs/guides/layouts.md): `auto` picks the fastest for the
hardware and says which; each layout fills in its pools for the hardware under the flags given; every
start prints its process map in one line."""

from __future__ import annotations

import pytest

from deployments.cli import main
from deployments.config import ServeConfig
from deployments.console import process_map
from deployments.layouts import SINGLE_PROCESS_MAX_CPUS, Hardware, cpu_bf16, pool_settings, resolve
from helpers import free_port


def _cfg(layout: str, settings: dict, hw: Hardware, needs_ray: bool = False) -> tuple[str, ServeConfig]:
    picked, out = resolve(layout, settings, hw, needs_ray)
    return picked, ServeConfig.from_dict(out)


def test_auto_on_a_small_cpu_host_picks_one_process_and_says_it_is_the_fastest(capsys):
    layout, cfg = _cfg("auto", {}, Hardware(cpus=2, gpus=0))
    assert layout == "single" and cfg.engine.num_threads == 2
    out = capsys.readouterr().out
    assert "auto picked the fastest layout for this hardware (2 CPU cores, no GPU): single" in out
    assert "--layout disagg" in out  # the disaggregated layout, one flag away
    assert process_map(layout, cfg) == \
        "pdserve: layout=single  http+engine(1 process, 2 threads, cpu), no Ray, no KV transfer"


def test_auto_picks_ray_where_one_process_loses_or_cannot_serve(capsys):
    layout, cfg = _cfg("auto", {}, Hardware(cpus=SINGLE_PROCESS_MAX_CPUS + 4, gpus=0))
    assert layout == "colocated" and cfg.colocated and cfg.engine.num_threads == 8 and cfg.worker_num_cpus == 8.0
    assert _cfg("auto", {}, Hardware(cpus=2, gpus=0), needs_ray=True)[0] == "colocated"  # e.g. --grpc-port
    layout, cfg = _cfg("auto", {}, Hardware(cpus=16, gpus=4))
    assert layout == "disagg" and (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.worker_num_gpus) == (2, 2, 1.0)
    assert process_map(layout, cfg).endswith("prefill(2, cuda) =nccl=> decode(2, cuda)")
    layout, cfg = _cfg("auto", {}, Hardware(cpus=8, gpus=1))
    assert layout == "colocated" and cfg.worker_num_gpus == 1.0 and cfg.engine.device == "cuda"
    layout, cfg = _cfg("auto", {"device": "cpu"}, Hardware(cpus=4, gpus=2))
    assert layout == "single" and cfg.engine.device == "cpu"


def test_disagg_on_a_two_core_cpu_host_is_one_prefill_and_one_decode_worker_over_gloo(capsys):
    layout, cfg = _cfg("disagg", {}, Hardware(cpus=2, gpus=0))
    assert layout == "disagg" and not cfg.colocated
    assert (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.engine.num_threads, cfg.worker_num_cpus) == \
        (1, 1, 1, 1.0)
    assert process_map(layout, cfg) == \
        "pdserve: layout=disagg  ingress(1) -> router(1) -> prefill(1, cpu) =gloo=> decode(1, cpu)"
    assert capsys.readouterr().out == ""  # named, not picked: nothing to explain


def test_a_layout_fills_its_pools_under_the_flags_given():
    layout, cfg = _cfg("disagg", {"num_decode_workers": 3, "decode_max_workers": 5}, Hardware(cpus=8, gpus=0))
    assert (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.engine.num_threads) == (1, 3, 4)
    assert process_map(layout, cfg) == \
        "pdserve: layout=disagg  ingress(1) -> router(1) -> prefill(1, cpu) =gloo=> decode(3..5, cpu)"
    layout, cfg = _cfg("colocated", {"num_threads": 1}, Hardware(cpus=2, gpus=0))
    assert cfg.colocated and cfg.engine.num_threads == 1
    assert process_map(layout, cfg) == \
        "pdserve: layout=colocated  ingress(1) -> router(1) -> decode(1, cpu, prefills too), no KV transfer"
    one_gpu = pool_settings("disagg", Hardware(cpus=8, gpus=1))
    cfg = ServeConfig.from_dict(one_gpu)
    assert cfg.worker_num_gpus == 0.5 and process_map("disagg", cfg).endswith("=gloo-staged=> decode(1, cuda)")


def test_a_cpu_cluster_gets_a_colocated_worker_per_node():
    layout, cfg = _cfg("ray", {}, Hardware(cpus=8, gpus=0, nodes=3))
    assert layout == "colocated" and cfg.num_decode_workers == 3 and cfg.engine.num_threads == 8


@pytest.mark.parametrize("given", [{"num_prefill_workers": 1}, {"num_decode_workers": 2}, {"worker_num_cpus": 0.5},
                                   {"prefill_resources": {"prefill": 0.01}}])
def test_under_auto_any_layout_setting_keeps_the_layout_as_given(given, capsys):
    layout, out = resolve("auto", dict(given), Hardware(cpus=2, gpus=0))
    assert out == given and layout == "disagg"  # ServeConfig's defaults: 1 prefill + 1 decode worker
    assert capsys.readouterr().out == ""
    assert resolve("auto", {"num_prefill_workers": 0}, Hardware(cpus=2, gpus=0))[0] == "colocated"


@pytest.mark.parametrize("argv, said", [
    (["--layout", "colocated", "--prefill-workers", "1"], "--layout colocated has no prefill pool"),
    (["--layout", "disagg", "--prefill-workers", "0"], "--layout disagg needs a prefill pool"),
    (["--layout", "single", "--decode-max-workers", "2"], "--layout single serves one engine"),
])
def test_a_flag_that_contradicts_the_layout_is_refused_before_anything_starts(argv, said, capsys):
    assert main(["serve", "--port", str(free_port()), *argv]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("bf16", ["AMX", "AVX512-BF16"])
def test_a_cpu_that_multiplies_bf16_in_hardware_serves_in_bfloat16_unless_told(capsys, bf16):
    """bf16 matrix products run in hardware there (2-6x fp32's rate); `--dtype` decides otherwise."""
    hw = Hardware(cpus=2, gpus=0, cpu_bf16=bf16)
    assert _cfg("colocated", {}, hw)[1].engine.dtype == "bfloat16"
    assert f"dtype bfloat16 (this CPU multiplies bf16 matrices in hardware, {bf16})" in capsys.readouterr().out
    assert _cfg("auto", {"dtype": "float32"}, hw)[1].engine.dtype == "float32"
    # A layout flag keeps the layout as given; the dtype is picked all the same.
    assert resolve("auto", {"num_prefill_workers": 1}, hw)[1] == {"num_prefill_workers": 1, "dtype": "bfloat16"}


def test_cpu_flags_name_the_bf16_instructions(tmp_path):
    def flags(line):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {line}\n")
        return cpu_bf16(str(tmp_path / "cpuinfo"))
    assert flags("fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile") == "AMX"
    assert flags("fpu sse avx2 avx512f avx512_bf16") == "AVX512-BF16"
    assert flags("fpu sse avx2 avx512f avx512_vnni") == ""  # bf16 only emulated: slower than fp32


def test_without_bf16_hardware_or_on_a_gpu_the_dtype_is_the_engines_auto(capsys):
    assert "dtype" not in resolve("colocated", {}, Hardware(cpus=2, gpus=0))[1]  # fp32: bf16 is no faster there
    gpu = _cfg("auto", {}, Hardware(cpus=16, gpus=1, cpu_bf16="AMX"))[1]
    assert gpu.engine.device == "cuda" and gpu.engine.dtype == "bfloat16"  # auto on CUDA
    assert "dtype bfloat16 (this CPU" not in capsys.readouterr().out
