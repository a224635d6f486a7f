"""kvxfer benchmarks and profiling helpers (run the scripts; see README.md)."""
