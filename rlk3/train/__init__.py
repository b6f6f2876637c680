"""Training: the SFT stage, the RL trainer (optimizer, QB bias updates), checkpoints."""
