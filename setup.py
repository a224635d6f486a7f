"""Build hook: packages are declared in pyproject.toml; CUDA kernels are compiled here (csrc/)."""

from setuptools import setup

setup()
