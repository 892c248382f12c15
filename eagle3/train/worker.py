"""What torchrun runs on every process: ``python -m eagle3.train.worker REQUEST.json``.

The request (written by the stage) carries the whole config, the shard names, the resolved
target path and layer ids. Output goes to stdout (rank-prefixed), which the Prefect task streams
into its log; the exit code says whether the job finished.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m eagle3.train.worker REQUEST.json", file=sys.stderr)
        return 2
    from eagle3.config import PipelineConfig
    from eagle3.train.trainer import Dist, Trainer

    request = json.loads(open(args[0]).read())
    dist = Dist()

    def log(message: str) -> None:
        print(f"[rank {dist.rank}] {message}", flush=True)

    try:
        trainer = Trainer(
            PipelineConfig(**request["config"]),
            request["shards"],
            request["model_path"],
            request["layer_ids"],
            dist,
            log,
        )
        result = trainer.train()
        if dist.rank == 0:
            from eagle3.durable import atomic_write_json

            atomic_write_json(request["result_path"], {**result, "world_size": dist.world})
        log(f"done: {result['steps']} steps, {result['tokens']} tokens in {result['seconds']:.1f} s")
    finally:
        dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
