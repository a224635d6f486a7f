"""The ``ipc`` transport: on one host, the loader maps the exporter's cache memory (shared
memory for CPU caches, CUDA IPC for CUDA caches) and copies straight from it, then checks the
exporter's block epochs (no block released meanwhile is delivered)."""

from .shm import alloc_shm_caches

__all__ = ["alloc_shm_caches"]
