"""Backends behind small interfaces: Megatron (training, torch_dist checkpoints) and HF (architectures, safetensors, name mapping)."""
