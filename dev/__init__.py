"""Developer tools: kernel probes, A/B timing, GPU-machine set-up and GPU scripts (not part of
the package; run from the repository root as ``python -m dev.NAME``)."""
