"""Sampling on the logits' device: host planning (plan.py, upload.py), counter-based noise (noise.py)
and the batched device ops (device_ops.py). The entry point is `engine.device_sampler.sample_on_device`."""
