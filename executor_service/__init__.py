"""The executor: one per GPU pod; holds a base model's MoE layers and many adapters,
and serves Forward."""
