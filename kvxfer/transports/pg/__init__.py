"""The ``pg`` transport: a 2-rank torch ProcessGroup per (exporter rank, loader rank) pair
(NCCL, or Gloo on CPU and through pinned host memory when both ranks share a GPU), through the
chunked, double-buffered staging pipeline."""
