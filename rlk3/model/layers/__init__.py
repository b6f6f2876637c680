"""The K3 layers: KDA, Gated MLA, Stable LatentMoE, Attention Residuals, norms and SiTU-GLU."""
