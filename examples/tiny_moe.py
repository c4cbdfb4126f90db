"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) that `optimize build` can calibrate.

    python examples/tiny_moe.py OUT_DIR            # writes OUT_DIR/<model_type>/ for each
    optimize build OUT_DIR/deepseek_v3 --target blackwell --recipe production -o artifacts/tiny-dsv3

The weights are random (structure only: their accuracy figures mean nothing). Each checkpoint carries the
stories260K tokenizer when ../shared is present (else the generated default's), with the vocabulary sized to
it, so the default calibration and evaluation text tokenize for it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from optimizer.defaults import generated_checkpoint, shared_dir  # noqa: E402
from tests.tiny_models import TINY_CONFIGS, make_tiny_checkpoint  # noqa: E402

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def main(out: Path) -> None:
    import json

    shared = shared_dir()
    source = shared / "models" / "stories260K" if shared else generated_checkpoint()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    for model_type in MOE_TYPES:
        path = out / model_type
        make_tiny_checkpoint(model_type, path, overrides={"vocab_size": vocab})
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, path / name)
        print(f"{path}  ({model_type}, {TINY_CONFIGS[model_type].get('num_hidden_layers')} layers, "
              f"tokenizer of {source.name})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2].strip())
    main(Path(sys.argv[1]))
