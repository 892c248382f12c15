"""Run by .venv-speculators/bin/python (not by pytest): load a speculators-layout export with
vllm-project/speculators' own ``SpeculatorModel.from_pretrained`` and write down what it loaded,
for tests/integration/test_speculators_lib.py to check from the pipeline venv.

    speculators_loader.py EXPORT_DIR OUT_DIR
writes OUT_DIR/loaded.safetensors (the loaded model's state dict, as loaded) and
OUT_DIR/loaded.json (class, library versions, the loaded config, the fields speculators' config declares).
"""

import json
import sys
from importlib import metadata
from pathlib import Path


def speculators_fields(config_class) -> list[str]:
    """The config fields speculators itself declares (its classes' pydantic fields), not the ones
    pydantic also lists for transformers' PretrainedConfig underneath."""
    own = set()
    for cls in config_class.__mro__:
        if cls.__module__.startswith("speculators"):
            own |= set(getattr(cls, "__annotations__", {}))
    return sorted(name for name in config_class.model_fields if name in own)


def main(export_dir: str, out_dir: str) -> None:
    from safetensors.torch import save_file
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(export_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(out / "loaded.safetensors"))
    config = model.config
    info = {
        "class": type(model).__name__,
        "speculators": metadata.version("speculators"),
        "transformers": metadata.version("transformers"),
        "torch": metadata.version("torch"),
        "config_fields": speculators_fields(type(config)),
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        "use_draft_vocab": bool(model.use_draft_vocab),
        "embed_requires_grad": bool(model.embed_tokens.weight.requires_grad),
    }
    (out / "loaded.json").write_text(json.dumps(info, indent=2, sort_keys=True))


if __name__ == "__main__":
    main(*sys.argv[1:3])
