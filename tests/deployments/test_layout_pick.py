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


def test_auto_counts_a_tp_worker_as_its_ranks_and_says_so(capsys):
    """One GPU a rank: 4 GPUs hold a TP-2 prefill and a TP-2 decode worker (disagg), 3 do not, so auto
    serves colocated workers of decode_tp GPUs and says why; on CPUs a worker's ranks split its node."""
    layout, cfg = _cfg("auto", {"prefill_tp": 2, "decode_tp": 2}, Hardware(cpus=16, gpus=4))
    assert layout == "disagg" and (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.worker_num_gpus) == (1, 1, 1.0)
    said = capsys.readouterr().out
    assert "disagg (1 prefill worker of 2 ranks + 1 decode worker of 2 ranks: one GPU a rank)" in said
    assert process_map(layout, cfg).endswith("prefill(1, cuda, tp 2) =nccl=> decode(1, cuda, tp 2)")
    layout, cfg = _cfg("auto", {"prefill_tp": 2, "decode_tp": 2}, Hardware(cpus=16, gpus=3))
    assert layout == "colocated" and cfg.num_decode_workers == 1 and cfg.decode_tp == 2
    assert ("colocated (1 decode worker of 2 ranks: one GPU a rank; disagg needs prefill_tp + decode_tp = 4 GPUs)"
            in capsys.readouterr().out)
    layout, cfg = _cfg("auto", {"prefill_tp": 1, "decode_tp": 2}, Hardware(cpus=16, gpus=8))
    assert (cfg.num_prefill_workers, cfg.num_decode_workers) == (4, 2)  # half the GPUs each side
    layout, cfg = _cfg("auto", {"decode_tp": 2}, Hardware(cpus=8, gpus=0))
    assert layout == "colocated"
    assert (cfg.num_decode_workers, cfg.engine.num_threads, cfg.worker_num_cpus) == (1, 4, 4.0)
    assert "each rank 4 CPUs and 4 threads (a worker's ranks share one node's cores)" in capsys.readouterr().out
    # Without TP the line is as it was.
    _cfg("auto", {"decode_tp": 1}, Hardware(cpus=8, gpus=0))
    assert "rank" not in capsys.readouterr().out


def test_a_named_layout_sizes_its_ranks_and_refuses_tp_the_gpus_cannot_hold():
    from deployments.config import ServeConfigError

    # 2 cores for a TP-2 prefill and a TP-1 decode worker: 3 ranks of 0.6666 CPUs (2/3 rounded down fits)
    layout, cfg = _cfg("disagg", {"prefill_tp": 2}, Hardware(cpus=2, gpus=0))
    assert (cfg.engine.num_threads, cfg.worker_num_cpus) == (1, 0.6666) and 3 * cfg.worker_num_cpus <= 2
    layout, cfg = _cfg("disagg", {"prefill_tp": 2, "decode_tp": 2}, Hardware(cpus=16, gpus=0))
    assert (cfg.num_prefill_workers, cfg.num_decode_workers, cfg.engine.num_threads) == (1, 1, 4)
    layout, cfg = _cfg("colocated", {"decode_tp": 2}, Hardware(cpus=4, gpus=4))
    assert cfg.num_decode_workers == 2 and cfg.worker_num_gpus == 1.0
    with pytest.raises(ServeConfigError, match=r"prefill_tp=2 \+ decode_tp=1 needs 3 GPUs .* found 1"):
        resolve("disagg", {"prefill_tp": 2}, Hardware(cpus=8, gpus=1))
    with pytest.raises(ServeConfigError, match="decode_tp=4 needs 4 GPUs"):
        resolve("auto", {"decode_tp": 4}, Hardware(cpus=8, gpus=2))
    assert pool_settings("disagg", Hardware(cpus=8, gpus=1))["worker_num_gpus"] == 0.5  # TP 1 still shares one
