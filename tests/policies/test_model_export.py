"""``rlvla3 export --format lerobot``: LeRobot loads what we write and acts as we do, for each
model family (pi0.5 as LeRobot 0.6.1's ``pi05``, GR00T-N1.5 as LeRobot 0.5.1's ``groot``,
GR00T-N1.7 as LeRobot 0.6.1's ``groot``).

LeRobot's side was run by hand on the export of each fixture's round-trip checkpoint
(``tests/data/check_pi05_export.py``, ``tests/data/groot_reference.py --export``,
``tests/data/groot17_reference.py --export``); its actions
and the digest of the weights it loaded are in the fixture's ``export_reference.safetensors``.
Here the same export is made again with rlvla3 only, its digest checked, and our actions
(from the checkpoint, and from the export loaded back) compared with LeRobot's.
"""

from __future__ import annotations

import pytest

from measure.parity import groot, groot17
from measure.parity import vla as pi05

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("model", [pi05, groot, groot17], ids=["pi05", "groot", "groot17"])
def test_lerobot_acts_on_our_export_as_we_do(model, tmp_path):
    fixture = model.fixture_path()
    if not (fixture / model.EXPORT_REFERENCE).is_file():
        pytest.skip(f"{fixture} has no LeRobot export reference")
    stages = model.compare_export(fixture, tmp_path)
    checked = [s for s in stages if "must differ" not in s.name]
    assert len(checked) == 4
    assert all(s.error <= model.TOLERANCE for s in checked), checked
    moved = next(s for s in stages if "must differ" in s.name)
    assert moved.max_abs_diff > 1e-2  # the export carries the trained weights, not the base
