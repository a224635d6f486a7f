"""The ``nixl`` transport: one-sided READs through a NIXL agent per rank (UCX), direct when
both caches line up, else staged (optional: ``kvxfer[nixl]``)."""
