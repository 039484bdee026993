#!/usr/bin/env bash
# Build the scratch environment that runs LeRobot 0.5.1's GR00T-N1.5 (run by hand, never in CI;
# never a dependency of rlvla3). LeRobot 0.5.1 asks for Python >= 3.12 and torch < 2.11; it runs
# on Python 3.11 with the CPU torch 2.13 wheel once its five uses of PEP 695 generic syntax are
# rewritten, and on the CPU once its vendored Eagle model asks for SDPA instead of
# flash_attention_2 in SigLIP. Usage: bash tests/data/groot_reference_env.sh [VENV]
set -euo pipefail
VENV=${1:-/work/scratch/groot-ref}
python3.11 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0 transformers==5.3.0 safetensors numpy
"$PIP" install -q 'diffusers<0.36' 'peft>=0.18,<1' 'einops<0.9' draccus==0.10.0 \
  'huggingface-hub>=1,<2' pillow 'numpy<2.3' jsonlines termcolor deepdiff 'gymnasium>=1.1' \
  imageio packaging 'datasets>=4,<5' accelerate dm-tree tokenizers jinja2 'av<16' opencv-python-headless pyserial pynput
# torchvision (the Eagle image processor's resize): the release built for torch 2.13, whose CUDA C
# ops do not load beside the CPU wheel; its registrations of those ops are skipped (transforms
# need none of them).
"$PIP" install -q --no-deps torchvision==0.28.0
TV=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torchvision
"$VENV/bin/python" - "$TV" <<'PY'
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
"$PIP" download -q lerobot==0.5.1 --no-deps --ignore-requires-python -d "$TMP"
"$PIP" install -q --no-deps --ignore-requires-python "$TMP"/lerobot-0.5.1-py3-none-any.whl
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
L="$SITE/lerobot"
# The five PEP 695 lines, in Python 3.11 spelling.
"$VENV/bin/python" - "$L" <<'PY'
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
    "datasets/streaming_dataset.py": [
        ("class Backtrackable[T]:", "T = TypeVar('T')\n\n\nclass Backtrackable(Generic[T]):")],
    "utils/io_utils.py": [
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
    if name in ("datasets/streaming_dataset.py", "utils/io_utils.py") and "TypeVar" not in \
            text.split("\n\n\n")[0] and "from typing import Generic, TypeVar" not in text:
        text = "from typing import Generic, TypeVar\n" + text
    f.write_text(text)
PY
# SigLIP on the CPU: SDPA instead of flash_attention_2 (one line of the vendored Eagle model).
sed -i 's/config.vision_config._attn_implementation = "flash_attention_2"/config.vision_config._attn_implementation = "sdpa"/' \
  "$L/policies/groot/eagle2_hg_model/modeling_eagle2_5_vl.py"
"$VENV/bin/python" -c "import lerobot.policies.groot.modeling_groot, lerobot.policies.groot.processor_groot; print('lerobot groot imports')"
