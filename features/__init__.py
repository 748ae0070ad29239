"""Optional features, applied to the core from outside."""
