"""Write ``tests/data/lerobot_v30`` with LeRobot itself (run by hand, never in CI).

The dataset: 3 episodes (lengths in ``LENGTHS``) at ``FPS`` frames/s, two tasks, an 8-d
``observation.state``, a 7-d ``action``, one camera stored as video
(``observation.images.front``, LeRobot's default AV1 encoding) and one stored as PNG images in
the parquet rows (``observation.images.wrist``). Every value is a function of (episode, frame)
given below, so ``tests/datalake/test_datalake_lerobot.py`` checks what the lake reads frame for frame
and value for value without LeRobot installed.

Run it in a scratch environment that has LeRobot (it needs torch and torchvision; LeRobot 0.4.4
was used, installed with ``--no-deps`` beside torch 2.14.1 / torchvision 0.29.1 and its
dataset dependencies: datasets, huggingface-hub, av, pandas, pyarrow, jsonlines, draccus,
einops, deepdiff, termcolor, gymnasium, imageio)::

    /tmp/lerobot-venv/bin/python tests/data/make_lerobot_fixture.py [OUT]

Nothing is downloaded: ``LeRobotDataset.create`` with ``root`` set writes locally.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

FPS = 10
LENGTHS = (12, 7, 15)
HEIGHT, WIDTH = 48, 64
TASKS = ("put the bowl on the plate", "open the drawer")
STATE_DIM, ACTION_DIM = 8, 7
HERE = Path(__file__).resolve().parent
OUT = HERE / "lerobot_v30"


def task(episode: int) -> str:
    return TASKS[episode % len(TASKS)]


def image(episode: int, t: int, camera: int) -> np.ndarray:
    """uint8 ``[H, W, 3]``: flat 16x16 blocks (codec-friendly), a red level per frame, a
    checkerboard whose phase moves with ``t``, a blue level per camera and episode."""
    img = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    img[..., 0] = (episode * 61 + t * 29) % 256
    img[..., 1] = np.where(((yy // 16) + (xx // 16) + t) % 2 == 0, 40, 210)
    img[..., 2] = (camera * 100 + episode * 40 + 20) % 256
    return img


def state(episode: int, t: int) -> np.ndarray:
    out = np.cos(np.arange(STATE_DIM) * 0.7 + t * 0.3 + episode).astype(np.float32)
    out[0], out[1] = episode, t
    return out


def action(episode: int, t: int) -> np.ndarray:
    out = np.sin(np.arange(ACTION_DIM) * 1.3 + t * 0.2 - episode).astype(np.float32)
    out[0], out[1] = episode, t
    return out


def main(out: Path = OUT) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        "observation.images.front": {
            "dtype": "video", "shape": (HEIGHT, WIDTH, 3), "names": ["height", "width", "channels"],
        },
        "observation.images.wrist": {
            "dtype": "image", "shape": (HEIGHT, WIDTH, 3), "names": ["height", "width", "channels"],
        },
        "observation.state": {"dtype": "float32", "shape": (STATE_DIM,), "names": None},
        "action": {"dtype": "float32", "shape": (ACTION_DIM,), "names": None},
    }
    if out.exists():
        shutil.rmtree(out)
    ds = LeRobotDataset.create(
        repo_id="rlvla3/lerobot_fixture", fps=FPS, features=features, root=out,
        robot_type="synthetic", use_videos=True,
    )
    for e, length in enumerate(LENGTHS):
        for t in range(length):
            ds.add_frame({
                "observation.images.front": image(e, t, 0),
                "observation.images.wrist": image(e, t, 1),
                "observation.state": state(e, t),
                "action": action(e, t),
                "task": task(e),
            })
        ds.save_episode()
    ds.finalize()
    for leftover in ("images",):  # temporary PNGs of the video camera, if any remain
        shutil.rmtree(out / leftover, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
