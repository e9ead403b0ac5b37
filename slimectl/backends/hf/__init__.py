"""HF checkpoints: supported architectures, safetensors reading and writing, the dtype table, and the HF <-> Megatron name mapping."""
