"""ZeRO: optimizer state (v0), gradients (v1) and parameters (v2) sharded over a stage group."""
