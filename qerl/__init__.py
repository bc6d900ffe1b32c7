"""qerl: a self-hosted service that RL-fine-tunes LLMs (NVFP4 base + LoRA, GRPO/DAPO, AQN)."""
__version__ = "0.1.0"
