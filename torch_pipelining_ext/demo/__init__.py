"""Demo: train a small MoE transformer with pipeline x expert parallelism and real OVERLAP_F_B overlap."""
