"""Demo: train a tiny Hugging Face MoE with pipeline x expert parallelism and the concurrent OVERLAP_F_B."""
