"""The example model repository (Triton layout) and the script that builds it."""
