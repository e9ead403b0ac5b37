"""HF checkpoints: supported architectures, safetensors reading, and the HF <-> Megatron name mapping."""
