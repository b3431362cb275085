"""`StepInputs`: a step's integer arrays reach the device in one non-blocking copy, unchanged; and the
attention kernels a CUDA forward pass may use."""

from __future__ import annotations

import pytest
import torch

from device_params import DEVICES
from engine.step_inputs import StepInputs, upload_ints


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_come_back_in_order_with_their_values(device):
    arrays = [[5, 6, 7], [], [2**40, -1], list(range(100)), [0]]
    inputs = StepInputs()
    keys = [inputs.add(a) for a in arrays]
    got = inputs.upload(torch.device(device))
    assert keys == list(range(len(arrays)))
    for a, t in zip(arrays, got):
        assert t.dtype == torch.long and t.device.type == device and t.is_contiguous()
        assert t.tolist() == a
    assert upload_ints((3, 4), torch.device(device)).tolist() == [3, 4]


@pytest.mark.gpu
def test_cuda_upload_does_not_synchronize():
    inputs = StepInputs()
    for n in range(1, 20):
        inputs.add(list(range(n)))
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = inputs.upload(torch.device("cuda"))
        total = sum(t.sum() for t in got)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(total) == sum(n * (n - 1) // 2 for n in range(1, 20))


def test_cuda_forward_leaves_cudnn_attention_out():
    """A CUDA forward pass runs SDPA without cuDNN's attention (a graph build per new shape); a CPU one
    changes nothing. The switch is host-side state, checked here without a GPU."""
    from engine.attention import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
