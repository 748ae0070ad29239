"""Optional features, applied to the core from outside through its seams. Imports layers/ and nothing above it."""
