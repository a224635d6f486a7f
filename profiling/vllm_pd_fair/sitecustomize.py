"""Two changes to vLLM's NixlConnector for profiling/bench_vllm_pd.py on a CPU host.

Loaded by every Python process of a NixlConnector server the benchmark starts (this folder is
first on their ``PYTHONPATH``; ``KVXFER_BENCH_NIXL_FAIR=1``), and by nothing else:

1. NixlConnector's worker pins the calling thread - vLLM's worker main thread, which runs the
   forward pass - to the last core of each NUMA node (``os.sched_setaffinity(0, ...)`` in
   ``nixl/base_worker.py``, "reserve different cores for start_load_kv() from model_forward()");
   on a 2-core host the forward pass then shares one core with everything else (about 2 s a
   token). That call is skipped, with a line on stderr.
2. NIXL's agent is made with its progress thread on (``nixl_agent_config`` defaults
   ``enable_prog_thread=True``), which spins: an idle worker at 45-135 % CPU. It is made with
   the thread off; NixlConnector's worker drives the transfers from its steps (``get_finished``
   checks every transfer each step).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

if os.environ.get("KVXFER_BENCH_NIXL_FAIR") == "1":
    _real_setaffinity = os.sched_setaffinity

    def _sched_setaffinity(pid, mask):
        caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
        if "kv_connector/v1/nixl/" in caller:
            print(
                f"[bench_vllm_pd fairness] skipped NixlConnector's os.sched_setaffinity({pid}, "
                f"{sorted(mask)}) ({caller})",
                file=sys.stderr,
                flush=True,
            )
            return None
        return _real_setaffinity(pid, mask)

    os.sched_setaffinity = _sched_setaffinity

    _API = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

    def _no_progress_thread(module) -> None:
        cls = getattr(module, "nixl_agent_config", None)
        if cls is None or getattr(cls, "_bench_fair", False):
            return
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            kwargs["enable_prog_thread"] = False
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls._bench_fair = True
        print(
            f"[bench_vllm_pd fairness] {module.__name__}.nixl_agent_config: progress thread off",
            file=sys.stderr,
        )

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _API:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module):
                real_exec(module)
                _no_progress_thread(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
