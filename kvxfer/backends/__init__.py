"""Copy backends behind :mod:`kvxfer.ops`.

Each backend module exposes ``gather(src, wire)``, ``scatter(wire, dst)``, ``copy(src, dst)``
and ``is_available(device) -> bool``. Arguments were validated by :mod:`kvxfer.ops`:
``src``/``dst`` are :class:`~kvxfer.backends.base.PagedSide` objects and ``wire`` is a
contiguous tensor viewed as ``[H, L, KV, T, D]`` (``KV`` = 2, or 1 for MLA).
"""
