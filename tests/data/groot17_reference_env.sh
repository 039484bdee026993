#!/usr/bin/env bash
# Build the scratch environment that runs LeRobot 0.6.1's GR00T-N1.7 (run by hand, never in CI;
# never a dependency of rlvla3). LeRobot 0.6.1 asks for Python >= 3.12 and torch < 2.12; it runs
# on Python 3.11 with the CPU torch 2.13 wheel once its PEP 695 generic syntax (eight lines) is
# rewritten. Usage: bash tests/data/groot17_reference_env.sh [VENV]
set -euo pipefail
VENV=${1:-/work/scratch/lerobot061}
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0 'transformers>=5.4,<5.6' safetensors 'numpy<2.3' \
  'diffusers>=0.38,<0.40' 'peft>=0.18,<1' 'einops<0.9' 'draccus>=0.11.6,<0.12' \
  'huggingface-hub>=1.6,<2' pillow jsonlines termcolor deepdiff 'gymnasium>=1.1' imageio \
  'packaging<26' 'datasets>=4.8,<5' 'accelerate>=1.14' dm-tree tokenizers jinja2 'av<16' \
  opencv-python-headless 'timm>=1,<1.1' pandas pyarrow requests 'qwen-vl-utils<0.1'
# torchvision (the Qwen3-VL image processor's resize): the release built for torch 2.13, whose
# CUDA C ops do not load beside the CPU wheel; its registrations of those ops are skipped.
"$PIP" install -q --no-deps torchvision==0.28.0
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" - "$SITE/torchvision" <<'PY'
import sys
from pathlib import Path

f = Path(sys.argv[1]) / "__init__.py"
s = f.read_text()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = ("try:  # CUDA C ops: absent beside the CPU torch\n"
       "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
       "except RuntimeError:\n    pass\nfrom torchvision import (\n")
if old in s:
    f.write_text(s.replace(old, new, 1))
PY
TMP=$(mktemp -d)
"$PIP" download -q lerobot==0.6.1 --no-deps --ignore-requires-python -d "$TMP"
"$PIP" install -q --no-deps --ignore-requires-python "$TMP"/lerobot-0.6.1-py3-none-any.whl
# The PEP 695 lines, in Python 3.11 spelling.
"$VENV/bin/python" - "$SITE/lerobot" <<'PY'
import sys
from pathlib import Path

root = Path(sys.argv[1])
edits = {
    "processor/pipeline.py": [
        ("class DataProcessorPipeline[TInput, TOutput](HubMixin):",
         "class DataProcessorPipeline(HubMixin, Generic[TInput, TOutput]):"),
        ("from typing import Any, TypedDict, TypeVar, cast",
         "from typing import Any, Generic, TypedDict, TypeVar, cast")],
    "motors/motors_bus.py": [("type NameOrID = str | int", "NameOrID = str | int"),
                             ("type Value = int | float", "Value = int | float")],
    "datasets/aggregate.py": [
        ("type FeatureDict = dict[str, dict[str, Any]]", "FeatureDict = dict[str, dict[str, Any]]"),
        ("type ChunkFile = tuple[int, int]", "ChunkFile = tuple[int, int]"),
        ("type VideoIndexState = dict[str, VideoIndex]", "VideoIndexState = dict[str, VideoIndex]")],
    "datasets/streaming_dataset.py": [
        ("from typing import Literal", "from typing import Generic, Literal, TypeVar"),
        ("class Backtrackable[T]:", "T = TypeVar('T')\n\n\nclass Backtrackable(Generic[T]):")],
    "utils/io_utils.py": [
        ("from typing import Any", "from typing import Any, TypeVar"),
        ("def deserialize_json_into_object[T: JsonLike](fpath: Path, obj: T) -> T:",
         "T = TypeVar('T', bound=JsonLike)\n\n\n"
         "def deserialize_json_into_object(fpath: Path, obj: T) -> T:")],
}
for name, pairs in edits.items():
    f = root / name
    text = f.read_text()
    for old, new in pairs:
        if old in text:
            text = text.replace(old, new, 1)
    f.write_text(text)
PY
"$VENV/bin/python" -c "import lerobot.policies.groot.modeling_groot, lerobot.policies.groot.processor_groot; print('lerobot 0.6.1 groot imports')"
