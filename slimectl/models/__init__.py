"""Model architectures and HF <-> Megatron weight mapping (torch only; no Megatron import)."""
