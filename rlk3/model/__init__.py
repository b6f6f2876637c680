"""The K3 hybrid model (KDA + Gated MLA + Stable LatentMoE)."""
